"""Guard: healthy steps pass through untouched; the first non-finite step becomes a replayable bundle
of its pre-step state. Tiny CPU models; bundles go under pytest's ``tmp_path``.
"""
from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanbisect import Guard, NonFiniteStep, Task, capture
from nanbisect.bundle.format import read_bundle
from nanbisect.replay.replayer import Replayer
from nanbisect.bundle.state import decode
from nanbisect.task import import_target, load_task
from tinygpt import plain_step  # the plain training step the benchmarks measure against too

REPO = Path(__file__).resolve().parents[2]
HEALTHY = REPO / "fixtures" / "tasks" / "healthy.py"
ADAM_EPS0 = REPO / "fixtures" / "tasks" / "optimizer_adam_eps0.py"
ENTRY = f"{Path(__file__).resolve()}:flaky_task"  # Guard checks that it exists, never imports it
CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------
# tiny models


class Flaky(nn.Module):
    """A small regressor whose forward turns NaN when the batch says ``poison``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.out = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, poison: bool = False) -> torch.Tensor:
        h = torch.tanh(self.norm(self.lin(x)))
        if poison:
            h = torch.log(h - 2.0)  # tanh < 1, so log of a negative number: NaN
        return self.out(h).squeeze(-1)


def flaky_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"], batch["poison"]), batch["y"])


def flaky_batch(seed: int, poison: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, generator=g),
            "poison": poison}


def flaky_task(seed: int = 0, opt: str = "adam") -> Task:
    torch.manual_seed(seed)
    model = Flaky()
    if opt == "adam":
        o = torch.optim.Adam(model.parameters(), lr=0.05)
    else:
        o = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Task(model=model, optimizer=o, loss_fn=flaky_loss)


class LateParam(nn.Module):
    """``b`` takes part only when the batch says ``touch_b``, and then with gradient exactly 0.

    Under Adam with eps=0 its first update is 0 / (sqrt(0) + 0) = NaN: loss and gradients stay
    finite, the NaN is born in the optimizer step, and only at the step that first touches ``b``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 1)
        self.b = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor, touch_b: bool) -> torch.Tensor:
        y = self.a(x).squeeze(-1)
        return y + 0.0 * self.b.sum() if touch_b else y


def late_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.mse_loss(model(batch["x"], batch["touch_b"]), batch["y"])


def late_batch(seed: int, touch_b: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(5, 3, generator=g), "y": torch.randn(5, generator=g),
            "touch_b": touch_b}


def late_task() -> Task:
    torch.manual_seed(0)
    model = LateParam()
    return Task(model, torch.optim.Adam(model.parameters(), lr=0.1, eps=0.0), late_loss)


# --------------------------------------------------------------------------------------------
# helpers


def clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_tensors_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def bundle_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The bundle's model tensors under every (tied) name, like ``state_dict``."""
    b = read_bundle(path)
    meta, tensors = b.manifest["model"], b.tensors("model")
    return {n: tensors[f"model/{meta['aliases'].get(n, n)}"]
            for n in meta["params"] + meta["buffers"]}


def bundle_optimizer_state(path: Path) -> dict:
    b = read_bundle(path)
    tensors = b.all_tensors()
    meta = b.manifest["optimizer"]
    return {"state": {int(i): decode(s, tensors) for i, s in meta["state"].items()},
            "param_groups": [decode(g, tensors) for g in meta["param_groups"]]}


def assert_opt_state_equal(sd1: dict, sd2: dict) -> None:
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for i, st in sd1["state"].items():
        assert st.keys() == sd2["state"][i].keys(), i
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == sd2["state"][i][k].dtype, (i, k)
                assert torch.equal(v, sd2["state"][i][k]), (i, k)
            else:
                assert v == sd2["state"][i][k], (i, k)


def snapshot_opt(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())


def dir_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# healthy steps


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_healthy_steps_match_plain_loop_and_write_nothing(tmp_path, opt):
    guarded, plain = flaky_task(0, opt), flaky_task(0, opt)
    assert_tensors_identical(clone_state(guarded.model), clone_state(plain.model))
    out = tmp_path / "out"
    guard = Guard(guarded, entry=ENTRY, out=out)
    for s in range(4):
        v = guard.step(flaky_batch(s))
        assert type(v) is float
        assert v == plain_step(plain, flaky_batch(s))
    assert guard.step_index == 4
    # the guard leaves no trace on the training itself
    assert_tensors_identical(clone_state(guarded.model), clone_state(plain.model))
    assert_opt_state_equal(guarded.optimizer.state_dict(), plain.optimizer.state_dict())
    assert list(out.iterdir()) == []
    assert list(tmp_path.iterdir()) in ([], [out])


