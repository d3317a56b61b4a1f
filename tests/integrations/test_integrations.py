"""Guard inside Lightning and the Hugging Face Trainer; each test runs when its package is
installed (scripts/test.sh installs both)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, TEST_TASKS, cli
from helpers.held import holds_no_copy
from nanbisect.task import import_target

EXAMPLES = ROOT / "examples"

# on one pytest-xdist worker (scripts/test.sh: --dist loadgroup): Lightning and transformers are
# imported by one worker only, once (seconds each), and the captures in the other workers'
# tests never walk their thousands of modules
pytestmark = [pytest.mark.xdist_group("integrations"), pytest.mark.slow]


def test_lightning_callback(tmp_path):
    """examples/lightning_train.py as the README shows it: the callback writes the bundle of the
    corrupted batch's step and stops the Trainer; the replay names the op."""
    pytest.importorskip("lightning")
    example = import_target(str(EXAMPLES / "lightning_train.py"))
    cb = example.main(tmp_path / "b", max_steps=6)
    assert cb.bundle is not None and cb.bundle.name == "step000002"
    assert cb.guard.step_index < 6                       # the callback stopped training
    rep = json.loads(cli("run", "--ckpt", cb.bundle, "--json").stdout)
    assert (rep["culprit"]["op"], rep["culprit"]["module"], rep["culprit"]["phase"]) == (
        "aten.sqrt.default", "act", "forward")


def hf_train(tmp_path, func: str, dataset: str, extra=lambda cb: [], fails: bool = True,
             **settings):
    """Train hf_task's ``func`` task on its ``dataset`` with the HF Trainer and the callback
    (then ``extra(callback)``'s); return the callback."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    import hf_task

    from nanbisect.integrations.hf import NanbisectTrainerCallback

    task = getattr(hf_task, func)()
    cb = NanbisectTrainerCallback(entry=f"{TEST_TASKS / 'hf_task.py'}:{func}", out=tmp_path / "b")
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", learning_rate=1e-3,
                             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             optim="adamw_torch", disable_tqdm=True, **settings)
    Trainer(model=task.model, args=args, train_dataset=getattr(hf_task, dataset)(),
            callbacks=[cb, *extra(cb)], optimizers=(task.optimizer, None)).train()
    assert (cb.bundle is not None) == fails
    return cb


def test_hf_trainer_callback(tmp_path):
    """examples/hf_train.py as the README shows it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = import_target(str(EXAMPLES / "hf_train.py"))
    cb = example.main(tmp_path / "b", max_steps=3)
    assert cb.bundle is not None
    rep = json.loads(cli("run", "--ckpt", cb.bundle, "--json").stdout)
    c = rep["culprit"]
    assert (c["op"], c["module"], c["phase"]) == ("aten.sqrt.default", "transformer.h.0.mlp.act",
                                                  "forward")


def test_lightning_clipping_accumulation_and_precision_replay_the_trainers_step(tmp_path,
                                                                              monkeypatch):
    L = pytest.importorskip("lightning")
    import lit_task

    from nanbisect.integrations.lightning import NanbisectCallback

    cb = NanbisectCallback(entry=f"{TEST_TASKS / 'lit_task.py'}:bag_task", out=tmp_path / "b")
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        gradient_clip_val=0.5, accumulate_grad_batches=2,
                        precision="bf16-mixed")
    trainer.fit(lit_task.LitBag(), torch.utils.data.DataLoader(lit_task.bag_data(),
                                                               batch_size=4))
    assert cb.bundle is not None
    m = json.loads((cb.bundle / "manifest.json").read_text())
    shape = {k: v for k, v in m["task"].items() if k != "parts"}    # (the code's record)
    assert shape == {"accumulate": 2, "clip_grad_norm": 0.5, "grad_scaler": False,
                     "loss_normalized": False, "autocast": "bfloat16", "compiled": None}
    assert set(m["task"]["parts"]) == {"model", "loss_fn", "optimizer"}
    # Adam's NaN is made by the first update and seen at the next reading: rebuilt exactly
    # (the loss compares; Lightning reads the gradient norm before it clips, the Task after)
    assert m["observed"]["rebuild"]["fidelity"] == "bit-exact", m["observed"]
    rep = json.loads(cli("run", cb.bundle, "--json").stdout)
    assert rep["replay"]["bit_exact"] is True, rep["replay"]          # the trainer's loss
    assert (rep["phase"], rep["culprit"]["parameter"]) == ("optimizer", "embed.weight")


def test_hf_clipping_and_accumulation_replay_the_trainers_step(tmp_path):
    cb = hf_train(tmp_path, "task_eps0", "dataset_low_tokens", max_steps=2,
                  gradient_accumulation_steps=2, max_grad_norm=0.5)
    m = json.loads((cb.bundle / "manifest.json").read_text())
    assert (m["task"]["accumulate"], m["task"]["clip_grad_norm"]) == (2, 0.5)
    assert m["observed"]["rebuild"]["fidelity"] == "bit-exact", m["observed"]
    rep = json.loads(cli("run", cb.bundle, "--json").stdout)
    assert rep["replay"]["bit_exact"] is True, rep["replay"]          # the trainer's loss
    # the position embeddings: sequences of 8 leave rows 8..15 without gradient (the token
    # embedding is tied to the LM head, which gives every row one)
    assert (rep["phase"], rep["culprit"]["parameter"]) == ("optimizer",
                                                           "transformer.wpe.weight")


def test_the_callbacks_hold_no_copy_of_the_state(tmp_path):
    """Issue 40: inside Lightning and the HF Trainer the default Guard holds no tensor the size
    of a parameter or a moment (at most 0.10x the state in all), measured mid-training; the
    Guard is closed when training ends (its snapshot dropped)."""
    L = pytest.importorskip("lightning")
    import lit_task

    from nanbisect.integrations.lightning import NanbisectCallback

    seen: list = []
    cb = NanbisectCallback(entry=f"{TEST_TASKS / 'lit_task.py'}:wide_task", out=tmp_path / "l")

    class Measure(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 6:
                seen.append(holds_no_copy(cb.guard))

    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb, Measure()])
    trainer.fit(lit_task.LitWide(), torch.utils.data.DataLoader(lit_task.wide_data(),
                                                                batch_size=8))
    assert cb.bundle is None and len(seen) == 1 and seen[0][0], seen
    assert cb.guard.step_index == 10 and cb.guard._keeper.snap is None     # closed

    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    got: list = []

    class HfMeasure(TrainerCallback):
        def __init__(self, ours):
            self.ours = ours

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                got.append(holds_no_copy(self.ours.guard))

    hf = hf_train(tmp_path, "task_wide", "dataset", extra=lambda cb: [HfMeasure(cb)],
                  fails=False, max_steps=8)
    assert len(got) == 1 and got[0][0], got
    assert hf.guard._keeper.snap is None
