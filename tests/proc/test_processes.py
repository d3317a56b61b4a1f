"""The one process handle (`nanbisect.proc.Processes`, torch elastic's ``PContext`` in kind):
start, poll, a deadline, stop with grace (SIGTERM, then SIGKILL), a group, output, reaped; and
the signal handlers set through `nanbisect.proc`."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from nanbisect import proc

SLEEP = "import time; time.sleep(60)"
# ignores SIGTERM, says so once it does, then sleeps
STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")


def _zombie_or_gone(pid: int) -> str:
    """'gone' once nothing is left of ``pid`` (reaped), 'zombie' while it waits for a reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    return "zombie" if state == "Z" else "running"


def _said_ready(ps: proc.Processes, key) -> None:
    """Until the child ``key`` (started with output) printed its first line."""
    out = ps.outputs[key].out
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out.seek(0)
        if out.read():
            return
        time.sleep(0.02)
    raise AssertionError("the child never said it was ready")


def test_start_poll_output_and_reaped():
    with proc.Processes() as ps:
        ps.exec("a", [sys.executable, "-c", "import sys; print('out'); print('err', "
                                                "file=sys.stderr); sys.exit(3)"], output=True)
        ps.fork("b", lambda: 0)
        pids = [ps.children[k].pid for k in ps]
        codes = ps.wait(timeout=60)
    assert codes == {"a": 3, "b": 0} and ps.running() == [] and ps.failed == {"a": 3}
    assert ps.said("a") == ("out\n", "err\n")
    assert [_zombie_or_gone(p) for p in pids] == ["gone", "gone"]


def test_a_deadline_leaves_them_running_until_stopped():
    ps = proc.Processes(grace=5)
    ps.exec(0, [sys.executable, "-c", SLEEP])
    t0 = time.monotonic()
    assert ps.wait(timeout=0.3) is None and ps.poll() == {0: None}
    assert 0.3 <= time.monotonic() - t0 < 10
    assert ps.stop() == {0: -signal.SIGTERM}          # SIGTERM was enough: no grace waited
    assert time.monotonic() - t0 < 5


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    ps = proc.Processes(grace=0.5)
    ps.exec("stubborn", [sys.executable, "-c", STUBBORN], output=True)
    pid = ps.children["stubborn"].pid
    _said_ready(ps, "stubborn")
    t0 = time.monotonic()
    assert ps.stop() == {"stubborn": -signal.SIGKILL}
    assert 0.5 <= time.monotonic() - t0 < 10
    assert _zombie_or_gone(pid) == "gone"


def test_a_group_stops_on_its_first_failure():
    """As torchrun's agent: one fails, the others get SIGTERM, and SIGKILL after the grace;
    `failed` keeps the failure seen first, not the ones the stop caused."""
    ps = proc.Processes(grace=0.5)
    ps.exec("polite", [sys.executable, "-c", SLEEP])
    ps.exec("stubborn", [sys.executable, "-c", STUBBORN], output=True)
    _said_ready(ps, "stubborn")
    ps.fork("fails", lambda: 7)
    codes = ps.wait(timeout=60, stop_on_failure=True)
    assert codes == {"polite": -signal.SIGTERM, "stubborn": -signal.SIGKILL, "fails": 7}
    assert ps.failed == {"fails": 7}


def test_an_exception_in_the_block_ends_and_reaps_every_child():
    with pytest.raises(KeyboardInterrupt):
        with proc.Processes() as ps:
            ps.exec(0, [sys.executable, "-c", SLEEP])
            ps.fork(1, lambda: (time.sleep(60), 0)[1])
            pids = [ps.children[k].pid for k in ps]
            raise KeyboardInterrupt
    assert ps.codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    assert [_zombie_or_gone(p) for p in pids] == ["gone", "gone"]


def test_a_block_that_ends_leaves_no_child_running_and_output_readable():
    with proc.Processes() as ps:
        ps.exec(0, [sys.executable, "-c", "print('hi')"], output=True)
        ps.wait(timeout=60)
        ps.exec(1, [sys.executable, "-c", SLEEP])
        pid = ps.children[1].pid
    assert ps.codes == {0: 0, 1: -signal.SIGKILL} and _zombie_or_gone(pid) == "gone"
    assert ps.said(0) == ("hi\n", "")


def test_kill_from_another_thread_signals_without_waiting():
    import threading

    ps = proc.Processes()
    ps.exec(0, [sys.executable, "-c", SLEEP])
    t = threading.Thread(target=ps.kill)
    t.start()
    t.join()
    assert ps.wait(timeout=30) == {0: -signal.SIGKILL}


def test_handlers_are_set_and_put_back_through_proc():
    came = []
    before = signal.getsignal(signal.SIGUSR2)
    with proc.handling([signal.SIGUSR2], lambda s, f: came.append(s)):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
    assert came == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) == before


def test_a_deferred_signal_reaches_the_previous_handler_on_leaving():
    came = []
    with proc.handling([signal.SIGUSR2], lambda s, f: came.append("handler")):
        with proc.deferred(signal.SIGUSR2) as when:
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
            assert when() is not None and came == []
        time.sleep(0.05)
        assert came == ["handler"]
