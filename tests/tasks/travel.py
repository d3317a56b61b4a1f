"""CrossEntropyAdamEps0: a step that travels badly in its last bits and fails the same everywhere.

Its loss is a label-smoothed cross entropy over 23 classes. Two things make its last bits depend
on the instruction set ATen runs (``torch.backends.cpu.get_cpu_capability()``, which
``ATEN_CPU_CAPABILITY=default`` lowers, as another CPU would):

- ATen's own kernels: the log-softmax uses other ``exp``/``log`` code per instruction set
  (glibc's for ``DEFAULT``, SLEEF's vector code for AVX2 and AVX512), which differs in the last
  bit for some inputs. Which ones, and whether any survive the loss, depends on the CPU: on an
  AVX512 Xeon 26 of the 115 log-probabilities differ and the loss moves; on an AVX2 EPYC the
  loss came out the same bits under ``DEFAULT`` and ``AVX2`` (issue 44).
- So the loss ends in a sum of our own whose association follows the instruction set, as a
  vector kernel's does (`_lanes_sum`): a scalar loop adds left to right, vector lanes add the
  small terms together first. Its terms are chosen so that the two orders always round apart by
  one ulp: the planted hardware difference shows on every CPU.

Its update is NaN on every machine: Adam with ``eps=0`` divides 0 by 0 for ``idle``, a
parameter whose gradient is zero.
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
        loss = -(logp * soft).sum() / len(y) + 0.0 * self.idle.sum()
        return _lanes_sum(loss)


def _lanes_sum(loss: torch.Tensor) -> torch.Tensor:
    """``loss + b + c`` with ``b = c = 0.4 ulp(loss)``, added as this instruction set's kernel
    would: the scalar loop (``DEFAULT``) left to right, ``(loss + b) + c == loss``; vector lanes
    pair the small terms first, ``loss + (b + c) == loss + 1 ulp``. Constants: no gradient."""
    with torch.no_grad():
        small = (torch.nextafter(loss, loss.new_tensor(float("inf"))) - loss) * 0.4
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return (loss + small) + small
    return loss + (small + small)


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
