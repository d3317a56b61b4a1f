"""The Guard never harms the job it watches (docs/guide/guard.md, "What the Guard promises"): it
never hangs (pipelined jobs on 2 real gloo ranks, a re-run whose send never meets, a peer that
stalls), never loses the step (a snapshot damaged or deleted before a rebuild, an optimizer whose
state it cannot serialise: DeepSpeed ZeRO-2 on CPU), raises nothing but `NonFiniteStep` and only
once (`close` twice), and its files are its own (a forked child exiting, a rescue directory
squatted by another user or a symlink)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import TEST_TASKS, cli, run_python
from helpers.bundles import run_ranks
from nanbisect import Guard, NonFiniteStep, Task
from nanbisect.bundle.format import read_bundle, read_manifest
from nanbisect.guard.parts import rescue_dir

sys.path.insert(0, str(Path(__file__).parent))
from test_rebuild import batch, eps0_task  # noqa: E402 - the Adam eps=0 fault of the rebuild

REPO = Path(__file__).resolve().parents[2]
PIPELINED = TEST_TASKS / "pipelined.py"
DEADLINE = 4     # NANBISECT_RANK_TIMEOUT in the multi-rank runs below (seconds)


def said(stdout: str) -> dict[int, dict[str, str]]:
    """rank -> {"BUNDLE": path, "MESSAGE": text} (or {"DONE": ""}) from the ranks' lines."""
    out: dict[int, dict[str, str]] = {}
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == "RANK":
            out.setdefault(int(parts[1]), {})[parts[2]] = parts[3] if len(parts) > 3 else ""
    return out


def pipelined(tmp_path: Path, func: str, **env) -> tuple[dict, float]:
    t0 = time.monotonic()
    p = run_ranks(PIPELINED, [func, str(tmp_path / "out")], 2, timeout=180,
                  env={"NANBISECT_RANK_TIMEOUT": str(DEADLINE), **env})
    took = time.monotonic() - t0
    got = said(p.stdout)
    assert set(got) == {0, 1}, p.stdout + p.stderr[-3000:]
    return got, took


# -- never a hang (a pipelined step that goes NaN: tests/multirank/test_pipelined.py) ----------
@pytest.mark.slow
def test_a_rerun_whose_send_never_meets_ends_by_the_deadline(tmp_path):
    """Rank 1 skips its receive when the failing step runs again: rank 0's send never meets.
    Each rank waits at most NANBISECT_RANK_TIMEOUT, writes its part alone and says in one line
    which rank waited for which operation."""
    got, took = pipelined(tmp_path, "p2p_rerun_diverges")
    assert took < 90, took
    m0 = got[0]["MESSAGE"]
    assert f"rank 0: c10d.send.default (the failing step's re-run) did not complete within " \
           f"{DEADLINE} s" in m0, m0
    for r in (0, 1):
        bundle = Path(got[r]["BUNDLE"])
        assert bundle.name == f"step000002-rank{r}", got
        m = read_manifest(bundle)
        assert m["rank"] == r and m["observed"]["rank_timeout"] in got[r]["MESSAGE"]
        assert [e["part"] for e in m["partial"]] == ["ranks"]
        assert "did not complete within" in m["partial"][0]["why"]


@pytest.mark.slow
def test_a_peer_that_stalls_before_the_agreement_is_not_waited_for(tmp_path):
    """At step 2 rank 1 sleeps in its own code for 8 s before the Guard's per-step agreement
    (2 deadlines): rank 0 writes its step alone by the deadline, before rank 1 wakes, and
    raises."""
    got, _ = pipelined(tmp_path, "peer_hangs", PP_HANG="8")
    bundle = Path(got[0]["BUNDLE"])
    assert bundle.name == "step000002-rank0"
    m = read_manifest(bundle)
    from datetime import datetime
    written = datetime.fromisoformat(m["created"]).timestamp()
    assert written < float(got[1]["WOKE"]), (written, got[1])   # not waiting for rank 1
    assert "the Guard's agreement on a failure did not complete within" in got[0]["MESSAGE"]
    assert m["observed"]["first"] == "rank-timeout"


