"""An ordinary script's top level, as independently written training scripts have it (each of
these was refused by the former allow-list gate): constants drawn with a seeded generator, a
thread setting, a numpy learning-rate table under ``np.errstate``, a config read under an ``if``,
a normalisation constant. ``task``'s loss takes the square root of the model's output, NaN for
the batch ``batch()`` gives (its first row's output is negative)."""
import json
import os

import numpy as np
import torch

import nanbisect

D, L, N = 4, 1, 8
W_TRUE = torch.randn(D, L, generator=torch.Generator().manual_seed(3))       # (D, L)
DATA = torch.randn(N, D, generator=torch.Generator().manual_seed(4))         # (N, D)
torch.set_num_threads(2)
with np.errstate(divide="ignore"):
    LR_TABLE = np.log(np.linspace(0, 1, 5))          # -inf first: never used as a rate
MODE = os.environ.get("ORDINARY_MODE", "default")
if MODE == "x":
    with open(os.environ["ORDINARY_CFG"]) as f:
        CFG = json.load(f)
MEAN = torch.tensor([0.5, 0.5, 0.5, 0.5]).view(1, D)                        # (1, D)


def task() -> nanbisect.Task:
    torch.manual_seed(0)
    model = torch.nn.Linear(D, L)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: torch.sqrt(m(b - MEAN)).mean())


def batch() -> torch.Tensor:
    model = task().model
    x = DATA.clone()
    x[0] = MEAN[0] - 100 * torch.sign(model.weight[0].detach())     # output < 0: NaN
    return x
