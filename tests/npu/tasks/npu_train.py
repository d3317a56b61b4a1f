"""Training scripts on the emulated NPU (``import torch_npu``: tests/npu), as an NPU user writes
them, each guarded by nanbisect:

- ``moe``: a small MoE model on ``npu:0`` whose experts are combined by the device-only fused
  ``torch_npu.npu_moe_unpermute``; the router's ``probs`` arrive in float32, and the kernel's
  backward returns NaN for them (it supports bfloat16 only): the first step's gradients are NaN.
- ``gelu``: an MLP on ``npu:0`` with ``torch_npu.npu_fast_gelu``, which rounds through bfloat16 on
  the device: every step parts slightly from the CPU's, silently. A batch of outliers at
  ``SPIKE_AT`` makes the loss spike; the Guard (``lookback``, ``spike``) bundles that step.

Both register reference implementations of the device-only ops for a CPU reference, as a user
of such ops does (``nanbisect.reference_impl``).

    python tests/npu/tasks/npu_train.py moe|gelu OUT    # prints "BUNDLE <path>"
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_npu

import nanbisect

DEVICE = "npu:0"
DIM, EXPERTS = 16, 4
SPIKE_AT = 24


@nanbisect.reference_impl("npu::npu_moe_unpermute")
def unpermute(expert_out, probs):
    return expert_out * probs.to(expert_out.dtype)[:, None]


@nanbisect.reference_impl("npu::npu_moe_unpermute_backward")
def unpermute_backward(grad, expert_out, probs):
    return grad * probs.to(grad.dtype)[:, None], (grad * expert_out).sum(-1).to(probs.dtype)


@nanbisect.reference_impl("npu::npu_fast_gelu")
def fast_gelu(x):
    return F.gelu(x)


@nanbisect.reference_impl("npu::npu_fast_gelu_backward")
def fast_gelu_backward(grad, x):
    return torch.ops.aten.gelu_backward(grad, x)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM ** 0.5)

    def forward(self, x, choice, probs):
        out = torch.einsum("nd,nde->ne", x, self.w[choice])     # each token's expert
        return torch_npu.npu_moe_unpermute(out, probs)          # probs: float32


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = Experts()

    def forward(self, x):
        probs, choice = self.router(x).softmax(-1).max(-1)
        return self.experts(x, choice, probs)


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.head(h + self.moe(h)).squeeze(-1)


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(torch_npu.npu_fast_gelu(self.fc1(x))).squeeze(-1)


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def moe() -> nanbisect.Task:
    torch.manual_seed(0)
    model = MoEModel().to(DEVICE)
    return nanbisect.Task(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mse)


def gelu() -> nanbisect.Task:
    torch.manual_seed(0)
    model = GeluMLP().to(DEVICE)
    return nanbisect.Task(model, torch.optim.SGD(model.parameters(), lr=0.05), mse)


def batch(i: int, dim: int) -> tuple:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, dim, generator=g)
    y = x.sum(-1) * (25.0 if i == SPIKE_AT else 1.0)        # a batch of outliers
    return x.to(DEVICE), y.to(DEVICE)


def main(which: str, out: str) -> None:
    task = {"moe": moe, "gelu": gelu}[which]()
    dim = DIM if which == "moe" else 8
    guard = nanbisect.Guard(task, entry=f"{__file__}:{which}", out=out,
                            **({"lookback": 8, "spike": 6.0} if which == "gelu" else {}))
    try:
        for i in range(SPIKE_AT + 2):
            guard.step(batch(i, dim))
    except nanbisect.NonFiniteStep as e:
        print("BUNDLE", e.bundle)
        return
    for b in guard.spikes:
        print("BUNDLE", b)


if __name__ == "__main__":
    main(*sys.argv[1:3])
