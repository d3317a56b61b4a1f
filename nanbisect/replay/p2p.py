"""Point-to-point ops (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` and what
``torch.distributed.pipelining`` issues) as nanbisect's dispatch modes see them: which they are,
which rank is at the other end, which direction of a pipeline they carry, and stand-in works that
let a mode look at what a receive brought without waiting for it where the caller does.

A pipeline schedule issues its sends and receives together and waits for them later, and gloo's
send and receive works never return from a second ``wait``: a mode must neither wait for a
point-to-point work when it is issued nor wait on the caller's work itself. `StandIns.hand_back`
waits for the real work once, on a thread of its own, bounded by a deadline, runs the mode's
callback on what arrived, and only then completes the stand-in work it handed to the caller (so
the caller reads a received tensor after the mode counted it). Shared by the Guard's re-run of
the step (`nanbisect.guard.deadline.Settled`), a replay's first pass (`nanbisect.multirank.ledger`)
and its op recording (`nanbisect.replay.recorder`).

Guarantees: a stand-in completes when the real work does, or fails at the deadline (``unmet``
says which op did not complete); ``finish()`` returns once every watcher ended (each by the
deadline). Not guaranteed: a receive from any source is not handed back (its caller asks the
work for the sender, which a stand-in cannot tell).
"""
from __future__ import annotations

import datetime
import os
import threading
from typing import Any, Callable

import torch

from nanbisect.util import torch_internals as ti
from nanbisect.util.numbers import env
from nanbisect.util.text import exception_line

RANK_TIMEOUT = 600.0     # seconds (NANBISECT_RANK_TIMEOUT)
P2P = ("c10d::send", "c10d::recv_", "c10d::recv_any_source_")


def rank_timeout() -> float:
    """``NANBISECT_RANK_TIMEOUT`` (seconds; `BadInput` when not a number > 0) when set; else the
    job's own process-group timeout (what its collectives already wait: a rank that checkpoints
    or evaluates for longer between steps is slow, not lost), else `RANK_TIMEOUT`."""
    if os.environ.get("NANBISECT_RANK_TIMEOUT") is not None:
        return env("NANBISECT_RANK_TIMEOUT", RANK_TIMEOUT)
    return ti.group_timeout() or RANK_TIMEOUT


def bounded_wait(work, seconds: float) -> str:
    """Wait for a pybind c10d ``work`` at most ``seconds``: "" when it completed, else why not
    (the backend's error in one line, or that another rank did not join it)."""
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=seconds))
    except Exception as e:  # noqa: BLE001 - a timeout, a peer gone, an aborted communicator
        return exception_line(e, limit=200)
    return "" if done is not False else "another rank did not join it"


def is_p2p(func) -> bool:
    """Is ``func`` a point-to-point op (a send, a receive)?"""
    return ti.schema_name(func) in P2P


def is_receive(func) -> bool:
    """Is ``func`` a receive from a given rank (the kind a stand-in can hand back; one from any
    source is not: its caller asks the work for the sender)?"""
    return ti.schema_name(func) == "c10d::recv_"


def _named(func, args: tuple, kwargs: dict) -> dict:
    return dict(zip((a.name for a in ti.schema_arguments(func)), args)) | kwargs


def peer(func, args: tuple, kwargs: dict) -> int | None:
    """The global rank at the other end of a send or receive (None: any source, or unknown)."""
    import torch.distributed as dist

    named = _named(func, args, kwargs)
    local = named.get("dst", named.get("src"))
    if not isinstance(local, int):
        return None
    pg = ti.op_process_group(func, args, kwargs)
    try:
        return dist.get_global_rank(pg, local) if pg is not None else local
    except (RuntimeError, ValueError, KeyError):
        return local


def ends(func, args: tuple, kwargs: dict) -> list[int] | None:
    """[sender, receiver]: the global ranks at the two ends of a send or receive issued on this
    rank (None: the other end is not known, a receive from any source)."""
    import torch.distributed as dist

    me, other = dist.get_rank(), peer(func, args, kwargs)
    if other is None:
        return None
    return [me, other] if ti.schema_name(func) == "c10d::send" else [other, me]


_FORWARD, _BACKWARD = ("forward", "fwd"), ("backward", "bwd", "grad")


