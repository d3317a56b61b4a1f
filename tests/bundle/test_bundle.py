"""Bundle format and state encoding: model/optimizer/batch/RNG round trips, files, atomicity, errors

Everything runs on CPU with tiny models; bundles are written under pytest's ``tmp_path``.
"""
from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanbisect import BadInput, Task, capture
from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.state import RngState, decode, encode, restore_model, restore_optimizer
from helpers.tiedlm import (DIM, ENTRY, VOCAB, assert_opt_state_equal, assert_same_tree,
                            assert_tensor_identical, lm_loss, make_batch, make_model, make_opt,
                            train, trained_task)


@pytest.fixture
def trained():
    """A tied model trained two steps with Adam (`helpers.tiedlm.trained_task`)."""
    return trained_task()


# --------------------------------------------------------------------------------------------
# model


def test_tied_model_round_trip(tmp_path, trained):
    saved = {k: v.detach().clone() for k, v in trained.model.state_dict(keep_vars=False).items()}
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY, step=2)

    # stored once: one tensor per distinct parameter/buffer, the tied weight under a single name
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    distinct = len(list(trained.model.parameters())) + len(list(trained.model.buffers()))
    assert len(keys) == distinct == 7
    assert ("model/embed.weight" in keys) != ("model/head.weight" in keys)

    fresh = make_model(1)
    assert not torch.equal(fresh.embed.weight, saved["embed.weight"])  # really different init
    assert not torch.equal(fresh.norm.running_mean, saved["norm.running_mean"])
    b = read_bundle(path)
    restore_model(fresh, b.manifest["model"], b.tensors("model"), "test")

    got = fresh.state_dict()
    assert got.keys() == saved.keys()
    for k in saved:
        assert_tensor_identical(got[k], saved[k], k)
    assert fresh.norm.num_batches_tracked.dtype == torch.int64
    assert int(fresh.norm.num_batches_tracked) == 2
    assert fresh.head.weight is fresh.embed.weight
    # the tie is live: an update through one name is seen through the other
    with torch.no_grad():
        fresh.embed.weight[0, 0] = 123.0
    assert fresh.head.weight[0, 0].item() == 123.0


def test_restore_model_rejects_other_architecture(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    b = read_bundle(path)
    other = nn.Sequential(nn.Linear(DIM, VOCAB))
    with pytest.raises(BadInput, match="does not match the bundle"):
        restore_model(other, b.manifest["model"], b.tensors("model"), "test")

    wider = make_model(0)
    wider.head.bias = nn.Parameter(torch.zeros(VOCAB + 1))
    with pytest.raises(BadInput, match="shape"):
        restore_model(wider, b.manifest["model"], b.tensors("model"), "test")


# --------------------------------------------------------------------------------------------
# optimizer


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_optimizer_round_trip(tmp_path, kind):
    model = make_model(0)
    opt = make_opt(kind, model.parameters())
    train(model, opt, [1, 2])
    before = opt.state_dict()
    if kind in ("adam", "adamw"):
        assert all(float(s["step"]) == 2.0 for s in before["state"].values())
    else:
        assert all(s["momentum_buffer"] is not None for s in before["state"].values())

    path = capture(Task(model, opt, lm_loss), make_batch(3), tmp_path / "b", entry=ENTRY)
    b = read_bundle(path)

    fresh_model = make_model(5)
    fresh_opt = make_opt(kind, fresh_model.parameters(), alt=True)
    assert fresh_opt.state_dict()["param_groups"] != before["param_groups"]
    tensors = b.all_tensors()
    restore_model(fresh_model, b.manifest["model"], tensors, "test")
    restore_optimizer(fresh_opt, b.manifest["optimizer"], tensors, "test")

    restored = fresh_opt.state_dict()
    assert_opt_state_equal(restored, before)
    for g in restored["param_groups"]:
        if "betas" in g:
            assert type(g["betas"]) is tuple
    if kind in ("adam", "adamw"):
        for s in restored["state"].values():
            assert s["step"].dtype == torch.float32 and float(s["step"]) == 2.0

    # one more step from each: bit-identical parameters and optimizer state
    train(model, opt, [3])
    train(fresh_model, fresh_opt, [3])
    for (n, p), (_, q) in zip(model.named_parameters(), fresh_model.named_parameters()):
        assert_tensor_identical(p.detach(), q.detach(), n)
    assert_opt_state_equal(fresh_opt.state_dict(), opt.state_dict())


def test_optimizer_class_mismatch_is_bad_input(tmp_path, trained):
    b = read_bundle(capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY))
    model = make_model(0)
    with pytest.raises(BadInput, match="Adam"):
        restore_optimizer(make_opt("sgd", model.parameters()), b.manifest["optimizer"],
                          b.all_tensors(), "test")


def test_optimizer_class_from_main_matches_the_entry_files_class():
    """A class recorded as ``__main__.Name`` (the script ran as ``python train.py``) is the class
    of that name the entry file defines when the replay imports it as a module; never a class
    of torch's, nor one of another name or another recorded module."""
    from main_optimizer import Lamb

    from nanbisect.bundle.state import same_class

    assert same_class("__main__.Lamb", Lamb) and same_class("main_optimizer.Lamb", Lamb)
    assert not same_class("__main__.Adam", torch.optim.Adam)
    assert not same_class("__main__.Lamb2", Lamb) and not same_class("train.Lamb", Lamb)


