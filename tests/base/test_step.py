"""The whole training step (nanbisect.step, Guard.step, every replay): GradScaler, clipping,
accumulation, frozen modules, and what the bundle records of them. Tiny models from
tests/tasks/loops.py; failures found by replaying the bundles Guard wrote."""
from __future__ import annotations

import json

import pytest
import torch

import loops
from helpers import TEST_TASKS, run_json

from nanbisect import Guard, NonFiniteStep
from nanbisect.step import add_loss, run_step

LOOPS = TEST_TASKS / "loops.py"


def entry(func: str) -> str:
    return f"{LOOPS}:{func}"


# ------------------------------------------------------------------------------------------
# GradScaler


def test_scaler_skips_are_normal_and_reset(tmp_path):
    task = loops.healthy_scaled()
    guard = Guard(task, entry=entry("healthy_scaled"), out=tmp_path)
    skipped = []
    for s in range(12):
        before = task.grad_scaler.get_scale()
        guard.step(loops.batch(s))
        skipped.append(task.grad_scaler.get_scale() < before)
    assert sum(skipped) >= 1 and not any(skipped[-4:])       # overflowed, then trains
    assert guard.scaler_skips == 0 and guard.step_index == 12
    assert list(tmp_path.iterdir()) == []                   # no bundle: a skip is not a failure


@pytest.mark.slow
def test_stalled_scaler_is_caught_and_its_op_named(tmp_path):
    task = loops.scaled()
    guard = Guard(task, entry=entry("scaled"), out=tmp_path, max_scaler_skips=4)
    losses = []
    with pytest.raises(NonFiniteStep) as e:
        for s in range(10):
            losses.append(guard.step(loops.pos_batch(s)))
    assert len(losses) == 3                                 # the 4th skip in a row raised
    obs = e.value.observed
    assert (obs["step"], obs["scaler_skips"], obs["summary"]["grads"]) == (3, 4, "inf")
    assert obs["summary"]["loss"] == obs["summary"]["params"] == "finite"
    m = json.loads((e.value.bundle / "manifest.json").read_text())
    assert m["grad_scaler"]["scale"] == 1024.0 / 2 ** 3      # the scale the last skip had
    rep = run_json(e.value.bundle)
    c = rep["culprit"]
    assert (rep["phase"], rep["kind"], c["module"], c["module_call"]) == (
        "backward", "inf", "gate", 0)
    assert c["op"] in ("aten.div.Tensor", "aten.mul.Tensor")   # sqrt's backward: grad / (2*0)
    assert c["source"].endswith(f"loops.py:{line('BUG: d sqrt')}")   # the forward line
    assert rep["replay"]["bit_exact"] is True


def test_a_first_step_bundle_holds_the_scalers_initial_state(tmp_path):
    """The scaler makes its scale during its first step: the state before it is the initial."""
    task = loops.scaled()
    guard = Guard(task, entry=entry("scaled"), out=tmp_path, max_scaler_skips=1)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(loops.pos_batch(0))
    assert task.grad_scaler.get_scale() == 1024.0             # the live scaler is restored too
    m = json.loads((e.value.bundle / "manifest.json").read_text())
    assert (m["grad_scaler"]["scale"], m["grad_scaler"]["_growth_tracker"]) == (1024.0, 0)


def line(text: str) -> int:
    return next(i for i, t in enumerate(LOOPS.read_text().splitlines(), 1) if text in t)


# ------------------------------------------------------------------------------------------
# clipping and accumulation


def plain_clipped_step(task, micro_batches) -> torch.Tensor:
    """The loop written out by hand: what Guard.step must compute, bit for bit."""
    task.optimizer.zero_grad(set_to_none=True)
    total = None
    for mb in micro_batches:
        loss = task.loss_fn(task.model, mb) / len(micro_batches)
        total = loss.detach() if total is None else total + loss.detach()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(task.model.parameters(), task.clip_grad_norm)
    task.optimizer.step()
    return total, norm


def test_clipped_accumulated_step_is_the_loop_bit_for_bit(tmp_path):
    guarded, plain = loops.clipped(), loops.clipped()
    guard = Guard(guarded, entry=entry("clipped"), out=tmp_path)
    for s in range(4):
        mbs = [loops.switch_batch(10 * s), loops.switch_batch(10 * s + 1)]
        value = guard.step(mbs)
        total, _ = plain_clipped_step(plain, mbs)
        assert value == total.item()
    for a, b in zip(guarded.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)


