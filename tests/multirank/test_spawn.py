"""`nanbisect.multirank.spawn`: the ranks of a run forked from one interpreter (or started fresh
with --exec), with torchrun's environment, one gloo process group, and every rank's exit status
(tests/tasks/spawned.py is the rank). The replays that use it are tests/test_multirank*.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TEST_TASKS

RANK = TEST_TASKS / "spawned.py"


def spawn(tmp: Path, mode: str, *opts: str, world: int = 2, timeout: float = 120):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "nanbisect.multirank.spawn", f"--world={world}",
                        f"--statuses={tmp / 'statuses.json'}", *opts, "--", str(RANK), mode,
                        str(tmp)], capture_output=True, text=True, timeout=timeout, env=env)
    statuses = json.loads((tmp / "statuses.json").read_text())
    return p, statuses, time.monotonic() - t0


def seen(tmp: Path, world: int) -> list[dict]:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("start", ["fork", "exec"])
@pytest.mark.slow
def test_ranks_form_one_group_with_torchruns_environment(tmp_path, start):
    opts = ["--group"] + (["--exec"] if start == "exec" else [])
    p, statuses, _ = spawn(tmp_path, "group", *opts, world=3)
    assert p.returncode == 0, p.stdout + p.stderr
    assert statuses == {"statuses": {"0": 0, "1": 0, "2": 0}, "root": None}
    ranks = seen(tmp_path, 3)
    assert [r["sum"] for r in ranks] == [3.0, 3.0, 3.0]         # 0 + 1 + 2, all-reduced
    for r, got in enumerate(ranks):
        assert got["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                              "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": ranks[0]["env"]["MASTER_PORT"],
                              "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert got["threads"] == 1          # OMP_NUM_THREADS took: set before torch loaded
    assert int(ranks[0]["env"]["MASTER_PORT"]) > 0
    assert len({r["pid"] for r in ranks}) == 3 and {r["ppid"] for r in ranks} == {ranks[0]["ppid"]}
    # their output is this process's (three writers of one pipe: lines may interleave)
    assert sorted(re.findall(r"rank \d done", p.stdout)) == [f"rank {r} done" for r in range(3)]


@pytest.mark.slow
def test_a_crashed_rank_is_the_root_and_its_peer_is_stopped(tmp_path):
    # no bound on the time taken (a busy machine took 66 s): a rank 0 left hanging in gloo's
    # all-reduce (30 minutes by default) would fail this by the time-out, one that ignored
    # SIGTERM by its status (SIGKILL after the grace)
    p, statuses, _ = spawn(tmp_path, "crash", "--group", timeout=300)
    assert p.returncode == 1
    # rank 0 waited in the all-reduce for rank 1: stopped with SIGTERM (or gloo saw the peer go
    # first, and it exited 1), not left hanging; the crash is the root either way
    assert statuses["statuses"]["1"] == -signal.SIGSEGV and statuses["root"] == 1
    assert statuses["statuses"]["0"] in (-signal.SIGTERM, 1)


def test_ranks_alone_write_their_own_logs_and_a_status_each(tmp_path):
    # without --group a failed rank does not stop the others: rank 0 sleeps its 120 s unless
    # killed, so this test kills the spawner's group after rank 1's exit, as the launcher does
    p = subprocess.Popen([sys.executable, "-m", "nanbisect.multirank.spawn", "--world=4",
                          "--ranks=1,3", f"--logs={tmp_path}",
                          f"--statuses={tmp_path / 'statuses.json'}", "--", str(RANK), "exit3",
                          str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank1.log").exists() or not (tmp_path / "rank3.log").exists():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        time.sleep(1)
        assert p.poll() is None          # rank 3 (RANK 3: not rank 1) still sleeps
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert not (tmp_path / "rank0.log").exists() and not (tmp_path / "rank2.log").exists()


def test_bad_usage_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "nanbisect.multirank.spawn", "--world=2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "-- (-m MODULE | SCRIPT)" in p.stderr
