"""Tasks whose failure starts steps before the NaN, for `Guard(history=..., lookback=...)` and
`nanbisect run --steps K`.

- ``task``: a small MLP regression trained with SGD; ``batches(n, wide_from)`` gives batches of 8
  rows, and of 12 rows from step ``wide_from`` on (a curriculum that changes the shape).
- ``shape_bug`` (for ``--inject`` and for the test's own "faulty device"): a kernel that is wrong
  only for one shape: the ``mm`` that makes ``fc1``'s weight gradient from 12 rows returns the
  gradient times -20. Every step from ``wide_from`` on is slightly off on that device; the
  training ascends instead of descending on ``fc1`` and overflows many steps later.
- ``lr_jump(opt, step)``: the loop's schedule: the learning rate x100 at ``LR_JUMP_AT``, a
  numerics failure (the same on any device) a few steps later.
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import nanbisect

LR = 0.05
LR_JUMP_AT = 30
WIDE_ROWS = 12


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).squeeze(-1)


def mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model, torch.optim.SGD(model.parameters(), lr=LR), mse)


def batch(i: int, rows: int = 8) -> dict:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(rows, 4, generator=g)
    return {"x": x, "y": x.sum(-1)}


def batches(n: int = 200, wide_from: int | None = None):
    for i in range(n):
        yield batch(i, WIDE_ROWS if wide_from is not None and i >= wide_from else 8)


def lr_jump(opt, step: int) -> None:
    """The schedule the loop applies before each step."""
    for g in opt.param_groups:
        g["lr"] = LR * (100.0 if step >= LR_JUMP_AT else 1.0)


class _ShapeBug(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and tuple(out.shape) in ((4, 16), (16, 4)) \
                and WIDE_ROWS in (args[0].shape[1], args[1].shape[0]) \
                and args[0].shape[1] == WIDE_ROWS:
            return out * -20.0      # BUG: a wrong kernel for this one shape
        return out


@contextmanager
def shape_bug():
    with _ShapeBug():
        yield


def adam_task():
    """The same model with Adam (moments a window must carry) for loops with a scheduler."""
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model, torch.optim.Adam(model.parameters(), lr=1e-2), mse)


def train(guard, batches, *, fault=None, schedule=None, between=None):
    """The guarded loop: ``fault`` (a context manager factory) around each step emulates a faulty
    device, ``schedule(opt, step)`` runs before each step, ``between(model)`` after it (what a loop
    may do outside the Task). Returns the NonFiniteStep it ended with, or None."""
    opt = guard.task.optimizer
    for i, b in enumerate(batches):
        if schedule is not None:
            schedule(opt, i)
        try:
            if fault is not None:
                with fault():
                    guard.step(b)
            else:
                guard.step(b)
        except nanbisect.NonFiniteStep as e:
            return e
        if between is not None:
            between(guard.task.model)
    return None
