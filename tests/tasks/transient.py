"""FlakyOnlyWhileCapturing: NaN only when NANBISECT_TEST_FLAKY=1 is set (as a transient fault)."""
import os

import torch
import torch.nn as nn

import nanbisect


class Flaky(nn.Module):
    def forward(self, x):
        if os.environ.get("NANBISECT_TEST_FLAKY") == "1":
            return x * float("nan")
        return x


def task():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Flaky(), nn.Linear(4, 1))
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def batch():
    return torch.ones(3, 4)
