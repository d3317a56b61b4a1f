"""Guard inside Lightning and the Hugging Face Trainer; each test runs when its package is
installed (scripts/test.sh installs both)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TEST_TASKS, cli


def test_lightning_callback(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning")
    monkeypatch.syspath_prepend(str(TEST_TASKS))
    import lit_task

    from nanbisect.integrations.lightning import NanbisectCallback

    cb = NanbisectCallback(entry=f"{TEST_TASKS / 'lit_task.py'}:task", out=tmp_path / "b")
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(lit_task.Lit(), torch.utils.data.DataLoader(lit_task.data(), batch_size=2))
    assert cb.bundle is not None and cb.bundle.name == "step000002"
    assert trainer.global_step < 6                       # the callback stopped training
    rep = json.loads(cli("run", "--ckpt", cb.bundle, "--json").stdout)
    assert (rep["culprit"]["op"], rep["culprit"]["module"], rep["culprit"]["phase"]) == (
        "aten.sqrt.default", "act", "forward")


def test_hf_trainer_callback(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    monkeypatch.syspath_prepend(str(TEST_TASKS))
    import hf_task

    from nanbisect.integrations.hf import NanbisectTrainerCallback

    task = hf_task.task()
    cb = NanbisectTrainerCallback(entry=f"{TEST_TASKS / 'hf_task.py'}:task", out=tmp_path / "b")
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=3,
                             per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", learning_rate=1e-3,
                             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             optim="adamw_torch", disable_tqdm=True)
    trainer = Trainer(model=task.model, args=args, train_dataset=hf_task.dataset(),
                      callbacks=[cb], optimizers=(task.optimizer, None))
    trainer.train()
    assert cb.bundle is not None
    rep = json.loads(cli("run", "--ckpt", cb.bundle, "--json").stdout)
    c = rep["culprit"]
    assert (c["op"], c["module"], c["phase"]) == ("aten.sqrt.default", "transformer.h.0.mlp.act",
                                                  "forward")
