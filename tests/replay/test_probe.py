"""The module probe's per-tensor statistics: the CPU fast path agrees with exact counting."""
import torch

from nanbisect.replay.probe import tensor_stats

INF, NAN = float("inf"), float("nan")


def exact(t: torch.Tensor) -> list[float]:
    fin = t[torch.isfinite(t)].abs().float()
    return [float(torch.isnan(t).sum()), float((t == INF).sum()), float((t == -INF).sum()),
            float(fin.max()) if fin.numel() else 0.0, float(fin.sum())]


def test_stats_match_exact_counting_on_finite_and_non_finite_tensors():
    g = torch.Generator().manual_seed(0)
    finite = torch.randn(64, 33, generator=g)
    mixed = finite.clone()
    mixed[0, :3] = NAN
    mixed[5, 7] = INF
    mixed[9, :2] = -INF
    only_neginf = torch.tensor([-INF, 1.0, -2.0])    # an attention mask row
    for t in (finite, mixed, only_neginf, finite.to(torch.bfloat16), mixed.to(torch.float16)):
        got = tensor_stats(t).tolist()
        want = exact(t)
        assert got[:3] == want[:3], (t.dtype, got, want)
        assert abs(got[3] - want[3]) <= 1e-6 * max(1.0, want[3])
        assert abs(got[4] - want[4]) <= 1e-4 * max(1.0, want[4])


def test_a_sum_that_overflows_on_finite_values_counts_no_nan_or_inf():
    t = torch.full((4,), 3e38)
    n, pinf, ninf, amax, _ = tensor_stats(t).tolist()
    assert (n, pinf, ninf) == (0, 0, 0)
    assert abs(amax - 3e38) < 1e32


def test_empty_tensor():
    assert tensor_stats(torch.empty(0)).tolist() == [0.0] * 5
