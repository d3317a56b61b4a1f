"""Hugging Face Trainer: `NanbisectTrainerCallback` puts `Guard` around every optimizer step.

    trainer = Trainer(..., callbacks=[NanbisectTrainerCallback(entry="train.py:task")])

The Trainer hands callbacks no batch, so the callback takes it from the model's first forward
call of each step (a forward pre-hook), and opens the guard there, before anything changed. On a
non-finite step it writes the bundle, keeps its path in ``.bundle`` and sets
``control.should_training_stop``. The entry must rebuild the same model and optimizer, with
``loss_fn = hf_loss``. Needs ``gradient_accumulation_steps == 1`` (one batch per step).
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from nanbisect.guard import Guard
from nanbisect.task import Task
from nanbisect.integrations import close_step


def hf_loss(model, batch: dict):
    """A transformers model's own loss for a batch of keyword inputs."""
    return model(**batch).loss


class NanbisectTrainerCallback(TrainerCallback):
    def __init__(self, entry: str, out: str | Path = "nanbisect-bundles") -> None:
        self.entry, self.out = entry, Path(out)
        self.guard: Guard | None = None
        self.bundle: Path | None = None
        self._cm = self._w = self._hook = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.gradient_accumulation_steps != 1:
            raise ValueError("NanbisectTrainerCallback needs gradient_accumulation_steps=1; set "
                             "it, or guard the step yourself with Guard.watch")
        # NB: the Trainer hands out accelerate's wrapper; the bundle stores the torch optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self.guard = Guard(Task(model=model, optimizer=optimizer, loss_fn=hf_loss),
                           entry=self.entry, out=self.out, start_step=state.global_step)
        self._hook = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def _first_forward(self, module, args, kwargs):
        if self._cm is None and module.training:
            batch = {k: v for k, v in kwargs.items() if v is not None}
            self._cm = self.guard.watch(batch)
            self._w = self._cm.__enter__()
        return None

    def on_step_end(self, args, state, control, **kwargs):
        if self._cm is None:
            return
        cm, self._cm = self._cm, None
        bundle = close_step(cm)
        if bundle is not None:
            self.bundle = bundle
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