# -- never a lost step -----------------------------------------------------------------------
@pytest.mark.slow
def test_deepspeed_zero2_writes_a_partial_bundle_naming_the_optimizer_state(tmp_path):
    """DeepSpeed ZeRO-2 on 2 CPU ranks (gloo, DS_ACCELERATOR=cpu): its optimizer's state_dict()
    is not torch's format. Before: NonFiniteStep.bundle None ('state'), and 'grads=finite'
    though no gradient was read. Now the bundle holds the rest, ``partial`` names the optimizer
    state, and the message says the gradients were not read."""
    pytest.importorskip("deepspeed")
    p = run_ranks(TEST_TASKS / "ds_zero.py", [str(tmp_path / "out")], 2, timeout=240,
                  env={"DS_ACCELERATOR": "cpu"})
    got = said(p.stdout)
    assert set(got) == {0, 1}, p.stdout + p.stderr[-3000:]
    bundle = Path(got[0]["BUNDLE"])
    assert bundle.is_dir() and got[1]["BUNDLE"] == str(bundle)
    for r in (0, 1):
        assert "grads=unread" in got[r]["MESSAGE"] and "grads=finite" not in got[r]["MESSAGE"]
        part = read_manifest(bundle / f"rank{r}")
        assert part["optimizer"] is None
        assert [e["part"] for e in part["partial"]] == ["optimizer"]
        assert "DeepSpeedZeroOptimizer.state_dict()" in part["partial"][0]["why"]
    b = read_bundle(bundle)
    assert b.part(0).tensors("model") and b.part(1).tensors("batch")
    shown = subprocess.run([sys.executable, "-m", "nanbisect", "inspect", str(bundle)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "optimizer not written" in shown.stdout, shown


def test_an_optimizer_whose_state_cannot_be_read_does_not_stop_the_training(tmp_path):
    """An optimizer's state_dict() that raises (a foreign engine's) while the Guard snapshots.
    Before: the exception went through Guard.step into the loop. Now the snapshot fails, said
    once, and the steps go on."""
    class Foreign(torch.optim.SGD):
        def state_dict(self):
            raise KeyError("state")

    model = torch.nn.Linear(2, 1)
    guard = Guard(Task(model, Foreign(model.parameters(), lr=0.1),
                       lambda m, b: m(b).pow(2).mean()),
                  entry="fixtures/tasks/healthy.py:task", out=tmp_path / "b")
    with pytest.warns(RuntimeWarning, match="could not write the snapshot of step 0 "
                                            "\\(KeyError: 'state'\\)"):
        losses = [guard.step(torch.ones(3, 2)) for _ in range(3)]
    assert len(losses) == 3 and all(v == v for v in losses)
    guard.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "file-deleted", "dir-deleted"])
def test_a_snapshot_damaged_before_the_rebuild_still_bundles_the_step(tmp_path, damage):
    """Adam eps=0 makes step 0's update NaN; before step 1's reading sees it, the snapshot the
    rebuild needs is damaged. Before: SafetensorError / FileNotFoundError reached the loop and
    no bundle was written. Now the step is bundled as it began, saying why, once."""
    t = eps0_task()
    out = tmp_path / "b"
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=out)
    guard.step(batch(0))
    where = Path(guard._keeper._store._dir)
    f = where / "state.safetensors"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "garbage":
        f.write_bytes(os.urandom(4096))
    elif damage == "file-deleted":
        f.unlink()
    else:
        shutil.rmtree(where)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(1))
    assert e.value.bundle is not None and (e.value.bundle / "manifest.json").is_file()
    rebuild = e.value.observed["rebuild"]
    assert rebuild["fidelity"] == "unavailable" and "could not be read back" in rebuild["why"]
    guard.close()
    guard.close()     # idempotent: nothing raised, no second bundle
    assert [p.name for p in out.iterdir()] == [e.value.bundle.name]


def test_close_after_a_failure_raises_nothing_and_writes_nothing_more(tmp_path):
    """Before: after a NonFiniteStep whose rebuild was unavailable (no snapshot reached it),
    close() raised a second NonFiniteStep and wrote a duplicate bundle."""
    t = eps0_task()
    out = tmp_path / "b"
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=out)
    guard.step(batch(0))
    guard._keeper.snap = None     # as if the snapshot could not be written: none reaches step 0
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(1))
    assert e.value.observed["rebuild"]["fidelity"] == "unavailable"
    guard.close()
    guard.close()
    assert [p.name for p in out.iterdir()] == [e.value.bundle.name]


# -- its files are its own -------------------------------------------------------------------
def test_a_forked_child_that_exits_leaves_the_parents_snapshot(tmp_path):
    """A training process forks (a worker, a checkpoint writer); the child exits normally, running
    its exit handlers. Before: the child's handler removed the parent's live snapshot directory
    and the next rebuild failed. Now the parent's snapshot is intact and the rebuild bit-exact."""
    script = tmp_path / "fork_then_fail.py"
    script.write_text(f"""
import os, sys, json
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_rebuild import batch, eps0_task
from nanbisect import Guard, NonFiniteStep
g = Guard(eps0_task(), entry="tests/guard/test_rebuild.py:eps0_task", out={str(tmp_path / 'b')!r})
g.step(batch(0))
where = g._keeper._store._dir
pid = os.fork()
if pid == 0:
    sys.exit(0)           # a normal exit: atexit handlers and finalizers run in the child
_, status = os.waitpid(pid, 0)
alive = os.path.isfile(os.path.join(where, "state.safetensors"))
try:
    g.step(batch(1))
    fidelity = None
except NonFiniteStep as e:
    fidelity = e.observed["rebuild"]["fidelity"]
print(json.dumps({{"status": status, "alive": alive, "fidelity": fidelity}}))
""")
    res = run_python([str(script)], cwd=str(REPO), timeout=120)
    assert res.code == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"status": 0, "alive": True, "fidelity": "bit-exact"}, got


