"""A custom AMP loop whose GradScaler the Task does not declare (issue 30): the Guard tells a
skipped step by its non-finite gradients and unmoved parameters, whatever skipped it; a stall of
them is bundled as a declared scaler's is, and its report names the fix. Tiny models from
tests/tasks/loops.py, in-process; the bundles are replayed in-process (no repro run)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import loops
from helpers import TEST_TASKS

import nanbisect
from nanbisect import Guard, NonFiniteStep
from nanbisect.errors import UNDECLARED_SCALER
from nanbisect.pipeline import RunOptions, run_bundle

LOOPS = TEST_TASKS / "loops.py"
DECLARE = "Task(grad_scaler=scaler)"


def entry(func: str) -> str:
    return f"{LOOPS}:{func}"


def params_of(task) -> list[torch.Tensor]:
    return [p.detach().clone() for p in task.model.parameters()]


def replay(bundle, tmp_path):
    return run_bundle(bundle, RunOptions(run_repro=False), tmp_path / "report")


def line(text: str) -> int:
    return next(i for i, t in enumerate(LOOPS.read_text().splitlines(), 1) if text in t)


def stall(task, func: str, tmp_path, batch, history=64, skips=4, init_scale=1024.0):
    """Train ``task`` in the custom AMP loop (its own scaler) until the Guard raises: (the
    NonFiniteStep, the warnings, the parameters before the failing step)."""
    scaler = loops.loop_scaler(init_scale)
    guard = Guard(task, entry=entry(func), out=tmp_path / "out", max_scaler_skips=skips,
                  history=history)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(NonFiniteStep) as e:
        warnings.simplefilter("always")
        for s in range(3 * skips):
            pre = params_of(task)
            loops.amp_watch(guard, task, scaler, batch(s))
    return e.value, [str(w.message) for w in seen], pre


@pytest.mark.parametrize("history", [0, 64])
def test_an_undeclared_scaler_that_stalls_is_caught_at_max_scaler_skips(tmp_path, history):
    """Every backward is inf: the loop's scaler skips every step, the parameters never move and
    the loss stays finite; the gradients' flag tells, with history=0 too."""
    task = loops.unscaled()
    start = params_of(task)
    e, seen, pre = stall(task, "unscaled", tmp_path, loops.pos_batch, history=history)
    obs = e.observed
    assert (obs["step"], obs["scaler_skips"], obs["undeclared_scaler"]) == (3, 4, True)
    assert (obs["first"], obs["summary"]) == ("grad", {"loss": "finite", "grads": "inf",
                                                       "params": "finite"})
    assert DECLARE in str(e)
    assert len(seen) == 1 and "declares no GradScaler" in seen[0] and DECLARE in seen[0]
    assert all(torch.equal(a, b) for a, b in zip(start, pre))        # it never trained
    assert all(torch.equal(a, b) for a, b in zip(params_of(task), pre))   # restored


def test_the_undeclared_stall_replays_to_the_backward_op_with_the_fix_in_the_notes(tmp_path):
    task = loops.unscaled()
    e, _, _ = stall(task, "unscaled", tmp_path, loops.pos_batch)
    m = json.loads((e.bundle / "manifest.json").read_text())
    assert m["task"]["grad_scaler"] is False and m["grad_scaler"] is None
    assert [h["skipped"] for h in m["history"]["entries"]] == [True] * 4
    r = replay(e.bundle, tmp_path)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind, c.module) == ("culprit", "backward", "inf", "gate")
    assert c.op in ("aten.div.Tensor", "aten.mul.Tensor")     # sqrt's backward: grad / (2*0)
    assert c.source.endswith(f"loops.py:{line('BUG: d sqrt')}")
    assert UNDECLARED_SCALER in r.notes


def test_an_overflow_only_the_loops_scaling_makes_is_replay_mismatch(tmp_path):
    """Finite gradients of ~1e4 overflow at the loop's scale of 2**127: three skips in a row
    stall it. The replay (no scaler) is finite: replay-mismatch naming the scaler, not transient."""
    task = loops.loud()
    e, seen, _ = stall(task, "loud", tmp_path, loops.batch, skips=3, init_scale=2.0 ** 127)
    assert (e.observed["step"], e.observed["undeclared_scaler"]) == (2, True) and len(seen) == 1
    r = replay(e.bundle, tmp_path)
    assert (r.verdict, r.classification) == ("not-reproduced", "replay-mismatch")
    assert "GradScaler the Task does not declare" in r.notes[0] and UNDECLARED_SCALER in r.notes


