"""Hugging Face Trainer: `NanbisectTrainerCallback` guards every optimizer step.

    python examples/hf_train.py    # a NaN at step 0: nanbisect-bundles/step000000
    nanbisect run nanbisect-bundles/step000000

A tiny GPT-2 built from a config (nothing is downloaded) whose MLP activation was swapped for a
sqrt. The callback fills the Task from the TrainingArguments (``max_grad_norm``,
``gradient_accumulation_steps``, ``fp16``/``bf16``); the entry's ``loss_fn`` is `hf_loss`
(the model's own loss). Needs ``pip install transformers accelerate``. CPU only, seconds.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import nanbisect
from nanbisect.integrations.hf import NanbisectTrainerCallback, hf_loss

ENTRY = f"{Path(__file__).resolve()}:make_task"


class SqrtAct(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)                             # NaN for any negative pre-activation


def make_task() -> nanbisect.Task:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    model.transformer.h[0].mlp.act = SqrtAct()
    return nanbisect.Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=hf_loss)


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 8), generator=g)      # (N, T) token ids
    return [{"input_ids": r, "labels": r} for r in ids]


def main(out: str | Path = "nanbisect-bundles", max_steps: int = 3) -> NanbisectTrainerCallback:
    """Train; the callback's ``.bundle`` is the bundle of the first non-finite step, or None."""
    task = make_task()
    callback = NanbisectTrainerCallback(entry=ENTRY, out=out)
    with tempfile.TemporaryDirectory() as trainer_dir:   # the Trainer's own output (none kept)
        args = TrainingArguments(output_dir=trainer_dir, per_device_train_batch_size=2,
                                 max_steps=max_steps, learning_rate=1e-3,
                                 lr_scheduler_type="constant", weight_decay=0.0,
                                 optim="adamw_torch", use_cpu=True, save_strategy="no",
                                 logging_strategy="no", report_to=[], disable_tqdm=True)
        Trainer(model=task.model, args=args, train_dataset=dataset(), callbacks=[callback],
                optimizers=(task.optimizer, None)).train()
    if callback.bundle is not None:
        print(f"replay it with: nanbisect run {callback.bundle}")
    return callback


if __name__ == "__main__":
    sys.exit(1 if main().bundle else 0)
