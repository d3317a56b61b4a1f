"""Tasks whose failure is born in forward, hidden there, and surfaces in backward (issue 24), and
the legitimate non-finite values that must stay clean. One tiny model each: ``fc -> act ->
head``, with ``act`` holding the fault; ``batch()`` gives inputs where the fault bites.

- ``where_sqrt``, ``where_log``, ``where_div``: ``torch.where(mask, f(x), 0)`` with ``f`` bad
  exactly where the mask drops it (sqrt of a negative: NaN; log of 0: -inf; 1/0: inf); forward
  is finite, backward multiplies the zero gradient by ``f``'s derivative there: NaN.
- ``saved_nan``: a custom autograd.Function that saves a NaN in forward (its output is finite)
  and multiplies the gradient by it in backward.
- ``layer_norm_fp16``: layer norm in float16 with eps 1e-12 on a constant row: the variance is 0,
  the saved inverse standard deviation (a secondary output of native_layer_norm) is inf, the
  normalised output is finite; its backward makes NaN.
- ``fused_secondary``: a custom op with two outputs, the second (a row statistic kept for
  backward) NaN where a row is all zeros, the first finite; its backward reads the second.
- ``masked_attention``: causal attention filled with -inf (legitimate), then the where/sqrt
  fault after it; ``masked_attention_healthy``: the same without the fault.
- ``norm_at_zero``: the norm of rows that are exactly zero (torch's backward divides 0/0 and
  masks it away), healthy otherwise; ``norm_at_zero_then_fault``: the same, then where/sqrt.
- ``backward_born``: a custom Function whose backward makes NaN from finite values (born in
  backward: no forward op to blame, no extra pass).
- ``where_sqrt_accumulated``: where/sqrt with two micro-batches, only the second one bad.
"""
import torch
import torch.nn as nn

import nanbisect


class WhereSqrt(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, torch.sqrt(x), 0.0)     # BUG: sqrt of negatives, masked


class WhereLog(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, torch.log(x.abs()), 0.0)    # BUG: log(0) = -inf, masked


class WhereDiv(nn.Module):
    def forward(self, x):
        return torch.where(x != 0, torch.ones_like(x) / x, 0.0)   # BUG: 1/0 = inf, masked


