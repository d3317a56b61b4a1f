"""Culprits in the model's own forward (the root module: "" in JSON, ``<root>`` in text) and in
the loss function outside any module call (``loss_fn``): ``forward_root`` takes a sqrt of
negatives in the model's forward, ``backward_root`` the same behind a ``where`` (NaN in
backward, born in forward), ``in_loss`` in the loss function."""
import torch
import torch.nn as nn

import nanbisect


class Forward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt(self.fc(x)).sum(-1)       # BUG: in the root module's own forward


class Behind(Forward):
    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0, torch.sqrt(h), 0.0).sum(-1)


def _task(cls, loss=lambda m, b: m(b).mean()) -> nanbisect.Task:
    torch.manual_seed(0)
    model = cls()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=loss)


def forward_root():
    return _task(Forward)


def backward_root():
    return _task(Behind)


def in_loss():
    return _task(lambda: nn.Linear(4, 4), lambda m, b: torch.sqrt(m(b)).mean())


def batch():
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
