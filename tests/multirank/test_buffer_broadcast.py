"""A NaN the model makes in a buffer, under DDP, whose forward broadcasts rank 0's buffers
(tests/tasks/ddp_train.py's vq_ema, tests/tasks/vq_buffer.py): the Guard on every rank reads the
buffers with the step and bundles the step that made it; a pre-state whose rank 0 already holds
it (vq_ema_poisoned, a capture) replays the step anyway, and the broadcast is a crossing: rank 1
received it, from rank 0."""
from __future__ import annotations

import pytest

from helpers.bundles import captured
from helpers import TEST_TASKS, run_json

TRAIN = TEST_TASKS / "ddp_train.py"
pytestmark = pytest.mark.slow


def test_the_step_that_made_a_buffer_nan_is_bundled_on_every_rank(tmp_path):
    bundle = captured(TRAIN, "vq_ema", tmp_path / "g")
    rep = run_json(bundle)
    c = rep["culprit"]
    assert (rep["verdict"], rep["phase"]) == ("culprit", "forward")
    assert (c["rank"], c["op"], c["module"], c["phase"]) == (0, "aten.div.Tensor", "module.vq",
                                                             "forward")
    assert rep["classification"] != "data"
    assert [r["how"] for r in rep["ranks"]] == ["computed", "computed"]   # each made its own


def test_a_buffer_broadcast_is_a_crossing_with_a_received_row(tmp_path):
    bundle = captured(TRAIN, "vq_ema_poisoned", tmp_path / "g")
    rep = run_json(bundle)
    assert (rep["verdict"], rep["classification"]) == ("input-nonfinite", "unknown")
    assert [b["name"] for b in rep["input_nonfinite"]] == ["rank 0: module.vq.embed"]
    r0, r1 = rep["ranks"]
    assert r0["how"] is None                   # it held them before the step
    assert (r1["how"], r1["via"]["op"], r1["via"]["phase"], r1["from_ranks"]) == (
        "received", "c10d.broadcast_.default", "forward", [0])
    assert "rank 0 holds non-finite values before the step" in rep["notes"]
    assert any(n.startswith("rank 1 received it through c10d.broadcast_.default")
               and n.endswith("from rank 0") for n in rep["notes"])
