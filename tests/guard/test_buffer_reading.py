"""Buffers are read with the step (tests/tasks/vq_buffer.py: a VQ-VAE whose codebook's moving
average is 0/0 for a code no vector picked): the step that makes the NaN keeps a finite loss, and
the Guard still bundles it, in `Guard.step` and in `Guard.watch`; the replay finds the division
in forward. A pre-state that already holds the NaN (a capture after that step) is not the data:
the report says whose it is."""
from __future__ import annotations

import math

import pytest
import torch

import nanbisect
import vq_buffer as vq
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle

TASK = TEST_TASKS / "vq_buffer.py"
BUG = next(i for i, t in enumerate(TASK.read_text().splitlines(), 1)
           if "new = self.embed_sum / self.cluster_size" in t)


def guarded(tmp_path, watch: bool):
    task = vq.task()
    guard = nanbisect.Guard(task, entry=f"{TASK}:task", out=tmp_path / "g")
    with pytest.raises(nanbisect.NonFiniteStep) as e:
        for step in range(3):
            batch = vq.batch(step)
            if not watch:
                guard.step(batch)
                continue
            with guard.watch(batch) as w:
                task.optimizer.zero_grad()
                w.loss = task.loss_fn(task.model, batch)
                w.loss.backward()
                task.optimizer.step()
    return e.value


@pytest.mark.parametrize("watch", [False, True], ids=["step", "watch"])
def test_a_nan_made_in_a_buffer_is_bundled_at_the_step_that_made_it(tmp_path, watch):
    failed = guarded(tmp_path, watch)
    o = failed.observed
    assert (o["step"], o["first"]) == (0, "buffer")
    assert o["summary"] == {"loss": "finite", "grads": "finite", "params": "finite",
                            "buffers": "nan"}
    assert o["nonfinite_buffers"]["nan"] == ["vq.embed"]
    r = run_bundle(failed.bundle, RunOptions(run_repro=False), tmp_path / "r")
    c = r.culprit
    assert (r.verdict, r.phase, c.op, c.module, c.phase) == ("culprit", "forward",
                                                             "aten.div.Tensor", "vq", "forward")
    assert c.source.endswith(f"vq_buffer.py:{BUG}") and r.classification != "data"
    assert c.likely_cause.startswith("0/0")


def test_a_pre_state_whose_buffers_are_bad_is_the_models_not_the_data(tmp_path):
    task = vq.task()
    task.loss_fn(task.model, vq.batch(0))     # step 0's forward made the NaN in the codebook
    assert not bool(task.model.vq.embed.isfinite().all())
    nanbisect.capture(task, vq.batch(1), tmp_path / "b", entry=f"{TASK}:task")
    r = run_bundle(tmp_path / "b", RunOptions(run_repro=False), tmp_path / "r")
    assert (r.verdict, r.classification) == ("input-nonfinite", "unknown")
    assert [(b.where, b.name) for b in r.input_nonfinite] == [("buffer", "vq.embed")]
    assert any(n.startswith("only the model's buffers held non-finite values before the step "
                            "(vq.embed): the model's own forward made them in an earlier step")
               for n in r.notes)
    # a NaN in the batch is the data
    batch = vq.batch(1)
    batch[0, 0] = float("nan")
    nanbisect.capture(vq.task(), batch, tmp_path / "d", entry=f"{TASK}:task")
    r = run_bundle(tmp_path / "d", RunOptions(run_repro=False), tmp_path / "rd")
    assert (r.verdict, r.classification) == ("input-nonfinite", "data")


def test_a_pre_state_whose_buffers_are_bad_is_traced_back_through_the_lookback(tmp_path):
    """The codebook put in the buffer's place (not written in place): the Guard reads it from
    the next step, whose loss is NaN and whose pre-state holds it. The bundle's lookback holds
    the step before: its replay from the snapshot makes the NaN in the buffer, and that step is
    bisected: the division, at step 0."""
    task = vq.assigning()
    guard = nanbisect.Guard(task, entry=f"{TASK}:assigning", out=tmp_path / "g", lookback=2)
    with pytest.raises(nanbisect.NonFiniteStep) as e:
        for step in range(3):
            guard.step(vq.batch(step))
    assert e.value.observed["step"] == 1
    r = run_bundle(e.value.bundle, RunOptions(run_repro=False), tmp_path / "r")
    c = r.culprit
    assert (r.verdict, c.step, c.op, c.module, c.phase) == ("culprit", 0, "aten.div.Tensor",
                                                            "vq", "forward")
    assert c.source.endswith(f"vq_buffer.py:{BUG}")
    assert r.notes[0] == ("step 1's pre-state held non-finite buffers (vq.embed); traced back "
                          "through the bundle's lookback to step 0, whose replay made them: the "
                          "culprit is that step's")
    assert r.facts.observed["step"] == 1


def test_buffers_that_hold_inf_by_design_are_no_failure(tmp_path):
    """A -inf causal mask and a +inf running minimum (tests/tasks/inf_buffers.py): the Guard
    trains on (it bundled step 0 as a failure), and a real NaN in the same model is bisected to
    its op (the replay stopped at "non-finite values before the step")."""
    import inf_buffers

    entry = TEST_TASKS / "inf_buffers.py"
    task = inf_buffers.healthy()
    guard = nanbisect.Guard(task, entry=f"{entry}:healthy", out=tmp_path / "g")
    losses = [guard.step(inf_buffers.batch(s)) for s in range(4)]
    assert all(math.isfinite(v) for v in losses)
    assert not list((tmp_path / "g").glob("step*"))          # no bundle written
    nanbisect.capture(inf_buffers.faulty(), inf_buffers.batch(), tmp_path / "b",
                      entry=f"{entry}:faulty")
    r = run_bundle(tmp_path / "b", RunOptions(run_repro=False), tmp_path / "r")
    assert (r.verdict, r.culprit.op, r.culprit.phase) == ("culprit", "aten.sqrt.default",
                                                          "forward")
