"""A Task whose batches are the user's own type (a dataclass): a bundle cannot store one. Its loss
is NaN at once (sqrt of a negative number)."""
import dataclasses

import torch

from nanbisect import Task


@dataclasses.dataclass
class Rows:
    x: torch.Tensor       # (B, 4)


def task() -> Task:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    return Task(m, torch.optim.SGD(m.parameters(), lr=0.1),
                lambda model, b: torch.sqrt(model(b.x) - 100).mean())
