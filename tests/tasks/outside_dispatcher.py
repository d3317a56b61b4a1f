"""A module whose work partly bypasses the dispatcher: ``Fused`` computes ``x * 2`` with an aten
op, then a kernel of its own writes into the result's memory directly (here NumPy, a C
extension, on the tensor's buffer: as a pybind, ctypes or Triton kernel launched from Python
would), making NaN where the input was negative. No aten op makes that NaN: the next op that
reads the buffer (``+ 1``) is handed it."""
import numpy as np
import torch
import torch.nn as nn

import nanbisect


def fused_kernel(y: torch.Tensor, x: torch.Tensor) -> None:
    """The 'extension': writes NaN into ``y`` where ``x`` is negative, on its memory."""
    buf = y.detach().numpy()
    buf[x.detach().numpy() < 0] = np.nan


class Fused(nn.Module):
    def forward(self, x):
        y = x * 2
        fused_kernel(y, x)          # BUG: outside the dispatcher
        return y + 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fused = Fused()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.fused(self.fc(x))).squeeze(-1)


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def batch():
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
