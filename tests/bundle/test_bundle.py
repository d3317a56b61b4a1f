"""Bundle format and state encoding: model/optimizer/batch/RNG round trips, files, atomicity, errors

Everything runs on CPU with tiny models; bundles are written under pytest's ``tmp_path``.
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nanbisect
from nanbisect import BadInput, Task, capture
from nanbisect.bundle.format import SCHEMA, read_bundle
from nanbisect.bundle.state import RngState, decode, encode, restore_model, restore_optimizer

ENTRY = f"{Path(__file__).resolve()}:make_model"  # capture checks that it exists, never imports it
VOCAB, DIM = 11, 6


# --------------------------------------------------------------------------------------------
# helpers


class TiedLM(nn.Module):
    """Embedding and output head share one weight; BatchNorm adds float and int64 buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens).mean(1)))


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["tokens"]), batch["target"])


def make_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (8, 5), generator=g),
            "target": torch.randint(0, VOCAB, (8,), generator=g)}


def make_model(seed: int) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


def train(model: nn.Module, opt: torch.optim.Optimizer | None, seeds) -> None:
    for s in seeds:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        lm_loss(model, make_batch(s)).backward()
        if opt is not None:
            opt.step()


def make_opt(kind: str, params, alt: bool = False) -> torch.optim.Optimizer:
    """``alt`` builds the same optimizer class with different hyper-parameters."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.3 if alt else 0.01,
                                betas=(0.5, 0.6) if alt else (0.8, 0.95), weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.3 if alt else 0.02,
                                 betas=(0.5, 0.6) if alt else (0.85, 0.99), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.3 if alt else 0.05, momentum=0.1 if alt else 0.9,
                               nesterov=not alt, weight_decay=0.0 if alt else 1e-3)
    raise AssertionError(kind)


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=what)
    else:
        assert torch.equal(a, b), what


def assert_opt_state_equal(sd1: dict, sd2: dict) -> None:
    assert sd1["param_groups"] == sd2["param_groups"]
    assert sd1["state"].keys() == sd2["state"].keys()
    for i, st in sd1["state"].items():
        assert st.keys() == sd2["state"][i].keys(), i
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert_tensor_identical(v, sd2["state"][i][k], f"state[{i}][{k}]")
            else:
                assert v == sd2["state"][i][k], f"state[{i}][{k}]"


def assert_same_tree(a, b, where: str = "batch") -> None:
    """Equal structure, leaf types and values; nan equals nan."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert_tensor_identical(a, b, where)
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys"
        for (ka, va), kb in zip(a.items(), b.keys()):
            assert type(ka) is type(kb), f"{where}: key type of {ka!r}"
            assert_same_tree(va, b[kb], f"{where}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def trained():
    """A tied model trained two steps with Adam (non-trivial params, buffers, optimizer state)."""
    model = make_model(0)
    opt = make_opt("adam", model.parameters())
    train(model, opt, [1, 2])
    return Task(model=model, optimizer=opt, loss_fn=lm_loss)


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


# --------------------------------------------------------------------------------------------
# files and manifest


def test_bundle_files_and_manifest(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY, step=41)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["batch.safetensors", "manifest.json", "model.safetensors",
                     "optimizer.safetensors", "rng.safetensors"]
    assert all(p.is_file() for p in path.iterdir())

    m = json.loads((path / "manifest.json").read_text())
    assert sorted(m["files"]) == [n for n in names if n != "manifest.json"]
    for name, info in m["files"].items():
        assert info["sha256"] == sha256(path / name)
        assert info["bytes"] == (path / name).stat().st_size
    assert m["schema"] == SCHEMA == "nanbisect.bundle/1"
    assert m["entry"] == ENTRY
    assert m["step"] == 41
    assert m["world_size"] == 1 and m["rank"] == 0
    assert m["environment"]["torch"] == torch.__version__
    assert m["environment"]["nanbisect"] == nanbisect.__version__
    assert m["devices"]["captured_on"] == "cpu"
    assert isinstance(m["devices"]["accelerators"], list)
    assert m["dtypes"] == ["float32"]
    assert m["observed"] is None
    assert m["optimizer"]["class"] == "torch.optim.adam.Adam"
    assert read_bundle(path).manifest == m


def test_roles_without_tensors_get_no_file(tmp_path):
    model = nn.Linear(2, 1).to(torch.float64)
    task = Task(model, None, lambda m, b: m(b).sum())
    path = capture(task, {"n": 3, "s": "no tensors"}, tmp_path / "b", entry=ENTRY)
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors",
                                                      "rng.safetensors"]
    m = read_bundle(path).manifest
    assert m["optimizer"] is None and m["dtypes"] == ["float64"]
    assert decode(m["batch"], {}) == {"n": 3, "s": "no tensors"}


# --------------------------------------------------------------------------------------------
# atomic writes


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_write_is_atomic(tmp_path, trained, monkeypatch, exc):
    import nanbisect.bundle.writer as bundle_mod

    real = bundle_mod.save_file
    calls = []

    def failing_save(tensors, filename, *a, **k):
        calls.append(filename)
        if len(calls) == 2:
            raise exc("disk full")
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(bundle_mod, "save_file", failing_save)
    parent = tmp_path / "out"
    target = parent / "b"
    with pytest.raises(exc):
        capture(trained, make_batch(3), target, entry=ENTRY)
    assert len(calls) == 2
    assert not target.exists()
    assert list(parent.iterdir()) == []  # no hidden temporary directory left behind

    monkeypatch.setattr(bundle_mod, "save_file", real)
    assert read_bundle(capture(trained, make_batch(3), target, entry=ENTRY)).path == target


