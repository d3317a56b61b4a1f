"""A small training script guarded by nanbisect; run it, then replay the step that went NaN.

    python examples/train.py    # a NaN at step 7: nanbisect-bundles/step000007
    nanbisect run nanbisect-bundles/step000007   # the op, module and line that made it

The bundle replays through this file: `nanbisect run` imports it and calls `make_task()` (the
entry string below), so the training loop sits under ``if __name__ == "__main__":`` and
importing the file only defines things. CPU only, a second or two.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import nanbisect

# how nanbisect finds make_task again: "path/to/file.py:function" (or "package.module:function");
# an absolute path works from any directory
ENTRY = f"{Path(__file__).resolve()}:make_task"


class Features(nn.Module):
    """sqrt-compressed counts: fine for the non-negative inputs it was written for."""

    def forward(self, x):
        return torch.sqrt(x)                             # (B, 8); NaN where x < 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = Features()
        self.fc = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.head = nn.Linear(16, 1)

    def forward(self, x):                                # x: (B, 8)
        return self.head(self.act(self.fc(self.features(x)))).squeeze(-1)   # (B,)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_task() -> nanbisect.Task:
    """Everything one training step needs, built on CPU (nanbisect moves it where it replays)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return nanbisect.Task(model=model, optimizer=optimizer, loss_fn=loss_fn,
                          clip_grad_norm=1.0)     # optional: what the loop does to gradients


def batches(steps: int = 20, size: int = 16):
    """The data: counts and a target; step 7's batch holds one corrupted (negative) count."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.rand(size, 8, generator=g) * 4         # (B, 8)
        y = x.sum(-1).sqrt()                             # (B,)
        if step == 7:
            x[5, 3] = -1.0                               # the bug in the data pipeline
        yield x, y


def main(out: str | Path = "nanbisect-bundles") -> Path | None:
    """Train; return the bundle of the first non-finite step (None if training stayed finite)."""
    task = make_task()
    guard = nanbisect.Guard(task, entry=ENTRY, out=out)
    try:
        for step, batch in enumerate(batches()):
            loss = guard.step(batch)       # zero_grad, forward, backward, checks, step
            print(f"step {step}: loss {loss:.4f}")
        guard.close()                      # reads the last step's update, drops the snapshot
    except nanbisect.NonFiniteStep as e:
        print(f"step {e.observed['step']}: non-finite {e.observed['first']}; replay it with: "
              f"nanbisect run {e.bundle}")
        return e.bundle
    return None


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
