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

# this file is also the entry `nanbisect run` imports (ENTRY): tests/ on the path for its helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import ROOT, run_json  # noqa: E402
from helpers.held import held_bytes, holds_no_copy, state_bytes  # noqa: E402
from nanbisect import Guard, NonFiniteStep, Task
from nanbisect.bundle.format import read_bundle
from nanbisect.guard import keep
from nanbisect.pipeline.analysis import rebuild_note
from nanbisect.replay.replayer import Replayer

ENTRY = "tests/guard/test_rebuild.py:task"
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


def test_a_loop_that_steps_without_the_tasks_optimizer_is_said_once_and_rebuilt(tmp_path):
    """After one step through the Task's optimizer, the loop updates with another one: said
    once, no copy of the state for it; the NaN that optimizer then makes is seen at the next
    reading and its step rebuilt through the Task, which updates otherwise: a mismatch."""
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b", snapshot_every=50)
    other = torch.optim.SGD(t.model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as got, pytest.raises(NonFiniteStep) as e:
        warnings.simplefilter("always")
        for i in range(8):
            with guard.watch(batch(i)) as w:
                opt = t.optimizer if i == 0 else other
                opt.zero_grad()
                w.loss = t.loss_fn(t.model, batch(i))
                w.loss.backward()
                if i == 4:
                    other.param_groups[0]["lr"] = float("inf")
                opt.step()
            if i == 2:
                assert_holds_no_copy(guard)
    lost = [w for w in got if "did not call the Task's optimizer.step()" in str(w.message)]
    assert len(lost) == 1 and "step 1" in str(lost[0].message)
    obs = e.value.observed
    assert obs["step"] == 4 and obs["rebuild"]["fidelity"] == "mismatch"
    # step 1 ran as the Task would (after step 0's AdamW update); its SGD update did not
    assert obs["rebuild"]["first_mismatch"] == 2


def test_a_fault_born_in_the_update_is_rebuilt_bit_exact(tmp_path):
    """Adam with eps=0: finite loss and gradients, NaN after step 0's update. Seen at step 1's
    reading; step 0's pre-state rebuilt (a snapshot of step 0, nothing to replay) and bundled;
    the replay finds the NaN in the optimizer."""
    t = eps0_task()
    pre = {k: v.clone() for k, v in t.model.state_dict().items()}
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=tmp_path / "b")
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


def inf_at_step_5(tmp_path, name: str, between=None, batches=None,
                  after=None) -> NonFiniteStep:
    """Train ``task()`` (snapshot only at step 0) until the infinite learning rate of step 5
    makes every weight inf in its update; ``between(model)`` after each step (``after(i,
    guard)`` too); ``batches(i)``: step i's batch (`batch`)."""
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / name, snapshot_every=50)
    with pytest.raises(NonFiniteStep) as e:
        for i in range(8):
            if i == 5:
                for g in t.optimizer.param_groups:
                    g["lr"] = float("inf")
            guard.step((batches or batch)(i))
            if between is not None:
                between(t.model)
            if after is not None:
                after(i, guard)
    guard.close()
    return e.value


def test_a_rebuild_over_steps_that_ran_otherwise_says_mismatch(tmp_path):
    """A loop that decays a weight between steps (outside the Task): the rebuild from the
    snapshot of step 0 does not decay it, so the replayed steps differ from training; the
    bundle and the report say so, with the first step that differs."""
    def decay(model):
        with torch.no_grad():
            model.fc2.weight.mul_(0.9)

    obs = inf_at_step_5(tmp_path, "b", decay).observed
    assert obs["step"] == 5 and obs["first"] == "param"
    rb = obs["rebuild"]
    assert (rb["from_step"], rb["steps"], rb["fidelity"], rb["first_mismatch"]) == (
        0, 5, "mismatch", 1)
    assert rb["max_rel_diff"] > keep.TOLERANCE
    note = rebuild_note(obs)
    assert "a mismatch" in note and "from step 1" in note
    # without the decay the same run rebuilds bit-exact
    rb = inf_at_step_5(tmp_path, "c").observed["rebuild"]
    assert (rb["fidelity"], rb["steps"]) == ("bit-exact", 5)


def test_close_reads_the_last_update_and_removes_the_snapshot(tmp_path):
    t = eps0_task()
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=tmp_path / "b")
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
    code = ("import os, sys; sys.path[:0] = ['tests/guard', 'tests']; import test_rebuild as r, nanbisect;"
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
    guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=tmp_path / "b")
    guard.step(batch(0))
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(1))
    rep = run_json(e.value.bundle, "--no-remedies")
    assert rep["observed"]["rebuild"]["fidelity"] == "bit-exact"
    assert rep["phase"] == "optimizer"
    assert any("pre-state from the snapshot of step 0" in n and "bit-exact" in n
               for n in rep["notes"]), rep["notes"]
    assert json.loads((e.value.bundle / "manifest.json").read_text())["observed"]["rebuild"]


