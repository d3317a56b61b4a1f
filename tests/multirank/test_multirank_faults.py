"""Faults of a multi-rank replay, with real processes (2 ranks, gloo, CPU): a rank that hangs, one
that is killed or crashes, and the `nanbisect run` process itself killed with SIGKILL. Every test
replays the same healthy bundle of tests/tasks/mr_faults.py, with the fault switched on by the
environment, under a private TMPDIR so that what a run leaves there can be counted. That bundle is
captured under torchrun itself, as users capture (the other test files fork their ranks:
`bundles.run_ranks`)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, TEST_TASKS, cli, run_python

from nanbisect.multirank.launcher import PREFIX, sweep, where

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

FAULTS = TEST_TASKS / "mr_faults.py"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """mr_faults.py's task, trained 3 healthy steps on 2 ranks under torchrun; step 3 captured on
    both."""
    out = tmp_path_factory.mktemp("mr_faults")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        "--nproc-per-node=2", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:0", f"--log-dir={out / 'torchrun-logs'}",
                        str(FAULTS), str(out / "g")],
                       capture_output=True, text=True, timeout=240)
    lines = [line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
             if line.startswith("BUNDLE ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-2000:]
    return Path(lines[0])


def leftovers(bundle: Path, tmp: Path) -> tuple[list[str], list[str]]:
    """(processes that name ``bundle`` or run a janitor for a directory under ``tmp``, the
    directories a replay made under ``tmp``)."""
    key, janitor, procs = str(Path(bundle).resolve()).encode(), f"={tmp}".encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:   # another user's process
            env = b""
        if key in cmd or (b"NANBISECT_RUN_DIR" + janitor) in env:
            procs.append(cmd.replace(b"\0", b" ").decode(errors="replace")[:200])
    dirs = [p.name for p in tmp.iterdir() if p.name.startswith((PREFIX, "torchelastic_"))]
    return procs, dirs


def replay(bundle: Path, tmp_path: Path, **env: str):
    """``nanbisect run`` under a private TMPDIR; (result, seconds, leftovers once it returned)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    t0 = time.monotonic()
    res = cli("run", "--ckpt", bundle, "--out", tmp_path / "rep",
              env={"TMPDIR": str(tmp), **env}, timeout=200)
    return res, time.monotonic() - t0, leftovers(bundle, tmp)


def failed(res, left) -> str:
    """The one-line error of a replay that must fail: exit 2, no traceback, nothing left."""
    assert res.code == 2, res.stdout[-2000:] + res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert left == ([], []), left
    return res.stderr


@pytest.fixture(scope="module")
def healthy(bundle, tmp_path_factory):
    """The healthy replay: (result, seconds, leftovers)."""
    return replay(bundle, tmp_path_factory.mktemp("healthy"))


def hang_timeout(healthy) -> int:
    """A timeout that the hang, reached in pass 1, is sure to have reached, however loaded the
    machine: 2.5 times what the whole healthy replay took just now, at least 20 s. (On 2 busy
    cores start-up alone takes 20 s.)"""
    return max(20, math.ceil(2.5 * healthy[1]))


def test_healthy_replay_leaves_no_process_and_no_directory(healthy):
    res, _, left = healthy
    assert res.code == 0, res.stdout[-2000:] + res.stderr
    assert left == ([], [])          # nor a torchelastic_* directory


def test_rank_that_hangs_in_its_own_code_is_named(bundle, healthy, tmp_path):
    # rank 1 sleeps in its loss_fn; rank 0 waits for it in DDP's gradient all-reduce
    timeout = hang_timeout(healthy)
    res, took, left = replay(bundle, tmp_path, MR_FAULT="hang",
                             NANBISECT_RANK_TIMEOUT=str(timeout))
    err = failed(res, left)
    assert err.startswith(f"nanbisect: error: rank 1 hung: after {timeout}s rank 1 was still "
                          "running its own code at mr_faults.py:"), err
    assert " in fault (replay pass 1/3: module statistics)" in err
    # rank 0 waits in DDP's all-reduce (the comm hook's), named where the hook issued it
    assert "while rank 0 waited in a collective at default_hooks.py:" in err, err
    assert "waiting for it" in err
    assert timeout <= took < timeout + 40


