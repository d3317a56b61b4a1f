"""The bounded agreement of guard/agree.py, in one process: ranks played by threads on a real
TCPStore (as torchrun's agent hosts it), a write that hangs on a real thread, a real SIGTERM sent
to this process. The multi-rank runs with real ranks are tests/guard/test_parts.py."""
from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
from torch.distributed import PrefixStore, TCPStore

from nanbisect import BadInput
from nanbisect.guard.agree import Board, Clock, Running, held_sigterm, write_timeout


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30),
                      wait_for_workers=False)
    return lambda: PrefixStore("nanbisect/test/", TCPStore(
        "127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30)))


def test_ranks_agree_on_every_outcome_within_the_deadline(store):
    """Rank 0 writes, rank 1 fails, rank 2 says nothing: ranks 0 and 1 read the same three
    outcomes by their deadline, rank 2 is late for both; when rank 2 finally posts, its word
    does not change what the others read."""
    got, start = {}, time.monotonic()

    def rank(r: int, value: dict | None) -> None:
        b = Board(store(), r)
        if value is not None:
            b.post("write", value)
        got[r] = b.gather("write", [0, 1, 2], time.monotonic() + 1.0, Clock(),
                          lambda q: {"ok": False, "reason": f"late {q}"})

    threads = [threading.Thread(target=rank, args=a) for a in
               ((0, {"ok": True}), (1, {"ok": False, "reason": "ENOSPC"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    took = time.monotonic() - start
    assert got[0] == got[1]                      # the same outcomes, on every rank
    assert got[0][0]["ok"] and got[0][0]["by"] == 0
    assert got[0][1] == {"ok": False, "reason": "ENOSPC", "by": 1}
    assert got[0][2]["reason"] == "late 2" and got[0][2]["by"] in (0, 1)
    assert 1.0 <= took < 10                      # the deadline, not the store's 30 s
    late = Board(store(), 2).post("write", {"ok": True})
    assert late == got[0][2]                     # rank 2 finds the round decided without it


def test_a_round_where_everyone_answers_does_not_wait_for_the_deadline(store):
    boards = [Board(store(), r) for r in range(2)]
    for b in boards:
        b.post("write", {"ok": True})
    t0 = time.monotonic()
    got = boards[0].gather("write", [0, 1], time.monotonic() + 30, Clock(), lambda r: {})
    assert time.monotonic() - t0 < 5 and all(o["ok"] for o in got.values())


def test_a_hung_write_is_left_at_its_deadline():
    gate = threading.Event()
    run = Running(gate.wait)                      # a write that hangs until released
    t0 = time.monotonic()
    assert run.wait(time.monotonic() + 0.3, Clock()) is False
    assert 0.3 <= time.monotonic() - t0 < 5
    gate.set()
    assert run.wait(time.monotonic() + 5, Clock()) is True and run.error is None


def test_sigterm_is_held_while_writing_then_delivered(monkeypatch):
    """A real SIGTERM to this process inside the block: the handler installed before (here a
    Python one; by default the process would end) runs only once the block is left, and the
    deadlines inside are cut to TERM_GRACE after it."""
    seen: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with held_sigterm() as term:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == [] and term() is not None
            clock = Clock(term)
            assert clock.left(time.monotonic() + 3600) <= 20.0   # TERM_GRACE after the signal
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_write_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("NANBISECT_WRITE_TIMEOUT", "2.5")
    assert write_timeout() == 2.5
    monkeypatch.setenv("NANBISECT_WRITE_TIMEOUT", "soon")
    with pytest.raises(BadInput, match="NANBISECT_WRITE_TIMEOUT='soon' is not a number"):
        write_timeout()