def _named_for(name: str, mine: str) -> str | None:
    """What a function's name says a send (``mine`` "send") or receive ("recv") it issues
    carries: the word after it (Megatron's ``send_forward_recv_backward``), else the one
    direction the name mentions (``backward_step``, a ``recv_grad`` of yours); None when it
    names none, or both without saying which is whose (``forward_backward_pipelining``)."""
    tokens = name.lower().strip("_").split("_")
    for i in range(len(tokens) - 1):
        if tokens[i] == mine and tokens[i + 1] in _FORWARD + _BACKWARD:
            return "forward" if tokens[i + 1] in _FORWARD else "backward"
    name = name.lower()
    fwd, bwd = any(w in name for w in _FORWARD), any(w in name for w in _BACKWARD)
    return None if fwd == bwd else "forward" if fwd else "backward"


def direction(func, frame) -> str | None:
    """"forward" or "backward": what a pipeline's send or receive carries (activations or
    gradients), from the code that issued it: torch.distributed.pipelining's batch description
    (``fwd_send_bwd_recv``), else a function on the way named for it (Megatron's
    ``send_forward_recv_backward``, ``send_backward``; a user's ``recv_grad``: `_named_for`);
    None: nothing says (the step's phase decides)."""
    mine = "send" if ti.schema_name(func) == "c10d::send" else "recv"
    f, depth = frame, 0
    while f is not None and depth < 16:
        desc = f.f_locals.get("desc") if f.f_code.co_name.endswith("p2p") else None
        if isinstance(desc, str):
            tokens = desc.split("_")
            for i in range(len(tokens) - 1):
                if tokens[i + 1] == mine and tokens[i] in ("fwd", "bwd"):
                    return "forward" if tokens[i] == "fwd" else "backward"
        said = _named_for(f.f_code.co_name, mine)
        if said is not None:
            return said
        f, depth = f.f_back, depth + 1
    return None


def pipeline_setup(frame) -> str | None:
    """Is a send or receive part of a ``torch.distributed.pipelining`` stage's set-up at its
    first step rather than of the step? ``"vote"``: the warm-up vote on whether every stage
    knows its shapes (``PipelineStage._warmup_forward_vote``/``_warmup_backward_result``);
    ``"shapes"``: the exchange of shapes a stage built without them does
    (``_send_meta``/``_recv_meta``); None: neither. Checked on torch 2.13.0."""
    f, depth = frame, 0
    while f is not None and depth < 12:
        name = f.f_code.co_name
        if name in ("_warmup_forward_vote", "_warmup_backward_result"):
            return "vote"
        if name in ("_recv_meta", "_send_meta"):
            return "shapes"
        f, depth = f.f_back, depth + 1
    return None


class StandIns:
    """The point-to-point works one run of the step issued, each waited once on a watcher thread
    (at most ``timeout`` seconds) and handed back to the caller as a stand-in that completes
    after ``on_done`` ran (see the module doc)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.unmet: tuple[str, float, str] | None = None    # (what, seconds, why): the first
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _missed(self, what: str, why: str) -> None:
        with self._lock:
            if self.unmet is None:
                self.unmet = (what, self.timeout, why)

    def hand_back(self, out: Any, what: str, on_done: Callable[[], None] | None = None) -> Any:
        """``out`` (what a send or receive returned) with its work replaced by a stand-in."""
        def one(x: Any) -> Any:
            w = ti.work_of(x)
            if w is None:
                return x
            fut: torch.futures.Future = torch.futures.Future()

            def watch() -> None:
                why = bounded_wait(w, self.timeout)
                if why:
                    self._missed(what, why)
                    fut.set_exception(RuntimeError(f"{what}: {why}"))
                    return
                if on_done is not None:
                    try:
                        on_done()
                    except Exception:  # noqa: BLE001 - a count must not fail the step
                        pass
                fut.set_result([])

            t = threading.Thread(target=watch, name="nanbisect-p2p", daemon=True)
            t.start()
            self._threads.append(t)
            return ti.work_of_future(fut)

        return ti.tree_map(one, out)

    def finish(self) -> tuple[str, float, str] | None:
        """Wait for every watcher (each ends by the deadline); the first wait not met."""
        for t in self._threads:
            t.join()
        self._threads.clear()
        return self.unmet
