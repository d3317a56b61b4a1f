"""compare.py: pure comparisons with a per-dtype table; failures carried as data."""
import math

import torch

from nanbisect.reference.compare import compare_op, compare_step


def test_identical_passes_and_message():
    x = torch.randn(64, 64)
    c = compare_op(x, x, x.double(), torch.float32)
    assert c.ok and c.mismatched == 0 and c.message() == "within tolerance"


def test_three_percent_off_fails_with_worst_element():
    x = torch.randn(64, 64)
    t = x.clone()
    t[5, 7] = x[5, 7] * 1.03 + 1.0
    c = compare_op(t, x, x.double(), torch.float32)
    assert not c.ok and c.mismatched == 1 and c.worst_index == (5, 7)
    assert c.message().startswith("Mismatched elements: 1 / 4096 (0.0244%)")
    assert "at index (5, 7)" in c.message()


def test_rounding_of_the_reference_widens_the_bound():
    x = torch.randn(256, 256, dtype=torch.float64)
    y = x.float() @ x.float()                # one fp32 accumulation order
    z = (x.float().T @ x.float().T).T        # another
    truth = x @ x
    assert compare_op(y, z, truth, torch.float32).ok


def test_bf16_tolerance_is_looser():
    x = torch.randn(1000, dtype=torch.float64)
    t = x.to(torch.bfloat16)
    assert compare_op(t, None, x, torch.bfloat16).ok
    assert not compare_op(t.float(), None, x, torch.float32).ok


def test_new_nan_fails_same_nan_passes():
    e = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64)
    assert compare_op(torch.tensor([1.0, float("nan"), 2.0]), None, e, torch.float32).ok
    c = compare_op(torch.tensor([float("nan"), float("nan"), 2.0]), None, e, torch.float32)
    assert not c.ok and c.nonfinite_new == 1 and c.worst_abs == math.inf


def test_step_level_relative_l2():
    r = torch.randn(100)
    assert compare_step(r * (1 + 1e-5), r, torch.float32).ok
    c = compare_step(r * 1.01, r, torch.float32)
    assert not c.ok and "relative L2 error" in c.message()
    assert not compare_step(torch.tensor(float("nan")), torch.tensor(1.0), torch.float32).ok
