"""Several independent bad rows in one batch (tests/tasks/many_rows.py), each found exactly
within the default budget of remedy replays: the row trace follows the batch through the
standard qkv split (view, permute, unbind: the rows on dim 1) and through a block under
activation checkpointing, in forward and in the backward its recomputation runs; it follows each
bad row on to where the rows meet (the loss, a weight's gradient), so that one replay without
them verifies the set and the trace says why none of them can stay."""
from __future__ import annotations

import pytest

import many_rows as tasks
import nanbisect
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.remedies.trials import DEFAULT_BUDGET

TASK = TEST_TASKS / "many_rows.py"
TWELVE = [0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 14]


def run(tmp_path, task: str, batch):
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(tasks, task)(), batch, bundle, entry=f"{TASK}:{task}")
    return run_bundle(bundle, RunOptions(run_repro=False, remedies=DEFAULT_BUDGET),
                      tmp_path / "r")


@pytest.mark.parametrize("task, batch, op, module, phase, rows, meet", [
    ("attention", lambda: tasks.tokens(empty=(2, 7, 11)), "aten._softmax.default", "attn",
     "forward", [2, 7, 11], "aten.nll_loss_forward.default in forward"),
    ("checkpointed", lambda: tasks.features(zero=TWELVE), "aten.div.Tensor", "unit", "forward",
     TWELVE, "aten.mean.default in forward"),
    ("checkpointed_backward", lambda: tasks.features(zero=TWELVE), "aten.div.Tensor", "unit",
     "backward", TWELVE, None),
], ids=["3-of-16-through-qkv-permute", "12-of-16-checkpointed", "12-of-16-checkpointed-backward"])
def test_every_bad_row_is_found_exactly_within_the_default_budget(tmp_path, task, batch, op,
                                                                   module, phase, rows, meet):
    r = run(tmp_path, task, batch())
    c = r.culprit
    assert (c.op, c.module, c.phase, c.samples) == (op, module, phase, rows)
    (s,) = [m for m in r.remedies if m.kind == "samples"]
    assert (s.outcome, s.detail["rows"], s.detail["found_by"]) == ("finite", rows, "trace")
    assert s.detail["complete"] and "tried" not in s.detail     # one replay: without them
    at = s.detail["reached_at"]
    assert at == meet if meet else at.endswith("in backward")   # a weight's gradient
    assert s.detail["minimal"] == f"each of them alone carries its bad value to {at}"
    assert [i["row"] for i in s.detail["identify"]] == rows
    replays = sum(1 for m in r.remedies if m.outcome != "skipped")
    assert replays <= DEFAULT_BUDGET
    if task == "attention":
        assert [i["fields"] for i in s.detail["identify"]] == [{"doc": f"doc-{i}"} for i in rows]
