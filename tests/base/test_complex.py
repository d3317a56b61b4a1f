"""Complex tensors count as floating tensors everywhere (DESIGN contract v4; issue 38, item 3):
the op recorder's flags and magnitudes, the module probe's statistics, the repro's saved inputs
and the op check against a reference. A multi-resolution STFT loss from
tests/tasks/complex_stft.py, captured and replayed in process; the pieces alone below it."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

import complex_stft
import nanbisect
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.records import CallId, Culprit, ModuleCaught
from nanbisect.reference.compare import compare_step
from nanbisect.reference.opcheck import check_op
from nanbisect.replay.probe import tensor_stats
from nanbisect.replay.recorder import OpRecorder
from nanbisect.report.repro import write_module_repro
from nanbisect.report.rerun import run_repro
from nanbisect.util.tensors import (cast_floating, nan_inf_counts, nonfinite, surely_finite)

TASKS = TEST_TASKS / "complex_stft.py"
NAN, INF = float("nan"), float("inf")


def line_of(text: str) -> int:
    return next(i for i, t in enumerate(TASKS.read_text().splitlines(), 1) if text in t)


def replay(tmp_path, func: str, **options):
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(complex_stft, func)(), complex_stft.batch(), bundle,
                      entry=f"{TASKS}:{func}")
    return run_bundle(bundle, RunOptions(**options), tmp_path / "report")


def saved_inputs(path):
    """(metadata, tensors as the file holds them) of a repro's safetensors file."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["nanbisect"]), {k: f.get_tensor(k) for k in f.keys()}


# ------------------------------------------------------------------------------------------
# end to end: the STFT loss


def test_hypot_at_a_silent_frame_is_named_not_the_window_multiply(tmp_path):
    """hypot's backward divides 0 by 0 at a silent frame (a real op); the FFT's backward carries
    the NaN through complex tensors to the STFT's window multiply, the first real op after it.
    With complex values unflagged that multiply looked born from clean inputs."""
    r = replay(tmp_path, "hypot_at_zero", run_repro=True)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind) == ("culprit", "backward", "nan")
    assert (c.phase, c.module, c.module_call, c.op) == (
        "backward", "stft_loss", 0, "aten.div.Tensor")
    assert c.node.name == "HypotBackward0" and c.node.forward_op == "aten.hypot.default"
    assert c.source.endswith(f"complex_stft.py:{line_of('BUG: hypot backward at 0')}")
    assert r.inf_origin is None and c.surfaced is None
    assert r.repro_result.reproduced
    assert "produces nan from nan-free inputs" in r.repro_result.output


def test_a_nan_born_in_a_complex_op_names_that_op(tmp_path):
    """``S ** 0.3`` of the complex STFT: forward is finite, the NaN is born in its backward, a
    complex ``pow`` of 0 to the power -0.7. The culprit is that complex op in its module (whose
    complex input gradient the module probe now counts), and its repro saves the complex input
    (as its real view, named in the metadata) and rebuilds it."""
    r = replay(tmp_path, "compressed_at_zero", run_repro=True)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind) == ("culprit", "backward", "nan")
    assert (c.phase, c.module, c.op) == ("backward", "stft_loss.compress",
                                         "aten.pow.Tensor_Scalar")
    assert c.node.name == "PowBackward0"
    assert c.source.endswith(f"complex_stft.py:{line_of('BUG: complex 0 ** -0.7')}")
    assert c.input_dtypes == ["complex64"]
    # the module probe's statistics: the complex gradients that reach each spectrogram
    back = {(b.module, b.call): b for b in r.backtrace}
    spec = back[("stft_loss.specs.32", 0)]
    assert spec.before.nan > 0 and spec.after.nan > 0
    assert back[(c.module, c.module_call)].role == "culprit"
    # the repro: the complex input saved as float32 parts, rebuilt, and the failure reproduces
    meta, tensors = saved_inputs(tmp_path / "report" / "repro" / "inputs.safetensors")
    assert meta["op"] == "aten.pow.Tensor_Scalar" and meta["complex"] == {"args/0": "complex64"}
    parts = tensors["args/0"]
    assert parts.dtype == torch.float32 and parts.shape[-1] == 2
    rebuilt = torch.view_as_complex(parts)
    assert bool(torch.isfinite(rebuilt).all()) and bool((rebuilt == 0).any())
    assert bool(torch.isnan(torch.ops.aten.pow.Tensor_Scalar(rebuilt, meta["args"][1])).any())
    out = r.repro_result.output
    assert r.repro_result.reproduced and "inputs:  complex64[" in out
    assert "REPRODUCED: aten.pow.Tensor_Scalar produces nan from nan-free inputs" in out