def test_capture_refuses_existing_path(tmp_path, trained):
    existing_dir = tmp_path / "d"
    existing_dir.mkdir()
    (existing_dir / "keep.txt").write_text("mine")
    existing_file = tmp_path / "f"
    existing_file.write_text("mine")
    empty_dir = tmp_path / "e"
    empty_dir.mkdir()
    for p in (existing_dir, existing_file, empty_dir):
        with pytest.raises(FileExistsError):
            capture(trained, make_batch(3), p, entry=ENTRY)
    assert (existing_dir / "keep.txt").read_text() == "mine"
    assert existing_file.read_text() == "mine"
    assert list(empty_dir.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "e", "f"]


# --------------------------------------------------------------------------------------------
# read_bundle errors


def _edit_manifest(path, **changes):
    m = json.loads((path / "manifest.json").read_text())
    for k, v in changes.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    (path / "manifest.json").write_text(json.dumps(m))


def _flip_byte(path, name):
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))


def _truncate(path, name):
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) - 7])


CORRUPTIONS = {
    "missing-dir": (lambda p: p.rename(p.with_name("gone")), "does not exist"),
    "is-a-file": (lambda p: (shutil.rmtree(p), p.write_text("x")), "not a directory"),
    "missing-manifest": (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    "garbage-json": (lambda p: (p / "manifest.json").write_text("{not json"), "not valid JSON"),
    "not-utf8": (lambda p: (p / "manifest.json").write_bytes(b"\xff\xfe\x00"), "not valid JSON"),
    "json-list": (lambda p: (p / "manifest.json").write_text("[1, 2]"), "schema"),
    "no-schema": (lambda p: _edit_manifest(p, schema=None), "schema"),
    "foreign-schema": (lambda p: _edit_manifest(p, schema="other.bundle/1"), "schema"),
    "future-schema": (lambda p: _edit_manifest(p, schema="nanbisect.bundle/99"), "schema 99"),
    "bad-schema-version": (lambda p: _edit_manifest(p, schema="nanbisect.bundle/x"), "schema"),
    "missing-key": (lambda p: _edit_manifest(p, entry=None), "lacks 'entry'"),
    "flipped-byte": (lambda p: _flip_byte(p, "model.safetensors"), "model.safetensors does not "
                     "match its sha256"),
    "truncated": (lambda p: _truncate(p, "batch.safetensors"), "batch.safetensors does not match "
                  "its sha256"),
    "missing-tensor-file": (lambda p: (p / "rng.safetensors").unlink(), "'rng.safetensors' "
                            "listed in the manifest is missing"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_read_bundle_bad_input(tmp_path, trained, case):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    read_bundle(path)  # intact: reads fine
    corrupt, message = CORRUPTIONS[case]
    corrupt(path)
    with pytest.raises(BadInput) as ei:
        read_bundle(path)
    assert message in str(ei.value)
    assert str(path) in str(ei.value)  # names the bundle


def test_truncated_tensor_file_unverified_is_bad_input(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    _truncate(path, "model.safetensors")
    b = read_bundle(path, verify=False)
    with pytest.raises(BadInput, match="model.safetensors is not a readable safetensors file"):
        b.tensors("model")


def test_manifest_naming_a_missing_tensor_is_bad_input(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    b = read_bundle(path)
    meta = b.manifest["batch"]
    tensors = b.tensors("batch")
    del tensors["batch/v0"]  # the first dict value: "tokens"
    with pytest.raises(BadInput, match="batch/v0"):
        decode(meta, tensors)


def test_bundle_tensor_file_listed_with_path_is_rejected(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY)
    m = json.loads((path / "manifest.json").read_text())
    (tmp_path / "evil.safetensors").write_bytes((path / "rng.safetensors").read_bytes())
    m["files"]["../evil.safetensors"] = {"sha256": sha256(tmp_path / "evil.safetensors")}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BadInput, match="'../evil.safetensors', which is not a plain file name"):
        read_bundle(path)


def test_the_manifest_view_reads_captured_on_by_one_rule(tmp_path):
    """`Manifest`: read once through the bounded reader; ``captured_on`` is the manifest's,
    the host's type when it names none (a section or a field left out)."""
    from nanbisect.bundle.manifest import Manifest, captured_on
    from nanbisect.bundle.summary import summarize, summary_text

    m = Manifest.read("fixtures/bundles/nan_batch")
    assert m.captured_on == "cpu" and m.captured_type == "cpu" and m.captured_on_host
    assert not m.multi_rank and m.observed is not None and m.entry == m.data["entry"]
    assert Manifest.of(read_bundle("fixtures/bundles/nan_batch")).data == m.data
    assert captured_on({"captured_on": "cuda:1"}) == "cuda:1"
    assert captured_on(None) == captured_on({}) == captured_on({"captured_on": None}) == "cpu"
    b = tmp_path / "b"
    shutil.copytree("fixtures/bundles/nan_batch", b,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    data = json.loads((b / "manifest.json").read_text())
    data["devices"] = None
    (b / "manifest.json").write_text(json.dumps(data))
    assert Manifest.read(b).captured_on == "cpu"
    with pytest.raises(BadInput):
        Manifest.read(tmp_path / "nowhere")
    info = summarize("fixtures/bundles/nan_batch")
    assert " on cpu with torch" in summary_text({**info, "devices": None})