def test_a_full_temporary_directory_never_stops_the_training(tmp_path, monkeypatch):
    """The snapshot's file system is full (a real 16 KiB tmpfs as TMPDIR): one warning, the
    training goes on (tried again every RETRY_AFTER steps), and a NaN born in an update is
    bundled as the state after it, saying that no snapshot reached it."""
    from helpers.mounts import tmpfs

    with tmpfs(tmp_path / "tmp", "16k") as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        t = eps0_task()
        guard = Guard(t, entry="tests/guard/test_rebuild.py:eps0_task", out=tmp_path / "b")
        with warnings.catch_warnings(record=True) as got, pytest.raises(NonFiniteStep) as e:
            warnings.simplefilter("always")
            guard.step(batch(0))
            guard.step(batch(1))
        said = [str(w.message) for w in got if "could not write the snapshot" in str(w.message)]
        assert len(said) == 1 and "No space left on device" in said[0], said
        obs = e.value.observed
        # no snapshot reaches step 0: step 1 is bundled as it began, its parameters non-finite
        assert obs["step"] == 1 and obs["rebuild"]["fidelity"] == "unavailable"
        assert "no snapshot reaches step 0" in obs["rebuild"]["why"]
        assert "No space left on device" in obs["rebuild"]["why"]
        out = Replayer(read_bundle(e.value.bundle), CPU).run()
        assert out.phase == "input" and {b.name for b in out.bad} >= {"dead"}
        assert [p.name for p in tmp.iterdir() if (p / "state.safetensors.tmp").exists()] == []


def test_a_second_optimizer_step_after_a_failed_reading_is_left_out_too(tmp_path):
    """A watched block that steps twice: the first reading fails (a NaN loss), so both updates
    are left out; the bundle and the live model hold the step's pre-state."""
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
    for i in range(2):
        guard.step(batch(i))
    pre = [p.detach().clone() for p in t.model.parameters()]
    bad = batch(2)
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteStep) as e:
        with guard.watch(bad) as w:
            for _ in range(2):
                t.optimizer.zero_grad()
                w.loss = t.loss_fn(t.model, bad)
                w.loss.backward()
                t.optimizer.step()
    assert e.value.observed["first"] == "loss"
    assert all(torch.equal(a, b) for a, b in zip(t.model.parameters(), pre))


def test_a_group_added_after_the_snapshot_is_bundled_as_it_began_saying_why(tmp_path):
    """Progressive unfreezing: fc2 joins the optimizer as a new group after the snapshot. The
    snapshot no longer fits the optimizer: nothing is restored (checked first), the step whose
    reading saw the NaN is bundled as it began (running statistics put back), and why."""
    t = task()
    for p in t.model.fc2.parameters():
        p.requires_grad_(False)
    t.optimizer = torch.optim.AdamW([p for p in t.model.parameters() if p.requires_grad],
                                    lr=1e-3)
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b", snapshot_every=50)
    for i in range(3):
        guard.step(batch(i))
    for p in t.model.fc2.parameters():
        p.requires_grad_(True)
    t.optimizer.add_param_group({"params": list(t.model.fc2.parameters()), "lr": float("inf")})
    guard.step(batch(3))                     # fc2's update makes it inf
    bn = {k: v.clone() for k, v in t.model.bn.state_dict().items()}
    with pytest.raises(NonFiniteStep) as e:
        guard.step(batch(4))
    obs = e.value.observed
    assert obs["step"] == 4 and obs["rebuild"]["fidelity"] == "unavailable"
    assert "parameter groups changed" in obs["rebuild"]["why"]
    assert all(torch.equal(v, bn[k]) for k, v in t.model.bn.state_dict().items())
    assert not t.model.fc2.weight.isfinite().all()         # nothing restored from the snapshot


def test_a_short_last_window_is_replayed_with_its_own_micro_batches(tmp_path):
    """A trainer's epoch ends on a short accumulation window (the HF callback sets the Task's
    accumulate for that step): the rebuild replays each step with the micro-batches it had."""
    t = task()
    t.accumulate = 2
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b", snapshot_every=50)
    opt = t.optimizer
    with pytest.raises(NonFiniteStep) as e:
        for i in range(6):
            window = [batch(10 * i), batch(10 * i + 1)] if i != 2 else [batch(99)]
            t.accumulate = len(window)
            with guard.watch(window if len(window) > 1 else window[0]) as w:
                opt.zero_grad()
                total = None
                for mb in window:
                    loss = t.loss_fn(t.model, mb) / len(window)
                    loss.backward()
                    total = loss.detach() if total is None else total + loss.detach()
                w.loss = total
                if i == 4:
                    for g in opt.param_groups:
                        g["lr"] = float("inf")
                opt.step()
            t.accumulate = 2
    obs = e.value.observed
    assert obs["step"] == 4 and obs["rebuild"]["steps"] == 4
    assert obs["rebuild"]["fidelity"] == "bit-exact", obs["rebuild"]