def test_a_complex_division_by_zero_in_forward(tmp_path):
    """``S_y / S_x`` is a complex 0 / 0 at the silent frames; the real ``abs`` after it used to
    look born from clean inputs. The spectrograms' complex outputs have statistics now."""
    r = replay(tmp_path, "ratio_at_zero", run_repro=True)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind) == ("culprit", "forward", "nan")
    assert (c.phase, c.module, c.module_call, c.op) == ("forward", "stft_loss", 0,
                                                        "aten.div.Tensor")
    assert c.source.endswith(f"complex_stft.py:{line_of('BUG: 0 / 0 when silent')}")
    assert c.input_dtypes == ["complex64", "complex64"] and c.surfaced is None
    back = {(b.module, b.call): b for b in r.backtrace}
    spec = back[("stft_loss.specs.32", 1)]                      # the target's spectrum
    assert spec.role == "clean" and spec.after.nan == 0 and spec.after.absmax > 1
    assert r.repro_result.reproduced and "inputs:  complex64[2, 9, 13], complex64[" in \
        r.repro_result.output


def test_complex128_inputs_and_the_reference_op_check(tmp_path):
    """Replayed at float64 (the complex STFT is complex128, which safetensors cannot store) with
    a float64 reference: the repro keeps the complex128 input and the op check compares the
    complex output part by part."""
    r = replay(tmp_path, "compressed_at_zero", target="cpu:float64", reference="cpu:float64",
               run_repro=False)
    assert (r.culprit.module, r.culprit.op) == ("stft_loss.compress", "aten.pow.Tensor_Scalar")
    assert r.culprit.input_dtypes == ["complex128"]
    check = r.op_check
    assert check.status == "ok" and len(check.comparisons) == 1
    assert check.comparisons[0].numel == 2 * 17 * 5 * 2           # every real and imaginary part
    script = tmp_path / "report" / "repro" / "repro.py"
    meta, tensors = saved_inputs(script.parent / "inputs.safetensors")
    assert meta["complex"] == {"args/0": "complex128"}
    assert tensors["args/0"].dtype == torch.float64
    res = run_repro(script, "cpu")
    assert res.reproduced and "inputs:  complex128[" in res.output, res.output


def test_the_healthy_loss_stays_clean(tmp_path):
    """``S.abs()`` at a silent frame: torch's backward of a complex abs is safe at 0."""
    assert replay(tmp_path, "healthy", run_repro=False).verdict == "clean"


