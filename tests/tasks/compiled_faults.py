"""Models trained under torch.compile, with faults planted the way a compiler bug looks.

- `task` (SoftmaxDecompDropsMax): a custom op ``nbtest::softmax`` whose eager kernel is right (it
  subtracts the row max) and whose decomposition, registered in inductor's decomposition table,
  is not: ``exp(x) / sum(exp(x))``, inf/inf = NaN for scores above ~88. Eager never fails;
  compiled (inductor, or any backend that decomposes) fails on the outlier batch.
- `task_eager_too` (SqrtOfNegativeCompiled): a compiled model whose NaN eager makes too.
- `task_eager_only` (EagerKernelDropsMax): the opposite of `task`: ``nbtest::softmax_eager``'s
  eager kernel drops the max and its decomposition is right; the Task declares its compile
  (``Task(compiled=...)``, the backend that applies inductor's decompositions without C++).
- `task_precision` (RoundedSquare): a precision difference: ``sqrt(x*x - t)`` in bfloat16, where
  ``t`` is ``x*x`` as eager rounds it to bfloat16. Eagerly every element is ``sqrt(0)``; inductor
  keeps ``x*x`` in float32 inside its fused kernel, so where bfloat16 rounded the square up the
  difference is negative and the square root NaN. ``emulate_precision_casts=True`` (inductor
  rounds intermediates as eager does) makes it finite again.
"""
import torch
import torch.nn as nn
from torch._inductor.decomposition import decompositions

import nanbisect


def _define() -> None:
    if hasattr(torch.ops.nbtest, "softmax"):     # imported again under another name
        return
    lib = torch.library.Library("nbtest", "DEF")
    lib.define("softmax(Tensor x) -> Tensor")
    lib.impl("softmax", lambda x: torch.softmax(x, -1), "CompositeExplicitAutograd")
    torch.library.register_fake("nbtest::softmax", lambda x: torch.empty_like(x), lib=lib)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(output)

    def backward(ctx, g):
        y, = ctx.saved_tensors
        return y * (g - (g * y).sum(-1, keepdim=True))

    torch.library.register_autograd("nbtest::softmax", backward, setup_context=setup, lib=lib)

    def no_max(x):   # the planted bug: the max subtraction dropped
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)

    decompositions[torch.ops.nbtest.softmax.default] = no_max

    lib.define("softmax_eager(Tensor x) -> Tensor")    # the opposite: the eager kernel is wrong
    lib.impl("softmax_eager", no_max, "CompositeExplicitAutograd")
    torch.library.register_fake("nbtest::softmax_eager", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_autograd("nbtest::softmax_eager", backward, setup_context=setup,
                                    lib=lib)
    decompositions[torch.ops.nbtest.softmax_eager.default] = lambda x: torch.softmax(x, -1)
    _define.lib = lib   # keep the library alive


_define()


class Scores(nn.Module):
    def forward(self, x):
        return torch.ops.nbtest.softmax(x)       # (B, 8)


class EagerScores(nn.Module):
    def forward(self, x):
        return torch.ops.nbtest.softmax_eager(x)  # (B, 8)


class SqrtBlock(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)                     # NaN for negative x, eager or compiled


class RoundedSquare(nn.Module):
    def forward(self, x, t):                     # x: (B, 8) bfloat16; t: x*x rounded
        return torch.sqrt(x * x - t).float()     # (B, 8); nothing before it needs a gradient


class PrecisionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = RoundedSquare()
        self.head = nn.Linear(8, 1)

    def forward(self, x, t):
        return self.head(self.block(x, t))


class Net(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.block = block
        self.head = nn.Linear(8, 1)

    def forward(self, x):                        # x: (B, 8)
        return self.head(self.block(self.proj(x)))


def _task(block: nn.Module) -> nanbisect.Task:
    torch.manual_seed(0)
    model = Net(block)
    return nanbisect.Task(model=torch.compile(model),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def task() -> nanbisect.Task:
    return _task(Scores())


def task_eager_too() -> nanbisect.Task:
    return _task(SqrtBlock())


def task_eager_only() -> nanbisect.Task:
    torch.manual_seed(0)
    model = Net(EagerScores())
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean(),
                          compiled={"backend": "aot_eager_decomp_partition"})


def task_precision() -> nanbisect.Task:
    torch.manual_seed(0)
    model = PrecisionNet()
    return nanbisect.Task(model=torch.compile(model),
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b["x"], b["t"]).pow(2).mean())


def batch_precision() -> dict:
    """Values whose bfloat16 square rounds up (about half of them do): (4, 8) of each."""
    g = torch.Generator().manual_seed(2)
    x = (torch.rand(4, 8, generator=g) * 3 + 1).to(torch.bfloat16)
    return {"x": x, "t": x * x}                  # eager's rounding of the square


def batch(outlier: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g)           # (B, 8)
    if outlier:
        x[2] *= 400.0                            # scores far above 88 in row 2
    return x
