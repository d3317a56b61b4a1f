"""Tasks for the remedies (issue 27): one tiny model each, ``fc -> act -> head``, whose failure a
known change fixes, or does not.

- ``sqrt_rows``: ``act`` is ``sqrt(LIMIT - h^2)``, NaN where |h| is large: a sqrt of a negative
  (a domain error: NaN at any precision). ``batch(bad=5)`` scales row 5 of the inputs far out,
  so only that row's values go bad: the rows trace through the ops to row 5.
- ``half_overflow``: the model in float16; ``act`` is ``exp(h) / exp(h).sum(-1)``: exp overflows
  float16 (65504) for h > 11 and inf / inf is NaN; in float32 the module is finite.
- ``half_cast_overflow``: the same arithmetic in a float32 model whose ``act`` casts to float16
  itself (``h.half()``): the module in float32 helps only when its own cast is kept wide.
- ``fixed_rows``: ``sqrt_rows`` whose forward reshapes its input to exactly 16 rows: the step
  without a row cannot run (a remedy replay the user's code cannot take).
- ``batch_mean``: ``act`` centres by the batch's mean (a reduction over the rows) before the
  sqrt: one far-out row pushes every row's value out of range; the rows cannot be traced (the
  bad values mix all rows) and only bisecting the batch finds the row.
"""
import torch
import torch.nn as nn

import nanbisect

LIMIT = 400.0


class SqrtAct(nn.Module):
    def forward(self, h):
        return torch.sqrt(LIMIT - h * h)          # BUG: NaN where |h| > 20


class ExpNormalize(nn.Module):
    def forward(self, h):
        e = torch.exp(h)                          # overflows float16 for h > 11
        return e / e.sum(-1, keepdim=True)        # inf / inf = NaN


class CastExpNormalize(nn.Module):
    def forward(self, h):
        e = torch.exp(h.half())                   # BUG: a float16 exp overflows for h > 11
        return (e / e.sum(-1, keepdim=True)).float()


class CentredSqrt(nn.Module):
    def forward(self, h):
        c = h - h.mean(0)                         # mixes the batch's rows
        return torch.sqrt(LIMIT - c * c)


class Net(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.fc, self.act, self.head = nn.Linear(8, 16), act, nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.act(self.fc(x))).squeeze(-1)


class FixedRows(Net):
    def forward(self, x):
        return super().forward(x.reshape(16, 8))  # a model that needs 16 rows


def loss_fn(model, batch):
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _task(act: nn.Module, dtype=torch.float32, net=Net) -> nanbisect.Task:
    torch.manual_seed(0)
    model = net(act).to(dtype)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-5),
                          loss_fn=loss_fn)


def sqrt_rows() -> nanbisect.Task:
    return _task(SqrtAct())


def fixed_rows() -> nanbisect.Task:
    return _task(SqrtAct(), net=FixedRows)


def half_overflow() -> nanbisect.Task:
    return _task(ExpNormalize(), torch.float16)


def half_cast_overflow() -> nanbisect.Task:
    return _task(CastExpNormalize())


def batch_mean() -> nanbisect.Task:
    return _task(CentredSqrt())


def batch(bad: int | None = None, rows: int = 16, scale: float = 100.0, seed: int = 0,
          dtype=torch.float32) -> dict:
    """``rows`` samples of 8 features (row ``bad`` times ``scale``), their targets, and an id
    per sample (the batch's own non-tensor field)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    if bad is not None:
        x[bad] *= scale
    return {"x": x.to(dtype), "y": torch.zeros(rows, dtype=dtype),
            "id": [f"sample-{seed}-{i}" for i in range(rows)]}
