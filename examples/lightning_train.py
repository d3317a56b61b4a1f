"""PyTorch Lightning: `NanbisectCallback` guards every optimizer step of the Trainer.

    python examples/lightning_train.py    # a NaN at step 2: nanbisect-bundles/step000002
    nanbisect run nanbisect-bundles/step000002

The callback fills the Task from the Trainer's own settings (gradient clipping, accumulation,
precision), writes the bundle on a non-finite step and asks the Trainer to stop. The entry
(`make_task`) rebuilds the same LightningModule and its optimizer: `task_from_module` does it.
Needs ``pip install lightning``. CPU only, seconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn

from nanbisect.integrations.lightning import NanbisectCallback, task_from_module

ENTRY = f"{Path(__file__).resolve()}:make_task"


class SqrtAct(nn.Module):
    def forward(self, x):
        return torch.sqrt(x + 3.0)                       # NaN below -3


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.act = SqrtAct()
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch                                     # (B, 4), (B,)
        return nn.functional.mse_loss(self.head(self.act(self.fc(x))).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    xs = torch.rand(16, 4, generator=g)                  # (N, 4)
    xs[4:6] = -40.0                                      # the third batch of 2 is corrupted
    return torch.utils.data.TensorDataset(xs, xs.sum(-1))


def make_task():
    return task_from_module(Regressor())


def main(out: str | Path = "nanbisect-bundles", max_steps: int = 6) -> NanbisectCallback:
    """Train; the callback's ``.bundle`` is the bundle of the first non-finite step, or None."""
    callback = NanbisectCallback(entry=ENTRY, out=out)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data(), batch_size=2))
    if callback.bundle is not None:
        print(f"replay it with: nanbisect run {callback.bundle}")
    return callback


if __name__ == "__main__":
    sys.exit(1 if main().bundle else 0)
