"""Issue 40: the default Guard copies no parameter and no optimizer moment; a step that failed
before its update is bundled from the live tensors, one whose update failed is rebuilt from a
snapshot kept off the device and the steps since, and says how exact that was."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import ROOT, run_json
from held import held_bytes, holds_no_copy, state_bytes
from nanbisect import Guard, NonFiniteStep, Task
from nanbisect.bundle.format import read_bundle
from nanbisect.guard import keep
from nanbisect.pipeline.step import rebuild_note
from nanbisect.replay.replayer import Replayer

ENTRY = "tests/test_rebuild.py:task"
CPU = torch.device("cpu")


class Net(nn.Module):
    """Weights of 16384 elements, a BatchNorm (its running statistics are buffers a forward
    pass updates: the one thing the default Guard copies each step) and a dead parameter (its
    gradient is exactly 0: with ``eps=0`` Adam makes it NaN in the first update)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.bn = nn.BatchNorm1d(256)
        self.fc2 = nn.Linear(256, 64)
        self.dead = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) + 0.0 * self.dead.sum()


def task(eps: float = 1e-8) -> Task:
    torch.manual_seed(0)
    model = Net()
    return Task(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps),
                lambda m, b: m(b).pow(2).mean())


def eps0_task() -> Task:
    return task(eps=0.0)


def batch(i: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(i))


def assert_holds_no_copy(guard: Guard) -> None:
    """No tensor the size of a weight or its moments, and at most 0.10x the state in all."""
    ok, why = holds_no_copy(guard)
    assert ok, why


def test_the_default_guard_holds_no_copy_of_the_state(tmp_path):
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
    for i in range(12):
        guard.step(batch(i))
    assert_holds_no_copy(guard)
    assert guard._keeper.snap is not None            # the snapshot lives off the process
    files = list(Path(guard._keeper._store._dir).iterdir())
    assert [f.name for f in files if f.suffix == ".safetensors"] == ["state.safetensors"]
    # the walk sees copies where there are some: every-step holds about the whole state
    every = Guard(task(), entry=ENTRY, out=tmp_path / "e", snapshot="every-step")
    for i in range(3):
        every.step(batch(i))
    total, _ = held_bytes(every)
    assert total >= 0.95 * state_bytes(every.task)


def test_watch_copies_until_it_sees_the_optimizer_step_then_holds_none(tmp_path):
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
    opt = t.optimizer
    seen = []
    for i in range(6):
        with guard.watch(batch(i)) as w:
            opt.zero_grad()
            w.loss = t.loss_fn(t.model, batch(i))
            w.loss.backward()
            opt.step()
        seen.append(held_bytes(guard)[0])
    assert seen[0] < 0.10 * state_bytes(t)      # the first step's copy is dropped at its end
    assert_holds_no_copy(guard)


def test_a_loop_that_steps_without_the_tasks_optimizer_falls_back_with_a_warning(tmp_path):
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
    other = torch.optim.SGD(t.model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for i in range(4):
            with guard.watch(batch(i)) as w:
                if i == 0:      # the Task's optimizer once: the Guard stops copying
                    t.optimizer.zero_grad()
                    w.loss = t.loss_fn(t.model, batch(i))
                    w.loss.backward()
                    t.optimizer.step()
                else:
                    other.zero_grad()
                    w.loss = t.loss_fn(t.model, batch(i))
                    w.loss.backward()
                    other.step()
    lost = [w for w in got if "did not call the Task's optimizer.step()" in str(w.message)]
    assert len(lost) == 1 and "step 1" in str(lost[0].message)
    assert held_bytes(guard)[0] >= 0.3 * state_bytes(t)    # copies again (parameters at least)


def test_a_fault_born_in_the_update_is_rebuilt_bit_exact(tmp_path):
    """Adam with eps=0: finite loss and gradients, NaN after step 0's update. Seen at step 1's
    reading; step 0's pre-state rebuilt (a snapshot of step 0, nothing to replay) and bundled;
    the replay finds the NaN in the optimizer."""
    t = eps0_task()
    pre = {k: v.clone() for k, v in t.model.state_dict().items()}
    guard = Guard(t, entry="tests/test_rebuild.py:eps0_task", out=tmp_path / "b")
    guard.step(batch(0))
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(1))
    obs = e.value.observed
    assert e.value.bundle.name == "step000000" and guard.step_index == 0
    assert (obs["first"], obs["summary"]) == (
        "param", {"loss": "finite", "grads": "finite", "params": "nan"})
    # dead's gradient is 0, and so is fc1.bias's (the BatchNorm after it removes any shift)
    assert obs["nonfinite_params"]["nan"] == ["dead", "fc1.bias"]
    assert obs["rebuild"]["fidelity"] == "bit-exact"
    # the live model is step 0's pre-state again (running statistics too)
    assert all(torch.equal(v, pre[k]) for k, v in t.model.state_dict().items())
    out = Replayer(read_bundle(e.value.bundle), CPU).run()
    assert out.phase == "optimizer" and {b.name for b in out.bad} == {"dead", "fc1.bias"}