def test_a_healthy_amp_loop_with_occasional_skips_never_raises(tmp_path):
    """A scaler that grows every step overflows now and then: single skips, never a stall; one
    warning, no bundle, and the training is the unguarded loop's, bit for bit."""
    guarded, plain = loops.healthy_scaled(), loops.healthy_scaled()
    for t in (guarded, plain):
        t.grad_scaler = None                       # the loop keeps its own
    scalers = [loops.loop_scaler(2.0 ** 126, growth_interval=1) for _ in range(2)]
    guard = Guard(guarded, entry=entry("healthy_scaled"), out=tmp_path, max_scaler_skips=2)
    skipped = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for s in range(16):
            before = scalers[0].get_scale()
            loops.amp_watch(guard, guarded, scalers[0], loops.batch(s))
            skipped.append(scalers[0].get_scale() < before)
            plain.optimizer.zero_grad(set_to_none=True)     # the same loop, unguarded
            scalers[1].scale(plain.loss_fn(plain.model, loops.batch(s))).backward()
            scalers[1].step(plain.optimizer)
            scalers[1].update()
    assert sum(skipped) >= 3 and guard.step_index == 16 and list(tmp_path.iterdir()) == []
    assert len(seen) == 1 and "declares no GradScaler" in str(seen[0].message)
    assert all(torch.equal(a, b) for a, b in zip(guarded.model.parameters(),
                                                 plain.model.parameters()))


def test_nonfinite_gradients_applied_in_part_fail_at_once(tmp_path):
    """The loop updates only the parameters whose gradients are finite (it skipped the rest):
    the parameters moved with non-finite gradients, a failure at the first step."""
    task = loops.unscaled()
    guard = Guard(task, entry=entry("unscaled"), out=tmp_path)
    pre = params_of(task)
    with pytest.raises(NonFiniteStep) as e:
        with guard.watch(loops.pos_batch(0)) as w:
            w.loss = task.loss_fn(task.model, loops.pos_batch(0))
            w.loss.backward()
            with torch.no_grad():
                for p in task.model.parameters():
                    if torch.isfinite(p.grad).all():
                        p -= 0.1 * p.grad
    obs = e.value.observed
    assert (obs["step"], obs["first"], obs["summary"]["grads"]) == (0, "grad", "inf")
    assert "scaler_skips" not in obs and "undeclared_scaler" not in obs
    assert obs["nonfinite_grads"]["inf"] == ["fc.weight", "fc.bias"]
    assert all(torch.equal(a, b) for a, b in zip(params_of(task), pre))


def test_a_declared_scaler_stalls_as_before(tmp_path):
    """The same loop with its scaler on the Task: no warning, no note, the same observation."""
    task = loops.scaled()
    guard = Guard(task, entry=entry("scaled"), out=tmp_path, max_scaler_skips=3)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(NonFiniteStep) as e:
        warnings.simplefilter("always")
        for s in range(6):
            loops.amp_watch(guard, task, task.grad_scaler, loops.pos_batch(s))
    assert seen == [] and DECLARE not in str(e.value)
    assert set(e.value.observed) == {"step", "first", "loss", "summary", "nonfinite_grads",
                                     "nonfinite_params", "scaler_skips"}
    assert (e.value.observed["step"], e.value.observed["scaler_skips"]) == (2, 3)


def test_guard_step_without_an_optimizer_fails_on_nonfinite_gradients(tmp_path):
    """Nothing can skip or apply them: the Task's backward made them, a failure at once."""
    model = torch.nn.Linear(2, 2)
    task = nanbisect.Task(model, None, lambda m, b: torch.sqrt(m.weight - m.weight.detach()).sum())
    with pytest.raises(NonFiniteStep) as e:
        Guard(task, entry=entry("unscaled"), out=tmp_path).step(None)
    assert (e.value.observed["first"], e.value.observed["summary"]["grads"]) == ("grad", "inf")
