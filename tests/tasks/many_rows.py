"""Several independent bad rows in one batch (issue 61): the row trace must follow the batch
through the shapes a model gives it, and the samples remedy must name every bad row.

- ``attention``: a small attention LM whose qkv projection is split the standard way
  (``qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)``); its key-padding mask hides every token
  of an empty document, so that row's softmax is over nothing but -inf: 0/0, NaN. ``tokens(
  empty=(2, 7, 11))`` gives 16 documents of which three are empty.
- ``checkpointed``: a block under activation checkpointing that scales each row to unit norm
  (``x / x.norm(-1, keepdim=True)``): a row of zeros gives 0/0. ``features(zero=...)`` gives 16
  rows of which the listed ones are zeros (twelve in the test). ``checkpointed(backward=True)``:
  the block takes ``where(h > 0, sqrt(h), 0)`` of ``|x * scale|`` instead: finite in forward,
  NaN in the backward of each zero row (recomputed under the checkpoint).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import nanbisect

VOCAB, T, C, H = 32, 8, 16, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x, keep):
        B = x.shape[0]
        qkv = self.qkv(x).view(B, T, 3, H, C // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        att = (q @ k.transpose(-2, -1)) / (C // H) ** 0.5
        att = att.masked_fill(~keep[:, None, None, :], float("-inf"))
        att = att.softmax(-1)      # BUG: an empty document masks every key: NaN
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(VOCAB, C), Attention(), nn.Linear(C, VOCAB)

    def forward(self, tokens, keep):
        x = self.emb(tokens)
        return self.head(x + self.attn(x, keep))


def lm_loss(model, batch):
    logits = model(batch["tokens"], batch["keep"])
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["tokens"][:, 1:].reshape(-1))


def attention() -> nanbisect.Task:
    torch.manual_seed(0)
    model = LM()
    return nanbisect.Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=lm_loss)


def tokens(empty=(2, 7, 11), rows: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    keep = torch.ones(rows, T, dtype=torch.bool)
    keep[list(empty)] = False
    return {"tokens": torch.randint(0, VOCAB, (rows, T), generator=g), "keep": keep,
            "doc": [f"doc-{i}" for i in range(rows)]}


class Unit(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x / x.norm(dim=-1, keepdim=True))     # BUG: a zero row is 0/0


class Root(nn.Module):
    """Finite in forward, NaN in backward (recomputed under the checkpoint): the gradient of
    sqrt at 0 is inf, times where's zero: NaN, for each row of zeros."""

    def __init__(self):
        super().__init__()
        self.scale, self.fc = nn.Parameter(torch.ones(8)), nn.Linear(8, 8)

    def forward(self, x):
        h = (x * self.scale).abs()
        return self.fc(torch.where(h > 0, h.sqrt(), 0.0))


class Net(nn.Module):
    def __init__(self, backward: bool = False):
        super().__init__()
        self.unit, self.head = Root() if backward else Unit(), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(checkpoint(self.unit, x, use_reentrant=False)).squeeze(-1)


def checkpointed(backward: bool = False) -> nanbisect.Task:
    torch.manual_seed(0)
    model = Net(backward)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean())


def features(zero=tuple(range(12)), rows: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g)
    x[list(zero)] = 0.0
    return {"x": x, "y": torch.randn(rows, generator=g)}


def checkpointed_backward() -> nanbisect.Task:
    return checkpointed(backward=True)