def test_clipping_keeps_the_gradients_kind_and_the_replay_finds_it(tmp_path):
    task = loops.clipped()
    guard = Guard(task, entry=entry("clipped"), out=tmp_path)
    guard.step([loops.switch_batch(0), loops.switch_batch(1)])
    with pytest.raises(NonFiniteStep) as e:
        guard.step([loops.switch_batch(2), loops.switch_batch(3, bad=True)])
    obs = e.value.observed
    # after clipping the gradients are NaN (inf * max_norm / inf); the norm before says inf
    assert obs["summary"]["grads"] == "inf" and obs["grad_norm"] == "inf"
    assert obs["nonfinite_grads"]["nan_count"] > 0
    m = json.loads((e.value.bundle / "manifest.json").read_text())
    assert m["task"]["accumulate"] == 2 and m["task"]["clip_grad_norm"] == 1.0
    rep = run_json(e.value.bundle)
    c = rep["culprit"]
    assert (rep["phase"], rep["kind"], c["module"], c["micro_batch"]) == (
        "backward", obs["summary"]["grads"], "gate", 1)
    assert rep["replay"]["bit_exact"] is True and rep["replay"]["faithful"] is True


def test_accumulate_needs_a_list_of_micro_batches():
    task = loops.clipped()
    with pytest.raises(Exception, match="list of 2 micro-batches"):
        list(run_step(task, loops.switch_batch(0)))


def test_add_loss_divides_unless_the_loss_is_normalised():
    task = loops.clipped()
    part, total = add_loss(task, None, torch.tensor(3.0))
    assert part.item() == 1.5 and total.item() == 1.5
    task.loss_normalized = True
    part, total = add_loss(task, total, torch.tensor(3.0))
    assert part.item() == 3.0 and total.item() == 4.5


# ------------------------------------------------------------------------------------------
# what the loop changes after building the model


def test_frozen_batchnorm_in_eval_mode_reproduces(tmp_path):
    task = loops.frozen_bn()
    loops.freeze_backbone(task.model)
    guard = Guard(task, entry=entry("frozen_bn"), out=tmp_path)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(loops.batch(0))
    m = json.loads((e.value.bundle / "manifest.json").read_text())
    assert m["model"]["training"]["backbone.1"] is False and m["model"]["training"][""] is True
    assert set(m["model"]["frozen"]) == {"backbone.0.weight", "backbone.0.bias",
                                         "backbone.1.weight", "backbone.1.bias"}
    rep = run_json(e.value.bundle)
    c = rep["culprit"]
    assert (rep["verdict"], c["phase"], c["module"], c["op"]) == (
        "culprit", "forward", "gate", "aten.sqrt.default")


def test_frozen_parameter_stays_frozen_in_the_replay(tmp_path):
    task = loops.frozen_param()
    task.model.scale.requires_grad_(False)        # the loop freezes it
    guard = Guard(task, entry=entry("frozen_param"), out=tmp_path)
    with pytest.raises(NonFiniteStep) as e:
        for s in range(5):
            guard.step(loops.bag_batch(s))
    rep = run_json(e.value.bundle)
    c = rep["culprit"]
    # trained, `scale` would get an inf gradient and the replay would blame the backward
    assert (rep["phase"], c["phase"], c["parameter"]) == ("optimizer", "optimizer",
                                                          "embed.weight")
    assert rep["replay"]["bit_exact"] is True


@pytest.mark.slow
def test_a_step_the_scaler_skips_normally_replays_clean(tmp_path):
    """capture() of a step whose scaled gradients overflow: the scaler skips it, as it should;
    the replay says so and blames nothing."""
    from nanbisect import capture

    task = loops.healthy_scaled()
    guard = Guard(task, entry=entry("healthy_scaled"), out=tmp_path / "g")
    scales = []
    for s in range(6):
        path = capture(task, loops.batch(s), tmp_path / f"step{s}", entry=entry("healthy_scaled"))
        before = task.grad_scaler.get_scale()
        guard.step(loops.batch(s))
        scales.append((path, task.grad_scaler.get_scale() < before))
    path = next(p for p, skipped in scales if skipped)
    rep = run_json(path, code=0)
    assert (rep["verdict"], rep["culprit"]) == ("clean", None)
    assert any("skipped this step" in n for n in rep["notes"])


def test_a_disabled_scaler_is_no_scaler(tmp_path):
    task = loops.healthy_scaled()
    task.grad_scaler = torch.amp.GradScaler("cpu", enabled=False)   # GradScaler(enabled=use_amp)
    guard = Guard(task, entry=entry("healthy_scaled"), out=tmp_path)
    for s in range(3):
        guard.step(loops.batch(s))
    assert task.describe()["grad_scaler"] is False


def test_a_custom_loop_with_a_stalled_scaler_is_caught(tmp_path):
    """Guard.watch: the loop runs its own AMP recipe; the guard sees the scale backed off."""
    task = loops.scaled()
    scaler, opt = task.grad_scaler, task.optimizer
    guard = Guard(task, entry=entry("scaled"), out=tmp_path, max_scaler_skips=3)
    with pytest.raises(NonFiniteStep) as e:
        for s in range(6):
            b = loops.pos_batch(s)
            with guard.watch(b) as w:
                opt.zero_grad()
                w.loss = task.loss_fn(task.model, b)
                scaler.scale(w.loss).backward()
                scaler.step(opt)
                scaler.update()
    assert e.value.observed["scaler_skips"] == 3 and e.value.observed["step"] == 2
