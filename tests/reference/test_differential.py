"""Cross-device differential replay on CPU: target-only faults come in through --inject."""
from __future__ import annotations

import pytest
import torch

from helpers import ROOT, cli, run_json

NPU = f"{ROOT / 'fixtures' / 'inject' / 'npu_kernels.py'}:npu"
MATMUL_OFF = f"{ROOT / 'fixtures' / 'inject' / 'matmul_off.py'}:matmul_off"
NBDEV_IMPLS = str(ROOT / "fixtures" / "reference" / "nbdev_impls.py")


@pytest.mark.parametrize("reference", ["cpu", "cpu:float64"])
@pytest.mark.slow
def test_fused_op_backward_nan_only_on_device(fixture_bundle, reference):
    rep = run_json(fixture_bundle("moe_unpermute_on_npu"), "--inject", NPU,
                   "--reference", reference)
    c = rep["culprit"]
    assert (c["phase"], c["module"], c["module_call"], c["op"]) == (
        "backward", "moe.combine", 0, "nbmoe.unpermute_backward.default")
    assert c["input_dtypes"] == ["float32", "float32", "float32"]   # probs is the fp32 third
    assert c["input_shapes"][2] == [6]
    assert rep["classification"] == "device"
    assert rep["op_check"]["status"] == "mismatch"
    assert rep["op_check"]["comparisons"][0]["nonfinite_new"] == 96
    # the repro runs the op without the injected kernel: it cannot reproduce here, and says why
    assert rep["repro_result"]["reproduced"] is False
    assert any("without --inject" in n for n in rep["notes"]) and rep["module_repro"] is None


def test_same_bundle_without_the_device_does_not_reproduce(fixture_bundle):
    """Transient when this machine and environment are the capture's; on other hardware (a CPU
    without the capture's AVX512: the shipped bundle replayed on another machine) or with other
    versions (another Python, numpy: a Debian system Python's venv), the change is as likely a
    cause: unknown, and the notes say which."""
    rep = run_json(fixture_bundle("moe_unpermute_on_npu"), "--reference", "cpu", code=3)
    hardware, versions = rep["replay"]["hardware_changed"], rep["replay"]["environment_changed"]
    assert (rep["verdict"], rep["classification"]) == (
        "not-reproduced", "unknown" if hardware or versions else "transient"), (hardware, versions)
    if hardware:
        assert any("other hardware than the capture" in n for n in rep["notes"])
    elif versions:
        assert any("other versions than the capture" in n for n in rep["notes"])


@pytest.mark.parametrize("reference", ["cpu", "cpu:float64"])
def test_matmul_off_for_one_shape(fixture_bundle, reference):
    rep = run_json(fixture_bundle("deterministic_gpt"), "--inject", MATMUL_OFF,
                   "--reference", reference)
    c = rep["culprit"]
    assert (rep["verdict"], rep["kind"], rep["classification"]) == ("culprit", "mismatch",
                                                                    "device")
    assert (c["phase"], c["module"], c["module_call"], c["op"]) == (
        "forward", "head", 0, "aten.mm.default")
    assert c["input_shapes"] == [[48, 32], [32, 64]]
    comp = rep["op_check"]["comparisons"][0]
    # the planted 3% at the worst element; the largest element-wise relative difference can be
    # more, where the float32 kernel's own rounding meets a near-zero element of the float64
    # truth (how much depends on the instruction set: 0.0317 under ATEN_CPU_CAPABILITY=default)
    assert comp["ok"] is False and comp["max_rel"] > 0.029
    assert abs(comp["worst_target"] / comp["worst_expected"] - 1.03) < 1e-3
    assert comp["message"].startswith("Mismatched elements: ")
    assert rep["divergence"]["what"] == "loss"