def test_large_finite_values_are_not_a_failure(tmp_path):
    # sums of these overflow float32, but every value is finite: no NonFiniteStep, no bundle
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(3e38)
    task = Task(model, None, lambda m, b: (m.weight * 0).sum() + b.sum())
    out = tmp_path / "out"
    guard = Guard(task, entry=ENTRY, out=out)
    assert guard.step(torch.ones(3)) == 3.0
    assert guard.step_index == 1
    assert list(out.iterdir()) == []   # the directory is made (and probed) at construction


# --------------------------------------------------------------------------------------------
# failures


def test_forward_nan_bundles_pre_step_state_and_restores_live_model(tmp_path):
    task = flaky_task(0, "adam")
    out = tmp_path / "out"
    guard = Guard(task, entry=ENTRY, out=out)
    for s in range(2):
        guard.step(flaky_batch(s))
    pre_model = clone_state(task.model)
    pre_opt = snapshot_opt(task.optimizer)
    bad = flaky_batch(7, poison=True)

    with pytest.raises(NonFiniteStep) as ei:
        guard.step(bad)
    e = ei.value
    assert e.bundle == out / "step000002" and e.bundle.is_dir()
    assert str(e.bundle) in str(e)
    obs = e.observed
    assert obs["first"] == "loss" and obs["step"] == 2 and obs["loss"] == "nan"
    assert obs["summary"]["loss"] == "nan"

    b = read_bundle(e.bundle)
    assert b.manifest["observed"] == obs
    assert b.manifest["step"] == 2
    # bundle holds the state *before* the failing step (BatchNorm buffers included)
    assert_tensors_identical(bundle_model_state(e.bundle), pre_model)
    assert_opt_state_equal(bundle_optimizer_state(e.bundle), pre_opt)
    got_batch = decode(b.manifest["batch"], b.tensors("batch"))
    assert got_batch["poison"] is True and torch.equal(got_batch["x"], bad["x"])

    # the live model and optimizer are back at their pre-step values
    live = clone_state(task.model)
    assert_tensors_identical(live, pre_model)
    assert all(torch.isfinite(t).all() for t in live.values() if t.is_floating_point())
    assert_opt_state_equal(task.optimizer.state_dict(), pre_opt)

    # training can go on from there: the next step matches a plain loop from the same state
    plain = flaky_task(1, "adam")
    plain.model.load_state_dict(pre_model)
    plain.optimizer.load_state_dict(copy.deepcopy(pre_opt))
    assert guard.step(flaky_batch(8)) == plain_step(plain, flaky_batch(8))
    assert guard.step_index == 3


