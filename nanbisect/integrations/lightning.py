"""PyTorch Lightning: `NanbisectCallback` puts `Guard` around every training batch.

    trainer = L.Trainer(callbacks=[NanbisectCallback(entry="train.py:task", out="bundles")])

On a non-finite step the callback writes the bundle, keeps its path in ``.bundle``, logs it, and
asks the trainer to stop (``trainer.should_stop``) instead of raising from inside a hook. The
entry must rebuild the same module and optimizer: `task_from_module` does that for a
LightningModule with one optimizer. Automatic optimisation only (one optimizer step per batch).
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from nanbisect.guard import Guard
from nanbisect.task import Task
from nanbisect.integrations import close_step


def lightning_loss(module: L.LightningModule, batch) -> torch.Tensor:
    """The loss a LightningModule's ``training_step`` returns (a tensor or {"loss": ...})."""
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def task_from_module(module: L.LightningModule) -> Task:
    """A Task from a LightningModule and the (first) optimizer of its configure_optimizers()."""
    opt = module.configure_optimizers()
    if isinstance(opt, (list, tuple)):
        opt = opt[0]
    if isinstance(opt, dict):
        opt = opt["optimizer"]
    return Task(model=module, optimizer=opt, loss_fn=lightning_loss)


class NanbisectCallback(L.Callback):
    def __init__(self, entry: str, out: str | Path = "nanbisect-bundles") -> None:
        self.entry, self.out = entry, Path(out)
        self.guard: Guard | None = None
        self.bundle: Path | None = None
        self._cm = self._w = None

    def on_train_start(self, trainer, pl_module) -> None:
        task = Task(model=pl_module, optimizer=trainer.optimizers[0], loss_fn=lightning_loss)
        self.guard = Guard(task, entry=self.entry, out=self.out,
                           start_step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cm = self.guard.watch(batch)
        self._w = self._cm.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._cm is None:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._w.loss = loss
        cm, self._cm = self._cm, None
        bundle = close_step(cm)
        if bundle is not None:
            self.bundle = bundle
            trainer.should_stop = True