class _SaveNaN(torch.autograd.Function):
    """Identity forward that keeps ``sqrt(x)`` (NaN where x < 0) for its backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.sqrt(x))              # BUG: NaN saved for backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return grad * (1 + 0 * r)                         # 0 * NaN = NaN


class SavedNaN(nn.Module):
    def forward(self, x):
        return _SaveNaN.apply(x)


def _fused_op():
    """``nbsurf::row_scale(x) -> (x * s, s)``, ``s = 1 / sqrt(mean(x**2))`` per row: NaN on an
    all-zero row (a kernel's "undefined"), where the first output is 0. Defined once per
    process."""
    try:
        return torch.ops.nbsurf.row_scale
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("nbsurf::row_scale", mutates_args=())
    def row_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ms = x.pow(2).mean(-1, keepdim=True)
        s = torch.where(ms > 0, torch.rsqrt(ms), float("nan"))   # BUG: NaN statistic on 0 rows
        return torch.nan_to_num(x * s, nan=0.0), s

    @row_scale.register_fake
    def _(x):
        return torch.empty_like(x), x.new_empty(x.shape[:-1] + (1,))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output[1])

    def backward(ctx, grad, grad_s):
        (s,) = ctx.saved_tensors
        return grad * s                                   # reads the NaN statistic

    row_scale.register_autograd(backward, setup_context=setup)
    return torch.ops.nbsurf.row_scale


ROW_SCALE = _fused_op()     # registered at import: the repro imports this file to have it


class FusedSecondary(nn.Module):
    def forward(self, x):
        y, _ = ROW_SCALE(x * (x[..., :1] < 100))          # rows of x with x[0] >= 100: zeros
        return y


class _BackwardNaN(torch.autograd.Function):
    """Identity forward; backward divides by relu(x): inf * 0 = NaN where x <= 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x.clamp(min=0) * (x > 0)            # BUG: born in backward


class BackwardBorn(nn.Module):
    def forward(self, x):
        return _BackwardNaN.apply(x)


class Attention(nn.Module):
    """One head of causal self-attention: scores filled with -inf above the diagonal."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):                                 # (B, T, C)
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2)                  # (B, T, T)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))  # legitimate -inf
        return torch.softmax(scores, -1) @ v


class RowNorm(nn.Module):
    """Adds the norm of rows that are exactly zero: torch's norm backward makes 0/0 there and
    masks it (``masked_fill_``), so the gradients stay finite."""

    def forward(self, x):
        zero = x * (x[..., :1] > 1e9)                     # all-zero rows
        return x + zero.norm(dim=-1, keepdim=True)


class Net(nn.Module):
    def __init__(self, act: nn.Module, pre: nn.Module | None = None, dim: int = 8):
        super().__init__()
        self.pre = pre if pre is not None else nn.Identity()
        self.fc = nn.Linear(dim, dim)
        self.act = act
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        return self.head(self.act(self.fc(self.pre(x)))).squeeze(-1)


class HalfLayerNorm(nn.Module):
    """Layer norm (no affine) computed in float16, with BERT's eps 1e-12."""

    def forward(self, x):
        x = x * (x[..., :1] < 100) + (x[..., :1] >= 100).float()   # constant rows of 1.0
        # BUG: on a constant row rstd = 1/sqrt(0 + 1e-12) = 1e6 overflows float16 (saved: inf)
        return nn.functional.layer_norm(x.half(), x.shape[-1:], eps=1e-12).float()


def _task(model: nn.Module) -> nanbisect.Task:
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def _init(model: nn.Module) -> nn.Module:
    """Weights that make ``fc`` an identity with a large first input on the marked rows."""
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(model.fc.weight.shape[0]))
        model.fc.bias.zero_()
    return model


def batch(n: int = 6, dim: int = 8, seed: int = 0) -> torch.Tensor:
    """Random rows (negatives and zeros included); rows 1 and 4 marked (first entry 1000)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    x[:, 2] = 0.0                                         # exact zeros for log and 1/x
    x[1, 0] = x[4, 0] = 1000.0
    return x


def seq_batch(n: int = 2, t: int = 5, dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, t, dim, generator=g)
    x[..., 2] = -1.0
    return x


def where_sqrt():
    torch.manual_seed(0)
    return _task(_init(Net(WhereSqrt())))


def where_log():
    torch.manual_seed(0)
    return _task(_init(Net(WhereLog())))


def where_div():
    torch.manual_seed(0)
    return _task(_init(Net(WhereDiv())))


def saved_nan():
    torch.manual_seed(0)
    return _task(_init(Net(SavedNaN())))


def fused_secondary():
    torch.manual_seed(0)
    return _task(_init(Net(FusedSecondary())))


def layer_norm_fp16():
    torch.manual_seed(0)
    return _task(_init(Net(HalfLayerNorm())))


def masked_attention():
    torch.manual_seed(0)
    return _task(_init(Net(WhereSqrt(), pre=Attention())))


def masked_attention_healthy():
    torch.manual_seed(0)
    return _task(_init(Net(nn.Tanh(), pre=Attention())))


def norm_at_zero():
    torch.manual_seed(0)
    return _task(_init(Net(nn.Tanh(), pre=RowNorm())))


def norm_at_zero_then_fault():
    torch.manual_seed(0)
    return _task(_init(Net(WhereSqrt(), pre=RowNorm())))


def backward_born():
    torch.manual_seed(0)
    return _task(_init(Net(BackwardBorn())))


def where_sqrt_accumulated():
    torch.manual_seed(0)
    task = _task(_init(Net(WhereSqrt())))
    task.accumulate = 2
    return task


def accumulated_batch() -> list[torch.Tensor]:
    """Two micro-batches: the first all positive (sqrt is fine), the second with negatives."""
    return [batch().abs() + 0.1, batch()]