def test_ops_after_the_wrong_matmul_are_not_blamed(monkeypatch):
    """Judge *every* forward op in isolation: only the injected matmul fails; the ops after
    it, which inherit its error, pass their own checks."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.reference.differential import isolate_window
    from nanbisect.reference import differential
    from nanbisect.task import load_inject
    from nanbisect.replay.replayer import Replayer

    checks = []
    real = differential.check_op

    def record(*a, **k):
        r = real(*a, **k)
        checks.append(r)
        return r if r.status != "mismatch" else type(r)(r.op, r.op_index, "ok")  # keep going

    monkeypatch.setattr(differential, "check_op", record)
    rep = Replayer(read_bundle(ROOT / "fixtures" / "bundles" / "deterministic_gpt"),
                   torch.device("cpu"))
    isolate_window(rep, "forward", None, torch.device("cpu"), load_inject(MATMUL_OFF))
    bad = [c for c in checks if c.status == "mismatch"]
    assert [c.op for c in bad] == ["aten.mm.default"]
    assert len([c for c in checks if c.status == "ok"]) > 50


def test_fully_masked_row_is_numerics(fixture_bundle):
    rep = run_json(fixture_bundle("fully_masked_row"), "--reference", "cpu")
    assert rep["classification"] == "numerics"
    assert (rep["culprit"]["op"], rep["culprit"]["module"]) == ("aten._softmax.default",
                                                                "blocks.0.attn")
    assert rep["op_check"]["status"] == "ok"   # the reference does the same with these inputs


@pytest.mark.parametrize("name", ["healthy", "deterministic_gpt"])
def test_upcast_reference_gives_no_false_positive(fixture_bundle, name):
    """healthy has dropout and rand_like: the float64 reference draws them in float32."""
    rep = run_json(fixture_bundle(name), "--reference", "cpu:float64", code=0)
    assert rep["verdict"] == "clean"


@pytest.mark.slow
def test_device_only_op_without_reference_is_uncomparable(fixture_bundle):
    rep = run_json(fixture_bundle("device_only_op"), "--inject", NPU, "--reference", "cpu")
    assert rep["culprit"]["op"] == "nbdev.fused_gelu.default"
    assert rep["classification"] == "unknown"
    assert rep["op_check"]["status"] == "uncomparable"
    assert [u["op"] for u in rep["uncomparable"]] == ["nbdev.fused_gelu.default"]


@pytest.mark.slow
def test_device_only_op_with_registered_reference(fixture_bundle):
    rep = run_json(fixture_bundle("device_only_op"), "--inject", NPU, "--reference", "cpu",
                   env={"NANBISECT_REFERENCE_IMPLS": NBDEV_IMPLS})
    assert rep["classification"] == "device"
    assert (rep["op_check"]["status"], rep["op_check"]["how"]) == ("mismatch", "registered")
    assert rep["uncomparable"] == []


@pytest.mark.parametrize("flag, value, needle", [
    ("--reference", "cuda:3", "not available"),
    ("--reference", "cpu:int32", "not a floating dtype"),
    ("--target", "xpu", "not available"),
    ("--inject", "no/such/file.py:f", "not found"),
])
def test_bad_devices_and_inject(fixture_bundle, flag, value, needle):
    res = cli("run", "--ckpt", fixture_bundle("healthy"), flag, value)
    assert res.code == 2 and needle in res.stderr and "Traceback" not in res.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_target_cpu_reference(fixture_bundle):
    rep = run_json(fixture_bundle("forward_nan_behind_mask"), "--target", "cuda",
                   "--reference", "cpu")
    assert rep["culprit"]["op"] == "aten.sqrt.default"
    assert rep["classification"] == "numerics"


def _table(fc2_in: float, fc2_out: float, root_in: float | None = 1.0):
    """A forward of root -> fc1, then an op of root's own, then fc2: fc2's incoming and outgoing
    magnitudes as given, the rest the same on both sides."""
    from nanbisect.records import CallId, Stats
    from nanbisect.replay.probe import CallStats, ProbeTable

    def stats(x):
        return None if x is None else Stats(0, 0, 0, x, x * 8)

    def call(name, parent, end, inp, out):
        return CallStats(CallId(name, 0), parent, ["float32"], [[8, 4]], end, None,
                         stats(inp), stats(out), None, None)
    root = CallId("", 0)
    return ProbeTable([call("", None, 3, root_in, fc2_out), call("fc1", root, 1, 1.0, 2.0),
                       call("fc2", root, 2, fc2_in, fc2_out)], [])


def test_a_call_whose_inputs_already_differ_is_not_the_divergence():
    """Producer vs propagator, without NaN: fc2's output differs, but so does its input (an op
    root runs itself between fc1 and fc2 made it): the call to isolate is root, whose inputs
    agree, never fc2; fc2 is isolated when its inputs agree and its output does not."""
    from nanbisect.reference.differential import diverging_call

    reference = _table(3.0, 5.0)
    found = diverging_call(_table(3.1, 5.2), reference, "forward", torch.float32)
    assert found is not None and found.call.module == ""
    found = diverging_call(_table(3.0, 5.2), reference, "forward", torch.float32)
    assert found is not None and found.call.module == "fc2"
    assert diverging_call(_table(3.0, 5.0), reference, "forward", torch.float32) is None
    # a parent whose incoming values were not seen is no evidence: the whole phase, not it
    unseen = _table(3.0, 5.0, root_in=None)
    assert diverging_call(_table(3.1, 5.2, root_in=None), unseen, "forward",
                          torch.float32) is None
