"""A tiny regressor whose forward takes the square root of a negative number when the batch's
``poison`` is set: a forward NaN born in ``act`` (tests/base/test_devices.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanbisect


class SqrtAct(nn.Module):
    def forward(self, x, poison: bool):
        return torch.sqrt(x - 10.0) if poison else torch.relu(x)   # (B, 8)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.act = SqrtAct()
        self.out = nn.Linear(8, 1)

    def forward(self, x, poison: bool = False):
        return self.out(self.act(self.fc(x), poison)).squeeze(-1)   # (B,)


def loss_fn(model, batch):
    return F.mse_loss(model(batch["x"], batch["poison"]), batch["y"])


def task() -> nanbisect.Task:
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                          loss_fn=loss_fn)


def batch(i: int, poison: bool = False) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(6, 4, generator=g), "y": torch.randn(6, generator=g),
            "poison": poison}
