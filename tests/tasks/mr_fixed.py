"""ddp_train.py's `rank1_nan` task with its fault fixed, for ``nanbisect run --entry``: the same
parameters (so the bundle's state loads), but the forward takes sqrt of an absolute value, so rank
1's bad sample no longer makes NaN. Each rank that builds it writes ``MR_MARK_DIR/rank{r}`` (its
pid), so a test can tell which ranks ran this entry."""
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect


class SqrtNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.sqrt((self.fc(x) + x.sum(-1, keepdim=True)).abs())).squeeze(-1)


def rank1_nan_fixed():
    if os.environ.get("MR_MARK_DIR"):
        Path(os.environ["MR_MARK_DIR"], f"rank{dist.get_rank()}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = DDP(SqrtNet())
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())
