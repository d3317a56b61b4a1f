"""Buffers that hold inf by design: a causal mask of -inf (``mask``) and an observer's running
minimum that starts at +inf (``low``, as torch.ao's MinMaxObserver keeps it). Healthy training
must never trip the Guard on them, and a real fault (``sqrt`` of negatives, ``faulty=True``) is
bisected to its op, not stopped at "non-finite values before the step"."""
import torch
import torch.nn as nn

import nanbisect


class Masked(nn.Module):
    def __init__(self, faulty: bool = False):
        super().__init__()
        self.faulty = faulty
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
        self.register_buffer("low", torch.tensor(float("inf")))

    def forward(self, x):
        with torch.no_grad():
            self.low.copy_(torch.minimum(self.low, x.min()))
        h = self.fc(x) @ (self.mask.exp() + 1.0)
        return (torch.sqrt(h) if self.faulty else h.abs()).sum(-1)   # BUG (faulty): negatives


def _task(faulty: bool) -> nanbisect.Task:
    torch.manual_seed(0)
    model = Masked(faulty)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def healthy() -> nanbisect.Task:
    return _task(False)


def faulty() -> nanbisect.Task:
    return _task(True)


def batch(step: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
