"""Tasks for the provenance traps, one fault each, built for in-process tests."""
import torch
import torch.nn as nn

import nanbisect


class _NaNGradAtZero(torch.autograd.Function):
    """Identity forward; backward returns NaN wherever the input is exactly 0."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad.masked_fill(x == 0, float("nan"))


class ZeroNaNGrad(nn.Module):
    """Its backward makes NaN only where its input came out of a relu as 0: relu's backward
    (threshold_backward) zeroes exactly those, so this NaN never reaches any gradient."""

    def forward(self, x):
        return _NaNGradAtZero.apply(x)


class _BadLogBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.log1p(x.abs())

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sqrt(x) / (1 + x.abs())     # BUG: sqrt of negative -> NaN


class BadLog(nn.Module):
    def forward(self, x):
        return _BadLogBackward.apply(x)


class ReluMaskedThenReal(nn.Module):
    """real fault in `early.act` (runs late in backward); masked NaN in `late` (runs early)."""

    def __init__(self):
        super().__init__()
        self.early = nn.Sequential(nn.Linear(8, 8), BadLog())
        self.mid = nn.Linear(8, 8)
        self.late = ZeroNaNGrad()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.late(torch.relu(self.mid(self.early(x))))).squeeze(-1)


def relu_masked_then_real():
    torch.manual_seed(0)
    model = ReluMaskedThenReal()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1)).squeeze(-1)


def _adam(**kw):
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0, **kw)
    return nanbisect.Task(model=model, optimizer=opt,
                          loss_fn=lambda m, b: nn.functional.mse_loss(m(b), b.float().mean(1)))


def adam_foreach():
    return _adam(foreach=True)


def adam_fused():
    return _adam(fused=True)


class DropThenSqrt(nn.Module):
    """Random op (dropout) right before the culprit; the culprit is sqrt of a negative."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.sqrt(self.drop(self.fc(x)) - 0.1).sum(-1)


def drop_then_sqrt():
    torch.manual_seed(0)
    model = DropThenSqrt()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).mean())


SCALE = [1.0]   # state outside any op's inputs: set by HiddenScale.forward, read by the op


def _scaling_op(name: str, box: list, differentiable: bool):
    """``torch.ops.nbtrap.<name>(x) = x * box[0]``, defined once per process: the scale is state
    outside the op's inputs. ``differentiable``: its gradient is scaled the same way."""
    try:
        return getattr(torch.ops.nbtrap, name)
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op(f"nbtrap::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * box[0]

    @op.register_fake
    def _(x):
        return torch.empty_like(x)

    if differentiable:
        op.register_autograd(lambda ctx, grad: grad * box[0],
                             setup_context=lambda ctx, inputs, output: None)
    return getattr(torch.ops.nbtrap, name)


SCALED = _scaling_op("scaled", SCALE, differentiable=True)


class HiddenScale(nn.Module):
    """Its op multiplies by a module-level scale this module sets first (inf: a bad config), so
    0 * inf = NaN; the op alone, from its saved inputs, sees the default scale and is fine."""

    def __init__(self):
        super().__init__()
        self.scale = float("inf")

    def forward(self, x):
        SCALE[0] = self.scale
        return SCALED(torch.relu(x))


class HiddenStateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.hidden = HiddenScale()

    def forward(self, x):
        return self.hidden(self.fc(x)).sum(-1)


def hidden_state():
    torch.manual_seed(0)
    model = HiddenStateNet()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).mean())


BSCALE = [1.0]   # the backward twin of SCALE: set in forward, read by an op that runs in backward


GRADSCALED = _scaling_op("gradscaled", BSCALE, differentiable=False)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient with the opaque op above."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return GRADSCALED(grad)


class HiddenGradScale(nn.Module):
    """Sets the gradient scale in forward (NaN: a bad config); the gradient only goes bad in
    backward, inside an op whose saved inputs alone are fine (it reads the scale)."""

    def __init__(self):
        super().__init__()
        self.grad_scale = float("nan")
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        BSCALE[0] = self.grad_scale
        return _ScaleGrad.apply(self.fc(x))


class HiddenGradNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.hidden = HiddenGradScale()

    def forward(self, x):
        return self.hidden(torch.relu(self.inp(x))).sum(-1)


def hidden_grad_state():
    torch.manual_seed(0)
    model = HiddenGradNet()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).mean())
