"""Multi-rank ``--reference``: both sides replay the recorded world (real processes, gloo, CPU).

A fused op of an MoE-like block (tests/tasks/mr_moe.py) is broken only on the target, through
``--inject`` (target-only): the reference, given the culprit op's own inputs, computes it right,
so the classification is ``device``, earned by the op check; without a reference the same replay
can only say ``unknown``. A NaN that the arithmetic makes on any device is ``numerics``; a
reduction that returns NaN from finite inputs stays ``communication``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.bundles import captured
from helpers import TEST_TASKS, run_json

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

MOE = TEST_TASKS / "mr_moe.py"
BROKEN = f"{MOE}:broken_unpermute"


def capture(script: Path, func: str, out: Path) -> Path:
    return captured(script, func, out)


@pytest.fixture(scope="module")
def moe_ddp(tmp_path_factory) -> Path:
    return capture(MOE, "moe_ddp", tmp_path_factory.mktemp("moe_ddp") / "g")


@pytest.fixture(scope="module")
def moe_fsdp(tmp_path_factory) -> Path:
    return capture(MOE, "moe_fsdp", tmp_path_factory.mktemp("moe_fsdp") / "g")


def _device_culprit(rep: dict, module: str) -> None:
    c = rep["culprit"]
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "culprit", "device", "backward"), rep["notes"]
    assert (c["op"], c["module"], c["module_call"], c["rank"]) == (
        "nbtest.unpermute_backward.default", module, 0, 0)
    assert c["input_dtypes"] == ["float32", "float32", "float32"]
    assert rep["op_check"]["status"] == "mismatch"      # the evidence: same inputs, other result
    assert rep["reference"] == "cpu"
    for r in rep["ranks"]:                              # every rank ran on both sides
        assert r["phase"] == "backward" and r["reference"]["phase"] is None
        assert r["reference"]["loss"] == r["loss"]     # forward is the same on both sides


def test_ddp_fused_op_broken_on_the_target_is_device(moe_ddp, tmp_path):
    rep = run_json(moe_ddp, "--reference", "cpu", "--inject", BROKEN, "--out", tmp_path / "r")
    _device_culprit(rep, "module.moe")
    assert rep["ranks"][1]["reduction_in_bad"] is True    # every rank computed it locally
    assert any("repro did not reproduce on cpu: it runs the op without --inject" in n
               for n in rep["notes"])


def test_without_a_reference_the_same_fault_is_unknown(moe_ddp, tmp_path):
    rep = run_json(moe_ddp, "--reference", "none", "--inject", BROKEN, "--out", tmp_path / "r")
    assert (rep["verdict"], rep["classification"], rep["op_check"]) == ("culprit", "unknown",
                                                                        None)
    assert rep["culprit"]["op"] == "nbtest.unpermute_backward.default"
    assert all("reference" not in r for r in rep["ranks"])


def test_fsdp2_fused_op_broken_on_the_target_is_device(moe_fsdp, tmp_path):
    rep = run_json(moe_fsdp, "--reference", "cpu", "--inject", BROKEN, "--out", tmp_path / "r")
    _device_culprit(rep, "moe")


def test_fsdp2_reduce_scatter_fault_with_a_reference_is_communication(moe_fsdp, tmp_path):
    inject = f"{TEST_TASKS / 'corrupt_allreduce.py'}:corrupt_reduce_scatter"
    rep = run_json(moe_fsdp, "--reference", "cpu", "--inject", inject, "--out", tmp_path / "r")
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "culprit", "communication", "grad-reduce")
    assert rep["culprit"]["op"] == "c10d._reduce_scatter_base_.default"
    # the inject is the target's only: the reference's reduce-scatter stayed finite
    assert [r["reference"]["phase"] for r in rep["ranks"]] == [None, None]


def test_rank_diverging_without_nan_is_isolated_to_its_op(moe_ddp, tmp_path):
    # rank 1's device computes the fused forward op 1% off: no NaN anywhere, the bundle records
    # no failure; rank 0 parts from its reference too, but only through the gradient reduction
    rep = run_json(moe_ddp, "--reference", "cpu", "--inject", f"{MOE}:skewed_unpermute",
                   "--out", tmp_path / "r")
    c = rep["culprit"]
    assert (rep["verdict"], rep["classification"], c["phase"], c["rank"]) == (
        "culprit", "device", "forward", 1)
    assert (c["op"], c["module"], c["module_call"]) == ("nbtest.unpermute.default",
                                                         "module.moe", 0)
    r0, r1 = rep["ranks"]
    assert r1["reference"]["divergence"] == "loss"
    assert r0["reference"]["divergence"].startswith("grad:")
    assert r0["reference"]["loss"] == r0["loss"]         # rank 0's own forward agrees


def test_ddp_nan_the_arithmetic_makes_everywhere_is_numerics(tmp_path):
    from test_multirank import ranks_capture

    bundle = ranks_capture("rank1_nan", tmp_path / "g")
    rep = run_json(bundle, "--reference", "cpu")
    c = rep["culprit"]
    assert (rep["classification"], c["rank"], c["op"], c["phase"]) == (
        "numerics", 1, "aten.sqrt.default", "forward")
    assert rep["ranks"][1]["reference"]["phase"] == "forward"     # the reference fails too
    assert any("the reference fails too" in n for n in rep["notes"])


def test_ddp_comm_hook_fault_with_a_reference_is_communication(tmp_path):
    from test_multirank import ranks_capture

    bundle = ranks_capture("comm_corrupt", tmp_path / "g")
    rep = run_json(bundle, "--reference", "cpu")
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "culprit", "communication", "grad-reduce")
    assert rep["replay"]["reference_loss"] == rep["ranks"][0]["reference"]["loss"]
