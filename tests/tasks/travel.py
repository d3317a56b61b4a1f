"""CrossEntropyAdamEps0: a step that travels badly in its last bits and fails the same everywhere.

Its loss is a label-smoothed cross entropy over 23 classes. ATen's CPU kernels compute the
log-softmax with other ``exp``/``log`` code per instruction set (glibc's for ``DEFAULT``, SLEEF's
vector code for AVX2 and AVX512), which differs in the last bit for some inputs: some of the 115
log-probabilities differ (26 on an AVX512 Xeon), but which ones depends on the CPU, and a float32
mean of five picked ones can round them away (on that Xeon it did). So the loss weighs every
log-probability and adds them in float64, where a float32 value's last bit survives the sum:
``ATEN_CPU_CAPABILITY=default`` changes the loss in its last bits, as another CPU would. Its
update is NaN on every machine: Adam with ``eps=0`` divides 0 by 0 for ``idle``, a parameter whose
gradient is zero.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanbisect


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(37, 23)
        self.idle = nn.Parameter(torch.zeros(5))     # its gradient is 0: Adam(eps=0) -> 0/0

    def forward(self, x, y):                         # x: (5, 37) float32, y: (5,) int64
        logp = F.log_softmax(self.fc(x), 1).double()                 # exact in float64
        soft = F.one_hot(y, 23).double() * 0.9 + 0.1 / 23             # label smoothing 0.1
        return -(logp * soft).sum() / len(y) + 0.0 * self.idle.sum()


def _wave(n: int, k: float) -> torch.Tensor:
    """n numbers in [-2, 2], the same under every instruction set (randn's are not: it has
    vector kernels of its own)."""
    return (torch.sin(torch.arange(n, dtype=torch.float64) * 0.7311 * k) * 2).float()


def task():
    m = Net()
    with torch.no_grad():
        m.fc.weight.copy_(_wave(23 * 37, 1.3).reshape(23, 37) * 0.3)
        m.fc.bias.copy_(_wave(23, 0.9) * 0.1)
    return nanbisect.Task(m, torch.optim.Adam(m.parameters(), lr=1e-2, eps=0.0),
                          lambda m, b: m(*b))


def batch():
    return _wave(5 * 37, 1.0).reshape(5, 37), torch.arange(5)       # (5, 37), (5,)