def test_a_module_repro_with_complex_inputs(tmp_path):
    """The module-call repro saves a complex argument as its parts and makes it a leaf that
    requires grad again: the complex input's gradient is where the NaN shows."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 9, 5, dtype=torch.complex64, generator=g)
    s[:, :, 3:] = 0                                                 # silent frames
    culprit = Culprit("backward", "stft_loss.compress", 0, ["complex64"], [list(s.shape)],
                      None, op="aten.pow.Tensor_Scalar", op_index=0)
    mc = ModuleCaught(CallId("stft_loss.compress", 0), [s], {}, {},
                      {"rng/cpu": torch.get_rng_state()}, grad_out=[torch.zeros(2, 9, 5, 2)])
    script = write_module_repro(tmp_path / "repro", mc, culprit=culprit, kind="nan",
                                target="cpu", entry=f"{TASKS}:compressed_at_zero")
    meta, tensors = saved_inputs(script.parent / "module_inputs.safetensors")
    assert meta["complex"] == {"args/0": "complex64"} and tensors["args/0"].shape == (2, 9, 5, 2)
    res = run_repro(script, "cpu")
    assert res.reproduced, res.output


# ------------------------------------------------------------------------------------------
# the pieces


def _flags(x: torch.Tensor):
    """The recorder's flags of ``x.clone()`` (a recorded op's output; no arithmetic, which on
    complex numbers would make (0 + inf j) * 1 a NaN)."""
    rec = OpRecorder(None, phases={"forward"})
    with rec:
        x.clone()
    table, _ = rec.read()
    return table.ops[0].outputs[0].flags


@pytest.mark.parametrize("values, nan, posinf, neginf, absmax", [
    ([1 + 2j, -3 - 0.5j], False, False, False, 3.0),          # magnitude of the parts
    ([complex(1, NAN), 2j], True, False, False, 2.0),          # a NaN imaginary part: NaN
    ([complex(NAN, INF), 5j], True, False, False, 5.0),        # NaN beside inf: NaN, not inf
    ([complex(0, INF), -4], False, True, False, 4.0),          # an inf part, none NaN: inf
    ([complex(-INF, 1), 0.5j], False, False, True, 1.0),
])
def test_the_recorder_flags_a_complex_value_by_its_parts(values, nan, posinf, neginf, absmax):
    f = _flags(torch.tensor(values, dtype=torch.complex64))
    assert (f.nan, f.posinf, f.neginf) == (nan, posinf, neginf)
    assert f.absmax == pytest.approx(absmax)


def test_counts_and_statistics_of_complex_tensors():
    z = torch.tensor([complex(NAN, INF), complex(0, INF), complex(-INF, 1), 3 - 4j, 1j])
    assert nonfinite(z) == (1, 1, 1)                  # each element counted once
    assert nan_inf_counts([z]) == (1, 2)
    assert surely_finite([z, torch.tensor([1 + 1j])]) == [False, True]
    n, p, m, amax, asum = tensor_stats(z).tolist()
    assert (n, p, m) == (1, 1, 1)
    assert amax == 4.0 and asum == pytest.approx(3 + 4 + 1 + 1)   # the finite parts
    n, p, m, amax, asum = tensor_stats(torch.tensor([3 - 4j, 1j])).tolist()   # the fast path
    assert (n, p, m, amax, asum) == (0, 0, 0, 4.0, 8.0)


def test_casting_keeps_the_imaginary_part():
    z = torch.tensor([1 + 2j])
    assert cast_floating(z, torch.float64).tolist() == [1 + 2j]
    assert cast_floating(z, torch.float64).dtype == torch.complex128


def test_the_op_check_compares_complex_outputs_part_by_part():
    x = torch.tensor([1 + 1j, -2 + 0.5j, 3j])
    right = torch.ops.aten.mul.Tensor(x, x)
    ok = check_op("aten.mul.Tensor", 0, [x, x], {}, [right], torch.device("cpu"))
    assert ok.status == "ok" and ok.comparisons[0].numel == 6
    wrong = right.clone()
    wrong[1] = wrong[1].conj()                        # right real part, wrong imaginary part
    bad = check_op("aten.mul.Tensor", 0, [x, x], {}, [wrong], torch.device("cpu"))
    assert bad.status == "mismatch" and bad.comparisons[0].worst_index == (1, 1)
    assert not compare_step(right, wrong, torch.complex64).ok
    assert math.isclose(compare_step(right, right, torch.complex64).cosine, 1.0)


def test_a_complex128_state_is_refused_by_name_and_nothing_is_written(tmp_path):
    """safetensors stores complex64, not complex128: the capture says which tensor and what to
    do, not ``KeyError: torch.complex128``, and leaves nothing behind."""
    class Phase(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.complex128))

        def forward(self, x):
            return (self.w * x).abs().sum() * float("nan")

    m = Phase()
    task = nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: m(b))
    with pytest.raises(ValueError, match=r"'model/w' is complex128, which a bundle cannot hold"):
        nanbisect.capture(task, torch.ones(3, dtype=torch.complex128), tmp_path / "b",
                          entry=f"{__file__}:_complex128_task")
    assert list(tmp_path.iterdir()) == []


def _complex128_task():      # the entry the capture above names (it is checked, never built)
    raise AssertionError("not built by a capture")
