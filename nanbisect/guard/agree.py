"""Agreeing, with a bounded wait, on what every rank did while the bundle was written.

Once the ranks start writing their parts, none of them may wait in a collective: a rank that exits,
fails or hangs while writing would keep the others there until the process group's timeout (30
minutes), and then the bundle would be lost on every rank. Instead each rank posts its outcome on
the process group's store (`Board`), and the others wait for it at most a deadline of their own.
A post is a compare-and-set of the rank's own key: whoever sets the key first decides, so a rank
that comes too late finds it already set ("no result in time") and every rank reads the same
outcome for every rank, without another collective.

Guarantees: `Board.gather` returns within its deadline (plus one store round trip per rank
when the deadline is reached), and every caller of one round gets the same outcomes; `Running`
runs a write on a thread of its own and stops waiting at a deadline (the write itself cannot be
stopped: it goes on, and finds its round already decided); `held_sigterm` holds SIGTERM back
while the bundle is written (torchrun's agent sends it to every rank as soon as one rank fails,
SIGKILL 30 s later) and delivers it afterwards; the wait is then cut to `TERM_GRACE`.
Not guaranteed: a store that is itself gone (hosted by a rank that died; torchrun and
`nanbisect.multirank.spawn` host it in the agent) is an error, not a wait.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from nanbisect import proc
from nanbisect.util.numbers import env

WRITE_TIMEOUT = 300.0   # seconds a rank may take to write its part (NANBISECT_WRITE_TIMEOUT)
TERM_GRACE = 20.0       # seconds still waited after a SIGTERM (torchrun SIGKILLs 30 s after it)
_POLL = 0.05            # the longest sleep between two looks at the store


def write_timeout() -> float:
    """``NANBISECT_WRITE_TIMEOUT`` (seconds), default `WRITE_TIMEOUT`; `BadInput` when not a
    number > 0 (read when the Guard is made, so a typo fails before training, not at the NaN)."""
    return env("NANBISECT_WRITE_TIMEOUT", WRITE_TIMEOUT)


class Clock:
    """Deadlines that a SIGTERM shortens: `until` is the earlier of ``at`` and `TERM_GRACE` after
    the signal (``term()`` is when it came, or None)."""

    def __init__(self, term: Callable[[], float | None] = lambda: None):
        self.term = term

    def until(self, at: float) -> float:
        t = self.term()
        return at if t is None else min(at, t + TERM_GRACE)

    def left(self, at: float) -> float:
        return self.until(at) - time.monotonic()


class Board:
    """Rounds of per-rank outcomes on a store (a ``torch.distributed`` Store, under a prefix of
    its own for this bundle). Every value is a JSON object; ``by`` (the rank that set it) is
    added, so that a value another rank set never reads as one's own.

    >>> from torch.distributed import HashStore
    >>> store = HashStore()
    >>> b0, b1 = Board(store, 0), Board(store, 1)
    >>> b1.post("w", {"ok": True})["ok"]
    True
    >>> got = b0.gather("w", [0, 1], time.monotonic(), Clock(), lambda r: {"ok": False})
    >>> got[0], got[1]["ok"]
    ({'by': 0, 'ok': False}, True)
    """

    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank

    def raw(self, value: dict) -> str:
        return json.dumps({**value, "by": self.rank}, sort_keys=True)

    def claim(self, name: str, value: dict, over: dict | None = None) -> dict:
        """Set this rank's outcome of round ``name`` unless it is set already (to ``over``, with
        ``over``: replace exactly that); return the outcome that stands. Nobody waits for it
        until `done`."""
        got = self.store.compare_set(f"{name}/{self.rank}", "" if over is None else
                                     json.dumps(over, sort_keys=True), self.raw(value))
        return json.loads(got.decode())

    def done(self, name: str) -> None:
        """This rank's outcome of round ``name`` is final (and its part, if any, in place)."""
        self.store.add(f"{name}/count", 1)

    def post(self, name: str, value: dict) -> dict:
        """`claim` and, when it stands, `done`."""
        got = self.claim(name, value)
        if got == json.loads(self.raw(value)):
            self.done(name)
        return got

    def gather(self, name: str, ranks: list[int], at: float, clock: Clock,
               late: Callable[[int], dict]) -> dict[int, dict]:
        """Every outcome of round ``name`` for ``ranks``: wait until all of them are done or the
        deadline ``at`` (a `time.monotonic` time, shortened by a SIGTERM); then a rank still
        silent gets ``late(rank)``, set by whichever rank reaches its deadline first."""
        def settled() -> bool:
            return (self.store.add(f"{name}/count", 0) >= len(ranks)
                    or self.store.check([f"{name}/closed"]))

        delay = 0.001
        while not settled() and clock.left(at) > 0:
            time.sleep(max(0.0, min(delay, clock.left(at))))
            delay = min(delay * 2, _POLL)
        if settled():
            raw = self.store.multi_get([f"{name}/{r}" for r in ranks])
        else:   # NB: compare-and-set: a rank that claims at this very moment keeps its own
            raw = [self.store.compare_set(f"{name}/{r}", "", self.raw(late(r))) for r in ranks]
            self.store.set(f"{name}/closed", "1")
        return {r: json.loads(v.decode()) for r, v in zip(ranks, raw)}

    def say(self, name: str, value: dict) -> None:
        """One value for everyone (the leader's: where the bundle went)."""
        self.store.set(name, json.dumps(value))

    def hear(self, name: str, at: float, clock: Clock) -> dict | None:
        """The value `say` set, or None when it is not there by the deadline."""
        delay = 0.001
        while not self.store.check([name]):
            if clock.left(at) <= 0:
                return None
            time.sleep(max(0.0, min(delay, clock.left(at))))
            delay = min(delay * 2, _POLL)
        return json.loads(self.store.get(name).decode())


class Running:
    """``fn()`` on a daemon thread of its own, waited for with deadlines (`wait`); it cannot be
    stopped: a write that hangs goes on hanging, and finds its round decided when it ends.

    >>> r = Running(lambda: 1 + 1)
    >>> r.wait(time.monotonic() + 5, Clock()), r.value, r.error
    (True, 2, None)
    """

    def __init__(self, fn: Callable[[], Any]):
        self.value: Any = None
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="nanbisect-write",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except Exception as e:  # noqa: BLE001 - handed to the waiter, who decides
            self.error = e

    def wait(self, at: float, clock: Clock) -> bool:
        """Whether it finished by the deadline ``at`` (shortened by a SIGTERM)."""
        while self._thread.is_alive():
            left = clock.left(at)
            if left <= 0:
                return False
            self._thread.join(min(left, _POLL))   # NB: short joins: a SIGTERM shortens the wait
        return True


@contextmanager
def held_sigterm() -> Iterator[Callable[[], float | None]]:
    """Hold SIGTERM back inside the block; yields ``term()``: when it came (`time.monotonic`),
    or None. On leaving, the previous handler is put back and a held SIGTERM is delivered to
    it (by default the process ends). Only in the main thread, and only over the default
    handler or a Python one (a handler set from C code, or SIG_IGN, is left alone):
    `nanbisect.proc.deferred`."""
    with proc.deferred(signal.SIGTERM) as term:
        yield term
