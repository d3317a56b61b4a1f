"""A task whose traced rows are more than the rows to blame (issue 38, item 7).

``masked_weights``: the loss weighs each row's error by a confidence ``sqrt(LIMIT - mean(x^2))``
computed without gradient, for the rows the batch marks ``valid`` (1 for the others). Rows far
out make that sqrt NaN: ``batch(bad=(2, 3), invalid=(3,))`` makes it NaN in rows 2 and 3, so the
op tracing names both (``culprit.samples == [2, 3]``), but row 3 is not valid and its NaN is
masked away (a ``where``, no gradient through it): only row 2 breaks the step, and the step
without row 2 alone is finite.
"""
import torch
import torch.nn as nn

import nanbisect

LIMIT = 400.0


class Confidence(nn.Module):
    def forward(self, x, valid):
        with torch.no_grad():
            c = torch.sqrt(LIMIT - (x * x).mean(-1))   # BUG: NaN for rows far out
        return torch.where(valid, c, torch.ones_like(c))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.conf = nn.Linear(8, 1), Confidence()

    def forward(self, x):
        return self.fc(x).squeeze(-1)


def loss_fn(model, batch):
    w = model.conf(batch["x"], batch["valid"])
    return (w * (model(batch["x"]) - batch["y"]) ** 2).mean()


def masked_weights() -> nanbisect.Task:
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                          loss_fn=loss_fn)


def batch(bad=(2, 3), invalid=(3,), rows: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g)
    for r in bad:
        x[r] *= 100.0
    valid = torch.ones(rows, dtype=torch.bool)
    valid[list(invalid)] = False
    return {"x": x, "y": torch.zeros(rows), "valid": valid,
            "id": [f"row-{i}" for i in range(rows)]}