def test_backward_only_nonfinite_is_classified_grad(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # loss is exactly 0 (finite) but d sqrt(u)/du at u=0 is inf: the gradient breaks first
    task = Task(model, opt, lambda m, b: torch.sqrt(m.weight - m.weight.detach()).sum() * b)
    guard = Guard(task, entry=ENTRY, out=tmp_path)
    pre = clone_state(model)
    with pytest.raises(NonFiniteStep) as ei:
        guard.step(1.0)
    obs = ei.value.observed
    assert obs["first"] == "grad"
    assert obs["loss"] == 0.0 and obs["summary"]["loss"] == "finite"
    assert obs["summary"]["grads"] != "finite"
    assert "weight" in obs["nonfinite_grads"]["inf"] + obs["nonfinite_grads"]["nan"]
    assert_tensors_identical(bundle_model_state(ei.value.bundle), pre)
    assert_tensors_identical(clone_state(model), pre)


def test_optimizer_phase_nan_after_healthy_steps(tmp_path):
    task = late_task()
    guard = Guard(task, entry=ENTRY, out=tmp_path / "out", snapshot_every=50)
    for s in range(2):
        guard.step(late_batch(s))
    pre_model = clone_state(task.model)
    pre_opt = snapshot_opt(task.optimizer)
    names = [n for n, _ in task.model.named_parameters()]
    assert sorted(names[i] for i in pre_opt["state"]) == ["a.bias", "a.weight"]  # b: no state
    assert all(float(s["step"]) == 2.0 for s in pre_opt["state"].values())

    # the update makes b NaN: the next step's reading sees it, before its own update, and the
    # failing step's pre-state is rebuilt from the snapshot of step 0 and steps 0 and 1
    guard.step(late_batch(2, touch_b=True))
    with pytest.raises(NonFiniteStep) as ei:
        guard.step(late_batch(3))
    e = ei.value
    obs = e.observed
    assert e.bundle.name == "step000002" and guard.step_index == 2
    assert obs["first"] == "param"
    assert obs["rebuild"] == {"from_step": 0, "steps": 2, "fidelity": "bit-exact",
                              "max_rel_diff": 0.0, "first_mismatch": None}
    assert obs["summary"] == {"loss": "finite", "grads": "finite", "params": "nan"}
    assert obs["nonfinite_params"]["nan"] == ["b"]
    assert math.isfinite(obs["loss"])

    saved = bundle_model_state(e.bundle)
    assert_tensors_identical(saved, pre_model)
    assert all(torch.isfinite(t).all() for t in saved.values())
    # the failing step's optimizer updates (and the state it created for b) are not in the bundle
    assert_opt_state_equal(bundle_optimizer_state(e.bundle), pre_opt)
    assert_opt_state_equal(task.optimizer.state_dict(), pre_opt)
    assert task.model.b not in task.optimizer.state

    # the bundle replays into a freshly built task and fails the same way, in the optimizer
    fresh = late_task()
    outcome = Replayer(read_bundle(e.bundle), CPU, task=fresh).run()
    assert outcome.phase == "optimizer"
    assert [(x.where, x.name) for x in outcome.bad] == [("parameter", "b")]


def test_fixture_adam_eps0_fails_in_optimizer_at_step0(tmp_path):
    entry = f"{ADAM_EPS0}:task"
    task = load_task(entry)
    pre = clone_state(task.model)
    guard = Guard(task, entry=entry, out=tmp_path)
    batches = import_target(str(ADAM_EPS0)).batches()
    batch = next(batches)
    guard.step(batch)            # its update makes NaN: seen by the next step's reading
    with pytest.raises(NonFiniteStep) as ei:
        guard.step(next(batches))
    obs = ei.value.observed
    assert obs["rebuild"]["fidelity"] == "bit-exact" and obs["rebuild"]["steps"] == 0
    assert ei.value.bundle == tmp_path / "step000000"
    assert obs["first"] == "param" and obs["summary"]["grads"] == "finite"
    assert "embed.weight" in obs["nonfinite_params"]["nan"]
    assert_tensors_identical(bundle_model_state(ei.value.bundle), pre)
    assert len(task.optimizer.state) == 0                    # state made by the failing step: gone
    assert read_bundle(ei.value.bundle).manifest["optimizer"]["state"] == {}
    outcome = Replayer(read_bundle(ei.value.bundle), CPU).run()
    assert outcome.phase == "optimizer" and outcome.loss == obs["loss"]


@pytest.mark.slow
def test_failure_names_and_second_failure_does_not_overwrite(tmp_path):
    task = flaky_task(0)
    guard = Guard(task, entry=ENTRY, out=tmp_path, start_step=7)
    guard.step(flaky_batch(0))
    paths = []
    for _ in range(3):
        with pytest.raises(NonFiniteStep) as ei:
            guard.step(flaky_batch(1, poison=True))
        paths.append(ei.value.bundle)
        if len(paths) == 1:
            first_digest = dir_digest(paths[0])
    assert [p.name for p in paths] == ["step000008", "step000008-1", "step000008-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
    assert dir_digest(paths[0]) == first_digest
    # each retry started from the same restored state, so the bundles carry the same tensors
    for p in paths:
        assert read_bundle(p).manifest["step"] == 8
        assert_tensors_identical(bundle_model_state(p), bundle_model_state(paths[0]))
    guard.step(flaky_batch(2))
    with pytest.raises(NonFiniteStep) as ei:
        guard.step(flaky_batch(3, poison=True))
    assert ei.value.bundle.name == "step000009"


# --------------------------------------------------------------------------------------------
# Guard.watch in a custom loop


def test_watch_custom_loop(tmp_path):
    task, plain = flaky_task(0, "sgd"), flaky_task(0, "sgd")
    model, opt = task.model, task.optimizer
    out = tmp_path / "out"
    guard = Guard(task, entry=ENTRY, out=out)
    for s in range(3):
        with guard.watch(flaky_batch(s)) as w:
            opt.zero_grad(set_to_none=True)
            w.loss = flaky_loss(model, flaky_batch(s))
            w.loss.backward()
            opt.step()
        assert type(w.value) is float and w.value == w.loss.item()
        assert w.value == plain_step(plain, flaky_batch(s))
    assert list(out.iterdir()) == []
    assert guard.step_index == 3

    pre = clone_state(model)
    pre_opt = snapshot_opt(opt)
    bad = flaky_batch(9, poison=True)
    with pytest.raises(NonFiniteStep) as ei:
        with guard.watch(bad) as w:
            opt.zero_grad(set_to_none=True)
            w.loss = flaky_loss(model, bad)
            w.loss.backward()
            opt.step()
    assert math.isnan(w.value)
    assert ei.value.bundle == out / "step000003" and ei.value.observed["first"] == "loss"
    assert_tensors_identical(bundle_model_state(ei.value.bundle), pre)
    assert_opt_state_equal(bundle_optimizer_state(ei.value.bundle), pre_opt)
    assert_tensors_identical(clone_state(model), pre)


def test_watch_without_loss_still_catches_nonfinite_params(tmp_path):
    model = nn.Linear(2, 1)
    guard = Guard(Task(model, None, lambda m, b: m(b).sum()), entry=ENTRY, out=tmp_path)
    pre = clone_state(model)
    with pytest.raises(NonFiniteStep) as ei:
        with guard.watch(torch.ones(1, 2)):
            with torch.no_grad():
                model.bias.fill_(float("inf"))   # a user's in-place update gone wrong
    obs = ei.value.observed
    assert obs["first"] == "param" and obs["loss"] is None
    assert obs["summary"]["loss"] == "unknown" and obs["nonfinite_params"]["inf"] == ["bias"]
    assert_tensors_identical(clone_state(model), pre)


# --------------------------------------------------------------------------------------------
# replay matches the original step bit for bit (dropout and rand_like in the forward)


def healthy_task_and_batches():
    entry = f"{HEALTHY}:task"
    return entry, load_task(entry), import_target(str(HEALTHY)).batches()


def test_replay_of_capture_is_bit_exact(tmp_path):
    entry, task, batches = healthy_task_and_batches()
    for _ in range(2):
        plain_step(task, next(batches))
    batch = next(batches)
    path = capture(task, batch, tmp_path / "b", entry=entry, step=2)
    task.optimizer.zero_grad(set_to_none=True)
    loss = task.loss_fn(task.model, batch)
    loss.backward()
    task.optimizer.step()
    after = clone_state(task.model)
    # the forward really is random: the same step without restoring the RNG gives another loss
    assert task.loss_fn(task.model, batch).item() != task.loss_fn(task.model, batch).item()

    r = Replayer(read_bundle(path), CPU)
    assert r.task is not task
    outcome = r.run()
    assert outcome.phase is None and outcome.bad == []
    assert outcome.loss == loss.item()
    assert_tensors_identical(clone_state(r.task.model), after)


def test_replay_of_guard_bundle_is_bit_exact(tmp_path):
    entry, task, batches = healthy_task_and_batches()
    real_loss = []

    def nan_at_step_2(model, batch):
        loss = task_loss(model, batch)
        if guard.step_index == 2:
            real_loss.append(loss.item())
            return loss * float("nan")
        return loss

    task_loss = task.loss_fn
    task.loss_fn = nan_at_step_2
    guard = Guard(task, entry=entry, out=tmp_path)
    guard.step(next(batches))
    guard.step(next(batches))
    with pytest.raises(NonFiniteStep) as ei:
        guard.step(next(batches))
    assert ei.value.observed["first"] == "loss" and len(real_loss) == 1

    # the entry rebuilds the unwrapped task: replay computes the loss the step really had
    outcome = Replayer(read_bundle(ei.value.bundle), CPU).run()
    assert outcome.phase is None
    assert outcome.loss == real_loss[0]


def test_replay_runs_twice_identically(tmp_path):
    entry, task, batches = healthy_task_and_batches()
    for _ in range(2):
        plain_step(task, next(batches))
    path = capture(task, next(batches), tmp_path / "b", entry=entry)
    r = Replayer(read_bundle(path), CPU)
    first = r.run()
    after_first = clone_state(r.task.model)
    second = r.run()
    assert second.loss == first.loss
    assert_tensors_identical(clone_state(r.task.model), after_first)


@pytest.mark.slow
def test_snapshot_stream_is_a_flag_and_the_script_that_checks_it_runs(tmp_path):
    """Guard(snapshot_stream=...) takes True or False (BadInput otherwise); the check that a
    side-stream snapshot is the pre-step state (scripts/check_snapshot_stream.py, run on a GPU
    by scripts/gpu_check.sh) passes here, where both Guards copy synchronously."""
    import subprocess
    import sys

    from nanbisect.errors import BadInput

    task = load_task("fixtures/tasks/healthy.py:task")
    with pytest.raises(BadInput, match=r"snapshot_stream='no'\): give True or False"):
        Guard(task, entry="fixtures/tasks/healthy.py:task", out=tmp_path / "g",
              snapshot_stream="no")
    p = subprocess.run([sys.executable, "scripts/check_snapshot_stream.py", "--device", "cpu",
                        "--steps", "2"], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0 and "OK: both bundles hold the pre-step state" in p.stdout, \
        p.stdout + p.stderr