def test_a_rebuild_over_steps_that_ran_otherwise_says_mismatch(tmp_path):
    """A loop that decays a weight between steps (outside the Task): the rebuild from the
    snapshot of step 0 does not decay it, so the replayed steps differ from training; the
    bundle and the report say so, with the first step that differs."""
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b", snapshot_every=50)
    with pytest.raises(NonFiniteStep) as e:
        for i in range(8):
            if i == 5:
                for g in t.optimizer.param_groups:
                    g["lr"] = float("inf")      # the update of step 5 makes every weight inf
            guard.step(batch(i))
            with torch.no_grad():
                t.model.fc2.weight.mul_(0.9)
    obs = e.value.observed
    assert obs["step"] == 5 and obs["first"] == "param"
    rb = obs["rebuild"]
    assert (rb["from_step"], rb["steps"], rb["fidelity"], rb["first_mismatch"]) == (
        0, 5, "mismatch", 1)
    assert rb["max_rel_diff"] > keep.TOLERANCE
    note = rebuild_note(obs)
    assert "a mismatch" in note and "from step 1" in note
    # without the decay the same run rebuilds bit-exact
    t2 = task()
    g2 = Guard(t2, entry=ENTRY, out=tmp_path / "c", snapshot_every=50)
    with pytest.raises(NonFiniteStep) as e2:
        for i in range(8):
            if i == 5:
                for g in t2.optimizer.param_groups:
                    g["lr"] = float("inf")
            g2.step(batch(i))
    assert e2.value.observed["rebuild"]["fidelity"] == "bit-exact"
    assert e2.value.observed["rebuild"]["steps"] == 5


def test_close_reads_the_last_update_and_removes_the_snapshot(tmp_path):
    t = eps0_task()
    guard = Guard(t, entry="tests/test_rebuild.py:eps0_task", out=tmp_path / "b")
    guard.step(batch(0))
    where = Path(guard._keeper._store._dir)
    assert where.is_dir()
    with pytest.raises(NonFiniteStep) as e:
        guard.close()
    assert e.value.observed["rebuild"]["fidelity"] == "bit-exact"
    assert not where.exists()
    healthy = Guard(task(), entry=ENTRY, out=tmp_path / "h")
    healthy.step(batch(0))
    where = Path(healthy._keeper._store._dir)
    healthy.close()                                 # nothing failed: nothing raised
    assert not where.exists() and list((tmp_path / "h").iterdir()) == []


def test_a_killed_runs_snapshot_is_removed_by_the_next_guard(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import os, sys; sys.path.insert(0, 'tests'); import test_rebuild as r, nanbisect;"
            f"g = nanbisect.Guard(r.task(), entry={ENTRY!r}, out={str(tmp_path / 'k')!r});"
            "g.step(r.batch(0)); print(g._keeper._store._dir, flush=True); os._exit(0)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120)
    left = Path(p.stdout.strip().splitlines()[-1])
    assert left.parent == tmp_path and (left / "state.safetensors").is_file(), p.stderr
    guard = Guard(task(), entry=ENTRY, out=tmp_path / "b")
    guard.step(batch(0))
    assert not left.exists()                        # its lock was free: swept
    assert Path(guard._keeper._store._dir).is_dir()


def test_snapshot_arguments_are_checked(tmp_path):
    from nanbisect.errors import BadInput

    with pytest.raises(BadInput, match="snapshot='copy'"):
        Guard(task(), entry=ENTRY, out=tmp_path / "b", snapshot="copy")
    with pytest.raises(BadInput, match=r"snapshot_every=0\)"):
        Guard(task(), entry=ENTRY, out=tmp_path / "b", snapshot_every=0)


def test_the_run_reports_the_rebuild(tmp_path):
    """End to end: report.json keeps observed.rebuild and the notes say what was done."""
    t = eps0_task()
    guard = Guard(t, entry="tests/test_rebuild.py:eps0_task", out=tmp_path / "b")
    guard.step(batch(0))
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(1))
    rep = run_json(e.value.bundle, "--no-remedies")
    assert rep["observed"]["rebuild"]["fidelity"] == "bit-exact"
    assert rep["phase"] == "optimizer"
    assert any("rebuilt its pre-state from the snapshot of step 0" in n and "bit-exact" in n
               for n in rep["notes"]), rep["notes"]
    assert json.loads((e.value.bundle / "manifest.json").read_text())["observed"]["rebuild"]


def test_a_full_temporary_directory_never_stops_the_training(tmp_path, monkeypatch):
    """The snapshot's file system is full (a real 16 KiB tmpfs as TMPDIR): one warning, the
    training goes on (tried again every RETRY_AFTER steps), and a NaN born in an update is
    bundled as the state after it, saying that no snapshot reached it."""
    from mounts import tmpfs

    with tmpfs(tmp_path / "tmp", "16k") as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        t = eps0_task()
        guard = Guard(t, entry="tests/test_rebuild.py:eps0_task", out=tmp_path / "b")
        with warnings.catch_warnings(record=True) as got, pytest.raises(NonFiniteStep) as e:
            warnings.simplefilter("always")
            guard.step(batch(0))
            guard.step(batch(1))
        said = [str(w.message) for w in got if "could not write the snapshot" in str(w.message)]
        assert len(said) == 1 and "No space left on device" in said[0], said
        obs = e.value.observed
        assert obs["step"] == 0 and obs["rebuild"]["fidelity"] == "unavailable"
        assert e.value.bundle.is_dir()
        assert [p.name for p in tmp.iterdir() if (p / "state.safetensors.tmp").exists()] == []
