"""Hugging Face Trainer: `NanbisectTrainerCallback` puts `Guard` around every optimizer step.

    trainer = Trainer(..., callbacks=[NanbisectTrainerCallback(entry="train.py:task")])

The Task it guards is filled from the Trainer's own settings, so the bundle replays the Trainer's
real step: ``max_grad_norm`` (clipping, on by default in the Trainer),
``gradient_accumulation_steps`` (each step's batch is its micro-batches; a loss the model already
normalises over the whole accumulation with ``num_items_in_batch`` is not divided again),
``fp16``/``bf16`` (autocast, and fp16's GradScaler from the accelerator). The Trainer hands
callbacks no batch, so the callback takes each micro-batch from the model's forward calls (a forward
pre-hook) and its loss from the forward's output, and opens the guard at the first one, before
anything changed; the step is read by the optimizer's step pre-hook, before its update (a failing
update is left out). On a non-finite step it writes the bundle, keeps its path in ``.bundle`` and
sets ``control.should_training_stop``; ``on_train_end`` closes the Guard (the last update read,
the snapshot dropped). The entry must rebuild the same model and optimizer, with
``loss_fn = hf_loss``; the step's shape comes from the bundle.
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from nanbisect.errors import NonFiniteStep
from nanbisect.guard import Guard
from nanbisect.integrations import close_step, log
from nanbisect.step import add_loss
from nanbisect.task import Task


def hf_loss(model, batch: dict):
    """A transformers model's own loss for a batch of keyword inputs."""
    return model(**batch).loss


class NanbisectTrainerCallback(TrainerCallback):
    def __init__(self, entry: str, out: str | Path = "nanbisect-bundles") -> None:
        self.entry, self.out = entry, Path(out)
        self.guard: Guard | None = None
        self.bundle: Path | None = None
        self._cm = self._w = None
        self._hooks: list = []
        self._mbs: list = []
        self._total = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        scaler = getattr(optimizer, "scaler", None)     # accelerate's, with fp16
        # NB: the Trainer hands out accelerate's wrapper; the bundle stores the torch optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        autocast = "float16" if args.fp16 else "bfloat16" if args.bf16 else None
        task = Task(model=model, optimizer=optimizer, loss_fn=hf_loss, grad_scaler=scaler,
                    clip_grad_norm=clip, accumulate=args.gradient_accumulation_steps,
                    autocast=autocast)
        self.guard = Guard(task, entry=self.entry, out=self.out, start_step=state.global_step)
        # accelerate steps the torch optimizer, whose step pre-hook reads every step: no
        # whole-state copy of the first step
        self.guard.integrate()
        self._hooks = [model.register_forward_pre_hook(self._forward_in, with_kwargs=True),
                       model.register_forward_hook(self._forward_out)]

    def _forward_in(self, module, args, kwargs):
        if not module.training:
            return None
        batch = {k: v for k, v in kwargs.items() if v is not None}
        if "num_items_in_batch" in batch:   # the model normalises over the whole accumulation
            self.guard.task.loss_normalized = True
        if self._cm is None:
            self._mbs, self._total = [], None
            # accumulate=1: the batch itself; else the list the micro-batches are added to
            self._cm = self.guard.watch(batch if self.guard.task.accumulate == 1 else self._mbs)
            self._w = self._cm.__enter__()
        self._mbs.append(batch)
        return None

    def _forward_out(self, module, args, output):
        loss = getattr(output, "loss", None)
        if self._cm is not None and module.training and loss is not None:
            _, self._total = add_loss(self.guard.task, self._total, loss)
            self._w.loss = self._total     # read before the update (the step pre-hook)

    def on_step_end(self, args, state, control, **kwargs):
        if self._cm is None:
            return
        cm, self._cm = self._cm, None
        task = self.guard.task
        if task.accumulate != 1:   # an epoch's last step may hold fewer micro-batches
            task.accumulate = len(self._mbs)
            self._w.batch = self._mbs if len(self._mbs) > 1 else self._mbs[0]
        self._w.loss = self._total
        failed = close_step(cm)
        task.accumulate = args.gradient_accumulation_steps
        if failed is not None:       # the step failed, even if no bundle could be written
            self.bundle = failed.bundle
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.guard is not None:
            try:
                self.guard.close()
            except NonFiniteStep as e:     # the last update failed
                log.error("nanbisect: %s", e)
                self.bundle = e.bundle
