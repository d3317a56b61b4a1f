"""PyTorch Lightning: `NanbisectCallback` puts `Guard` around every optimizer step.

    trainer = L.Trainer(callbacks=[NanbisectCallback(entry="train.py:task", out="bundles")])

The Task it guards is filled from the Trainer's own settings, so the bundle replays the
Trainer's real step: ``gradient_clip_val`` (norm clipping), ``accumulate_grad_batches`` (each
step's batch is its micro-batches, each loss divided by their number as Lightning does) and
``precision`` (``16-mixed``/``bf16-mixed``: autocast around ``training_step``, and 16-mixed's
GradScaler). The step is read in ``on_before_optimizer_step`` (after Lightning's closure ran
forward and backward, before the update; with 32-bit precision the optimizer's own step pre-hook
fires before the closure, too early), with the loss from ``on_before_backward``; a failing step's
update is left out. On a non-finite step the callback writes the bundle, keeps its path in
``.bundle``, logs it, and asks the trainer to stop (``trainer.should_stop``) instead of raising
from inside a hook; ``on_train_end`` closes the Guard (the last update is read, the snapshot
dropped). The entry must rebuild the same module and optimizer: `task_from_module`
does that for a LightningModule with one optimizer; the step's shape comes from the bundle.
Automatic optimisation only; value clipping (``gradient_clip_algorithm="value"``) is refused.
"""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from nanbisect.errors import NonFiniteStep
from nanbisect.guard import Guard
from nanbisect.guard.core import drop_grads
from nanbisect.integrations import close_step, log
from nanbisect.task import Task


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


_AUTOCAST = {"16-mixed": "float16", "bf16-mixed": "bfloat16"}


class NanbisectCallback(L.Callback):
    def __init__(self, entry: str, out: str | Path = "nanbisect-bundles") -> None:
        self.entry, self.out = entry, Path(out)
        self.guard: Guard | None = None
        self.bundle: Path | None = None
        self._cm = self._w = None
        self._mbs: list = []
        self._total = None

    def on_train_start(self, trainer, pl_module) -> None:
        clip = trainer.gradient_clip_val or None
        algorithm = trainer.gradient_clip_algorithm       # None: Lightning's default, norm
        if clip is not None and algorithm is not None and str(algorithm) not in (
                "norm", "GradClipAlgorithmType.NORM"):
            raise ValueError("NanbisectCallback replays norm clipping only; use "
                             "gradient_clip_algorithm='norm' or guard the step with Guard.watch")
        plugin = trainer.precision_plugin
        task = Task(model=pl_module, optimizer=trainer.optimizers[0], loss_fn=lightning_loss,
                    grad_scaler=getattr(plugin, "scaler", None),
                    clip_grad_norm=float(clip) if clip is not None else None,
                    accumulate=trainer.accumulate_grad_batches,
                    autocast=_AUTOCAST.get(str(trainer.precision)))
        self.guard = Guard(task, entry=self.entry, out=self.out, start_step=trainer.global_step)
        # read in on_before_optimizer_step (see the module doc), every step: no whole-state copy
        # of the first
        self.guard.integrate(reads_update=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._cm is None:
            self._mbs, self._total = [], None
            k = self.guard.task.accumulate
            self._cm = self.guard.watch(batch if k == 1 else self._mbs)
            self._w = self._cm.__enter__()
        self._mbs.append(batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._cm is None:
            return
        # Lightning hands the loss already divided by accumulate_grad_batches, as the step
        # divides it: the sum of these is the step's loss as a replay computes it
        part = loss.detach()
        self._total = part if self._total is None else self._total + part
        self._w.loss = self._total

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._cm is not None and not self.guard.before_update():
            drop_grads(self.guard.task.optimizer)    # the failing update is left out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._cm is None:
            return
        part = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if part is None:      # training_step returned None: Lightning skipped this batch
            self._mbs.pop()
        k = self.guard.task.accumulate
        if (batch_idx + 1) % k and not self._last_of_epoch(trainer, batch_idx):
            return                  # Lightning steps the optimizer after every k-th batch
        if k != 1 and len(self._mbs) != k:
            # an epoch's last, short window: Lightning still divides each loss by k, and so
            # does the step (`micro_batches` takes a shorter list)
            self._w.batch = list(self._mbs)
        self._w.loss = self._total
        cm, self._cm = self._cm, None
        failed = close_step(cm)
        if failed is not None:       # the step failed, even if no bundle could be written
            self.bundle = failed.bundle
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if self.guard is None:
            return
        try:
            self.guard.close()
        except NonFiniteStep as e:     # the last update failed
            log.error("nanbisect: %s", e)
            self.bundle = e.bundle

    @staticmethod
    def _last_of_epoch(trainer, batch_idx: int) -> bool:
        n = trainer.num_training_batches
        return isinstance(n, int) and batch_idx + 1 >= n
