"""The emulated NPU device itself (tests/npu/torch_npu), which the npu tests stand on: its device
module, views, copies, generators, a training step bit-identical to the CPU's, autocast,
streams, serialization, its device-only ops and its build cache.

torch_npu is never imported here (one PrivateUse1 backend per process: tests/helpers/npu.py):
tests/npu/device_checks.py measures everything in one child process per session (`facts`) and
each test asserts its part; the build cache is measured with child processes of its own.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.paths import ROOT
from helpers.run import run_python

pytestmark = pytest.mark.slow

CHECKS = "tests/npu/device_checks.py"


@pytest.fixture(scope="session")
def facts(npu_env) -> dict:
    """What tests/npu/device_checks.py measured (run once per session, in a fresh interpreter
    that imports torch_npu)."""
    r = run_python([CHECKS], env=npu_env, fresh=True)
    assert r.code == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def part(facts: dict, name: str) -> dict:
    """One check's facts; the test fails with the check's own error when it raised."""
    got = facts[name]
    assert "error" not in got, f"{got['error']}\n{got.get('traceback', '')}"
    return got


def test_device_module(facts):
    f = part(facts, "device_module")
    assert f["is_available"] is True and f["device_count"] == 2
    assert (f["current_first"], f["current_after_set_1"]) == (0, 1)
    assert f["empty_after_set_1"] == "npu:1"          # "npu" means the current device
    assert (f["inside_device_ctx_0"], f["after_device_ctx"]) == (0, 1)
    assert f["name"] and f["name"] == f["name_1"]
    assert f["devices"] == ["npu:0", "npu:1"] and f["indices"] == [0, 1]
    assert (f["tensor_npu"], f["tensor_npu_1"]) == ("npu:0", "npu:1")
    assert f["is_npu"] is True and f["cpu_is_npu"] is False
    assert f["npu_values"] == [0.0, 1.0, 2.0]
    for op, (tensor, storage) in f["npu1_storage_devices"].items():   # memory on the tensor's card
        assert tensor == storage == "npu:1", op
    assert f["out_of_range"] is not None and "out of range" in f["out_of_range"]


def test_module_to_keeps_parameters(facts):
    """`Module.to("npu")` moves the parameters' data in place: an optimizer built before the
    move still holds (and steps) the model's parameters."""
    f = part(facts, "device_module")
    assert f["same_parameters"] is True
    assert f["param_devices"] == ["npu:0"]
    assert f["optimizer_stepped"] is True


def test_writes_through_views_land_in_the_base(facts):
    f = part(facts, "views")
    assert f["npu"] == f["cpu"]
    assert any(v for row in f["cpu"] for v in row)           # the writes did something
    assert f["view_shares_storage"] is True and f["view_device"] == "npu:0"


def test_copies_are_exact(facts):
    f = part(facts, "copies")
    assert f["devices"] == ["npu:0", "npu:1", "npu:0"]
    assert f["round_trip_bits_equal"] and f["d2d_bits_equal"]     # NaN and -inf kept too
    assert (f["bf16_dtype"], f["bf16_device"]) == ("torch.bfloat16", "npu:0")
    assert f["bf16_bits_equal_cpu"]
    assert (f["f64_copy_dtype"], f["f64_copy_device"]) == ("torch.float64", "npu:1")
    assert f["f64_copy_equal_cpu"]


def test_pinned_memory_and_non_blocking_copies(facts):
    f = part(facts, "copies")
    assert f["pinned_is_pinned"] is True and f["plain_is_pinned"] is False
    assert f["sliced_pinned_is_pinned"] is True
    assert f["pinned_equal"]
    assert f["non_blocking_device"] == "npu:1"
    assert f["non_blocking_bits_equal"] and f["non_blocking_back_bits_equal"]


def test_npu_manual_seed_repeats_random_ops(facts):
    f = part(facts, "rng")
    assert f["reseed_repeats"] == [True] * len(f["ops"]), f["ops"]
    assert f["next_draw_same"] == [False] * len(f["ops"]), f["ops"]   # the draws are random


def test_npu_draws_leave_the_cpu_generator(facts):
    assert part(facts, "rng")["cpu_state_unchanged"] is True


def test_rng_state_round_trip(facts):
    f = part(facts, "rng")
    assert f["state_dtype"] == "torch.uint8" and f["state_numel"] > 0
    assert f["set_state_repeats"] == [True] * len(f["ops"]), f["ops"]
    assert f["explicit_generator_repeats"] and f["explicit_generator_device"] == "npu:1"


def test_device_generators_are_independent(facts):
    f = part(facts, "rng")
    assert f["npu1_draw_leaves_npu0_draws"] and f["npu1_draw_leaves_npu0_state"]
    assert f["npu0_draw_leaves_npu1_state"]
    assert f["npu1_draw_moves_npu1_state"] and f["npu0_draw_moves_npu0_state"]


def test_torch_manual_seed_seeds_the_device(facts):
    f = part(facts, "rng")
    assert f["torch_manual_seed_reaches_npu"] == [True, True]
    assert f["initial_seed"] == 99