@pytest.mark.parametrize("squat", ["other-user", "symlink", "open-to-all"])
def test_a_squatted_rescue_directory_is_never_written_into(tmp_path, monkeypatch, squat):
    """Someone pre-creates $TMPDIR/nanbisect-rescue-UID: another user's directory (mode 0777,
    where this test can chown: as root), a symlink to their directory, or one open to all. The
    Guard's rescue goes into a new private directory instead; theirs stays empty."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    name = tmp / f"nanbisect-rescue-{os.getuid()}"
    if squat == "other-user":
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        name.mkdir()
        os.chmod(name, 0o777)
        os.chown(name, 65534, 65534)
        theirs = name
    elif squat == "symlink":
        name.symlink_to(theirs)
    else:
        name.mkdir()
        os.chmod(name, 0o777)
        theirs = name
    # a Guard whose out goes away before the failure: its bundle is rescued
    t = eps0_task()
    out = tmp_path / "gone"
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=out)
    guard.step(batch(0))
    out.rmdir() if out.exists() else None
    out.write_text("not a directory any more")
    with pytest.raises(NonFiniteStep) as e, pytest.warns(RuntimeWarning, match="instead"):
        guard.step(batch(1))
    guard.close()
    rescued = e.value.bundle
    assert rescued is not None and rescued.is_dir()
    assert list(theirs.iterdir()) == []                      # nothing of ours in theirs
    home = rescued.parent
    assert home.parent == tmp and not home.is_symlink()
    assert home.stat().st_uid == os.getuid() and home.stat().st_mode & 0o777 == 0o700
    assert rescue_dir() == home or rescue_dir().parent == tmp


def test_a_batch_the_writer_cannot_store_still_leaves_a_bundle(tmp_path):
    """Before: a batch holding the user's own type lost the whole bundle (TypeError, even in
    the rescue directory). Now the rest is written, ``partial`` names the batch, and ``run`` says
    in one line what it cannot replay."""
    from nanbisect.task import import_target
    rows = import_target(str(TEST_TASKS / "unstorable_batch.py"))
    guard = Guard(rows.task(), entry=f"{TEST_TASKS / 'unstorable_batch.py'}:task",
                  out=tmp_path / "b")
    with pytest.raises(NonFiniteStep) as e:
        guard.step(rows.Rows(torch.ones(3, 4)))
    guard.close()
    m = read_manifest(e.value.bundle)
    assert [p["part"] for p in m["partial"]] == ["batch"] and "cannot store a Rows" in \
        m["partial"][0]["why"]
    assert read_bundle(e.value.bundle).tensors("model")
    res = cli("run", str(e.value.bundle), "--out", str(tmp_path / "r"))
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "holds no batch" in res.stderr and "Traceback" not in res.stderr


def test_the_deadline_defaults_to_the_jobs_own_process_group_timeout(tmp_path):
    """Unset, NANBISECT_RANK_TIMEOUT is the job's init_process_group(timeout=...): a rank that
    checkpoints for 20 minutes between steps is as slow as the job already allows, not lost.
    Set, it wins; a bad value is one BadInput line."""
    script = tmp_path / "deadline_default.py"
    script.write_text(
        "import datetime, os, torch.distributed as dist\n"
        "from nanbisect.guard.deadline import rank_timeout\n"
        "from nanbisect import BadInput\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1,\n"
        "                        timeout=datetime.timedelta(seconds=1234))\n"
        "os.environ.pop('NANBISECT_RANK_TIMEOUT', None)\n"
        "print(rank_timeout())\n"
        "os.environ['NANBISECT_RANK_TIMEOUT'] = '7'\n"
        "print(rank_timeout())\n"
        "os.environ['NANBISECT_RANK_TIMEOUT'] = 'nan'\n"
        "try:\n    rank_timeout()\nexcept BadInput as e:\n    print('bad', e)\n"
        "dist.destroy_process_group()\n")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_python([str(script)], env={**os.environ, "PORT": str(port)}, timeout=120)
    assert res.code == 0, res.stderr
    got = res.stdout.strip().splitlines()
    assert got[:2] == ["1234.0", "7.0"] and got[2].startswith("bad NANBISECT_RANK_TIMEOUT="), got
