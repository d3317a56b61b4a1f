"""A block under activation checkpointing whose inner layer takes the square root of its
pre-activation where that is positive (``where(h > 0, sqrt(h), 0)``): finite in forward, NaN in
backward (sqrt's NaN of the negatives times where's zero gradient). The remedies replay the
step with that module in float64, which checkpointing's recomputation in backward refuses (its
saved tensors' metadata differ)."""
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import nanbisect


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0, torch.sqrt(h), 0.0)     # BUG: sqrt of negatives


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block(x)).squeeze(-1)


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def batch():
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