def test_script_run_as_main_with_its_own_optimizer_replays(tmp_path):
    """Issue 38 item 5: a training script run as ``__main__`` that defines its own optimizer
    (tests/tasks/main_optimizer.py: a hand-written LAMB whose trust ratio makes 0 / 0) is caught
    by the Guard, and `nanbisect run` replays it and finds the op in the optimizer phase (before:
    exit 2, "the bundle holds a __main__.Lamb state but the entry built a main_optimizer.Lamb")."""
    from helpers import TEST_TASKS, run_json, run_python

    script = TEST_TASKS / "main_optimizer.py"
    res = run_python([str(script), str(tmp_path / "out")], cwd=tmp_path)
    assert res.code == 0, res.stdout + res.stderr
    bundle = Path(res.stdout.strip().splitlines()[-1])
    assert read_bundle(bundle).manifest["optimizer"]["class"] == "__main__.Lamb"
    rep = run_json(bundle)
    c = rep["culprit"]
    assert (rep["verdict"], c["phase"], c["op"], c["parameter"]) == (
        "culprit", "optimizer", "aten.div.Tensor", "gate")
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1)
                if "# the bug" in text)
    assert c["source"].endswith(f"main_optimizer.py:{line}"), c["source"]


def test_restore_optimizer_leaves_source_tensors_untouched(tmp_path, trained):
    b = read_bundle(capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY))
    tensors = b.all_tensors()
    pristine = {k: v.clone() for k, v in tensors.items()}
    model = make_model(0)
    opt = make_opt("adam", model.parameters())
    restore_model(model, b.manifest["model"], tensors, "test")
    restore_optimizer(opt, b.manifest["optimizer"], tensors, "test")
    train(model, opt, [3])
    changed = sorted(k for k in tensors if not torch.equal(tensors[k], pristine[k]))
    assert changed == []


# --------------------------------------------------------------------------------------------
# batch pytrees


def rich_batch() -> dict:
    x = torch.randn(3, 4)
    emb = torch.randn(2, 3, requires_grad=True)
    return {
        "x": x,
        "x_t": x.t(),  # non-contiguous view sharing storage with "x"
        "half": torch.randn(2, 5).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([[True, False], [False, True]]),
        "special": torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0]),
        "scalar": torch.tensor(2.5),
        "emb": emb,
        "nested": {"pair": (torch.ones(2, dtype=torch.float64), [torch.zeros(1), None]),
                   "deep": [{"a": (1, 2.5, "s")}, ()],
                   3: "int key", 2.5: "float key", True: "bool key"},
        "meta": ("name", 7, -3, 2 ** 60, 0.1, float("nan"), float("inf"), float("-inf"), True,
                 False, None),
        "empty": {"l": [], "t": (), "d": {}},
    }


def test_batch_round_trip_in_memory():
    batch = rich_batch()
    tensors: dict = {}
    meta = encode(batch, "batch", tensors)
    meta = json.loads(json.dumps(meta, allow_nan=False))  # manifest-safe, no bare NaN
    assert_same_tree(batch, decode(meta, tensors))


def test_batch_round_trip_through_bundle(tmp_path):
    batch = rich_batch()
    model = nn.Linear(2, 1)
    path = capture(Task(model, None, lambda m, b: m(b).sum()), batch, tmp_path / "b", entry=ENTRY)
    b = read_bundle(path)
    got = decode(b.manifest["batch"], b.tensors("batch"))
    assert_same_tree(batch, got)
    assert got["emb"].is_leaf and got["emb"].requires_grad
    assert not got["x"].requires_grad


def test_batch_rejects_unsupported_values():
    Point = collections.namedtuple("Point", "x y")
    for bad in (object(), {"p": Point(1, 2)}, {(1, 2): torch.ones(1)}, {1, 2}):
        with pytest.raises(TypeError):
            encode(bad, "batch", {})


@pytest.mark.parametrize("batch", [
    pytest.param({"a/b": torch.zeros(2), "a": {"b": torch.ones(2)}}, id="slash-in-key"),
    pytest.param({1: torch.zeros(2), "1": torch.ones(2)}, id="int-vs-str-key"),
])
def test_batch_keys_that_format_alike_do_not_collide(batch):
    tensors: dict = {}
    meta = encode(batch, "batch", tensors)
    assert_same_tree(batch, decode(meta, tensors))


# --------------------------------------------------------------------------------------------
# RNG


def draws():
    return (random.random(), random.gauss(0, 1), random.getrandbits(64),
            np.random.rand(3).tolist(), float(np.random.standard_normal()),
            torch.rand(4).tolist(), torch.randn(3).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_rng_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)              # leaves a cached gaussian in Python's state
    np.random.standard_normal()     # ... and in NumPy's legacy state
    state = RngState.get([])
    assert state.python[2] is not None and state.numpy[3] == 1

    first = draws()
    assert draws() != first          # generators advanced: a repeat is not trivially equal
    state.set()
    assert draws() == first

    # through the on-disk form: JSON metadata + a safetensors file
    tensors: dict = {}
    meta = json.loads(json.dumps(state.encode(tensors), allow_nan=False))
    save_file(tensors, str(tmp_path / "rng.safetensors"))
    decoded = RngState.decode(meta, load_file(str(tmp_path / "rng.safetensors")))
    draws()
    decoded.set()
    assert draws() == first


def test_capture_stores_rng_at_capture_time(tmp_path, trained):
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    expected = draws()
    b = read_bundle(path)
    RngState.decode(b.manifest["rng"], b.tensors("rng")).set()
    assert draws() == expected