@pytest.mark.parametrize("fault,said", [
    ("kill", "rank 1 was killed by SIGKILL during the replay (replay pass 1/3"),
    ("segv", "rank 1 was killed by SIGSEGV at mr_faults.py:"),
    ("exit", "rank 1 exited with status 3 during the replay without a result"),
])
def test_rank_that_dies_is_named_with_its_signal_or_status(bundle, tmp_path, fault, said):
    res, took, left = replay(bundle, tmp_path, MR_FAULT=fault, NANBISECT_RANK_TIMEOUT="400")
    err = failed(res, left)
    assert said in err, err
    assert "rank 0" not in err.split(said)[0]      # the survivor is not the one blamed
    assert took < 300                             # the exit status, not the (400 s) timeout


@pytest.mark.parametrize("when", ["ranks-started", "rank-1-hanging"])
def test_kill_9_of_nanbisect_run_leaves_no_process_and_no_directory(bundle, tmp_path, when):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mark = tmp_path / "hanging"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANBISECT_TEST")}
    env.update(TMPDIR=str(tmp), MR_FAULT="hang", MR_FAULT_MARK=str(mark),
               NANBISECT_RANK_TIMEOUT="300")
    p = subprocess.Popen([sys.executable, "-m", "nanbisect", "run", "--ckpt", str(bundle),
                          "--out", str(tmp_path / "rep")], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            procs, dirs = leftovers(bundle, tmp)
            # the spawner and the two ranks it forked (a fork keeps its parent's command line)
            workers = [c for c in procs if "nanbisect.multirank.spawn" in c]
            if len(workers) == 3 and dirs and (when == "ranks-started" or mark.exists()):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the ranks never got there: {p.poll()} {leftovers(bundle, tmp)}")
    finally:
        p.kill()
        p.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and leftovers(bundle, tmp) != ([], []):
        time.sleep(0.05)
    assert leftovers(bundle, tmp) == ([], [])
    assert not (tmp_path / "rep").exists()


def test_run_directory_of_a_dead_run_is_swept_and_a_live_ones_is_kept(tmp_path):
    dead, live = tmp_path / f"{PREFIX}dead", tmp_path / f"{PREFIX}live"
    for d in (dead, live):
        d.mkdir()
        (d / ".lock").touch()
        (d / "rank0.json").write_text("{}")
    holder = subprocess.Popen(   # a live launcher: holds its run's lock until told to stop
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(live / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert sweep(tmp_path) == [dead]
        assert not dead.exists() and (live / "rank0.json").exists()
    finally:
        holder.communicate("", timeout=30)
    assert sweep(tmp_path) == [live]                 # its launcher is gone now


def test_where_a_rank_was_is_read_from_its_faulthandler_dump():
    torch_dir = Path(__import__("torch").__file__).parent
    dump = (f'Thread 0x00007f01 (most recent call first):\n'
            f'  File "{Path(__import__("threading").__file__)}", line 331 in wait\n'
            f'  File "/w/nanbisect/multirank/worker.py", line 200 in wait\n'
            f'  File "{Path(__import__("threading").__file__)}", line 1002 in _bootstrap\n\n'
            f'Current thread 0x00007f02 (most recent call first):\n'
            f'  File "{torch_dir}/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
            f'  File "/home/u/train/model.py", line 40 in forward\n')
    w = where(dump)
    assert (w.category, w.at, w.waiting) == ("collective", "distributed_c10d.py:3252 in all_reduce",
                                             True)
    user = where(dump.replace(f"{torch_dir}/distributed/distributed_c10d.py", "/u/sleepy.py"))
    assert (user.category, user.at, user.waiting) == ("user", "sleepy.py:3252 in all_reduce",
                                                      False)
    assert where("") is None


def test_a_worker_that_cannot_see_the_launchers_lock_exits_at_once(bundle, tmp_path):
    # the launcher is gone (no PARTIAL/.lock): a rank started now must not linger
    partial = tmp_path / f"{PREFIX}orphan"
    partial.mkdir()
    t0 = time.monotonic()
    # forked from the worker's fork server, as the spawner forks ranks (torch imported once)
    p = run_python(["-m", "nanbisect.multirank.worker", str(bundle), str(partial)],
                   env={**os.environ, "RANK": "0"}, timeout=120)
    assert p.code == 1 and not (partial / "rank0.json").exists(), p.stderr
    assert time.monotonic() - t0 < 60