@pytest.mark.parametrize("optimizer", ["adamw_foreach", "adamw_fused", "sgd_momentum"])
def test_training_step_bit_identical_to_cpu(facts, optimizer):
    """Three steps of an MLP (linear, GELU, LayerNorm; MSE; grad clipping) on npu:0 leave every
    parameter bit-identical to the same steps on the CPU."""
    f = part(facts, "training")[optimizer]
    assert "error" not in f, f["error"]
    assert f["moved"] is True                       # the steps changed the parameters
    assert all(f["equal"]), f"max |cpu - npu| = {f['max_abs_diff']}"


def test_autocast_lowers_matmuls_only(facts):
    f = part(facts, "autocast")
    assert f["linear_inside"] == f["matmul_inside"] == "torch.bfloat16"
    assert f["linear_inside_f16"] == "torch.float16"
    assert f["add_inside"] == "torch.float32"
    assert f["linear_outside"] == "torch.float32"
    assert f["device"] == "npu:0"


def test_streams_and_events(facts):
    f = part(facts, "streams")
    assert f["stream_device"] == f["current_device"] == "npu:0"
    assert f["event_query"] is True and f["stream_query"] is True
    assert f["t2"] == [2.0] * 4
    assert f["synchronizations_added"] == {
        "torch.npu.synchronize()": 1, "torch.npu.synchronize(1)": 1,
        "Stream.synchronize()": 1, "torch.accelerator.synchronize()": 1, "no call": 0}


def test_serialization(facts):
    f = part(facts, "serialization")
    assert f["safetensors_devices"] == {"x": "npu:1", "y": "npu:1"}
    assert f["safetensors_equal"] is True
    assert f["torch_load_devices"] == {"x": "npu:0", "y": "npu:1"}
    assert f["torch_load_equal"] is True
    assert f["map_location_cpu_devices"] == {"x": "cpu", "y": "cpu"}


def test_moe_unpermute(facts):
    """Forward: expert_out * probs. Backward: NaN for the expert outputs given float32 probs
    (the planted kernel bug), finite given bfloat16 probs."""
    f = part(facts, "device_ops")
    assert f["unpermute_device"] == "npu:0" and f["unpermute_equal_ref"] is True
    assert f["grad_expert_nan_float32"] is True
    assert f["grad_expert_finite_bfloat16"] is True
    assert f["grad_probs_finite_float32"] and f["grad_probs_finite_bfloat16"]
    assert f["grad_probs_dtype_bfloat16"] == "torch.bfloat16"


def test_device_only_ops_have_no_cpu_kernel(facts):
    f = part(facts, "device_ops")
    for key in ("unpermute_cpu_error", "fast_gelu_cpu_error"):
        assert f[key] is not None and f[key].startswith("NotImplementedError"), f[key]


def test_fast_gelu_rounds_through_bfloat16(facts):
    """npu_fast_gelu(x) is F.gelu of x rounded to bfloat16: beyond fp32's tolerance, within
    bfloat16's (relative to the output's norm: elementwise, where GELU nears zero for negative x,
    the input's rounding is amplified past 2**-7)."""
    f = part(facts, "device_ops")
    assert f["fast_gelu_dtype"] == "torch.float32"
    assert f["fast_gelu_allclose_fp32"] is False
    assert f["fast_gelu_max_abs_diff"] > 1e-5
    assert f["fast_gelu_equals_bf16_rounding"] is True
    assert 1e-5 < f["fast_gelu_norm_rel_diff"] < 2 ** -7


def _mtimes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def test_built_device_is_reused(facts, npu_env):
    """A fresh interpreter's `import torch_npu` loads the cached build: no compile (the loader
    says "cached", and the cache's files are untouched)."""
    cache = Path(facts["cache_dir"])
    assert (cache / "done").is_file()
    before = _mtimes(cache)
    p = subprocess.run([sys.executable, "-c", "import torch_npu; print(torch_npu._build"
                        ".directory(), torch_npu._build.LOADED[0])"], env=npu_env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [str(cache), "cached"]
    assert _mtimes(cache) == before


def test_build_cache_named_by_torch_version(facts):
    assert facts["torch_version"] == torch.__version__
    assert Path(facts["cache_dir"]).name.startswith(f"torch{torch.__version__}-")


def test_no_compiler_fails_with_one_line(npu_env, tmp_path):
    """An empty cache and no compiler: `import torch_npu` fails with NoCompiler, before any build
    step (nothing written to the cache); its message is the traceback's last line, which
    tests/helpers/npu.py turns into the skip reason."""
    env = {**npu_env, "PATH": "/nonexistent", "CXX": "/nonexistent/c++",
           "NANBISECT_NPU_CACHE": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", "import torch_npu"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_npu._build.NoCompiler: "), p.stderr[-2000:]
    assert "C++ compiler" in last
    assert "cpp_extension" not in p.stderr and "ninja" not in p.stderr.lower()
    assert list(tmp_path.iterdir()) == []
