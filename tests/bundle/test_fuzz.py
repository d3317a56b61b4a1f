"""Property-based fuzzing of everything that reads untrusted bytes: a bundle's manifest (single-
and multi-rank), its safetensors headers, and pack archives. Any mutation gives `BadInput` (a
clean one-line error) or a valid result, never another exception; a refused archive leaves
nothing behind.

Reproducible by default: ``derandomize=True`` runs the same examples every time (CI cannot flake
on a new random example one night and not the next) and ``database=None`` keeps no state. For a
longer random campaign, locally:

    NANBISECT_FUZZ_EXAMPLES=5000 python -m pytest tests/bundle/test_fuzz.py -p no:cacheprovider

(random seeds, that many examples per property; a failure prints the seed and the minimal
example; add what it finds as a case in tests/bundle/test_hostile.py). `run` itself is fuzzed too, on
a real fixture bundle, against `inspect`: the two must accept and refuse the same mutants.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from helpers import FIXTURES, invoke
from nanbisect import BadInput
from nanbisect.bundle.format import read_bundle, read_header
from nanbisect.bundle.state import (RngState, decode, restore_model, restore_modes,
                                     restore_optimizer)
from nanbisect.bundle.describe import summarize, summary_text
from helpers.hostile import bundle, make_task, multi

_N = int(os.environ.get("NANBISECT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_N or 150, deadline=None, derandomize=not _N, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


# --------------------------------------------------------------------------------------------
# JSON mutations

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["", ".", "..", "../x", "/etc", "rank0", "rank1", "F32", "x:y",
                              "model.safetensors", "nanbisect.bundle/1", "multi-rank"]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                           max_leaves=8)
DEEP = "\x00nanbisect-deep\x00"


def _retype(v):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return [v]
    if isinstance(v, str):
        return {v: v}
    if isinstance(v, list):
        return {str(i): x for i, x in enumerate(v)}
    if isinstance(v, dict):
        return list(v.values())
    return 0


@st.composite
def mutated(draw, doc):
    """``doc`` (a JSON value) with 1-3 mutations at random places: a value replaced by random
    JSON, a key or element deleted, a type changed, deep nesting, an extra key."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node = None, None, doc
        while isinstance(node, (dict, list)) and node and draw(st.integers(0, 3)) > 0:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, draw(st.sampled_from(keys))
            node = node[key]
        op = draw(st.sampled_from(["replace", "delete", "retype", "deep", "insert"]))
        if parent is None:
            if op == "insert" and isinstance(doc, dict):
                doc[draw(st.text(max_size=8))] = draw(json_values)
            elif op in ("replace", "retype"):
                doc = draw(json_values) if op == "replace" else _retype(doc)
            continue
        if op == "replace":
            parent[key] = draw(json_values)
        elif op == "delete":
            del parent[key]
        elif op == "retype":
            parent[key] = _retype(node)
        elif op == "deep":
            parent[key] = DEEP
        elif isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(json_values)
        elif isinstance(node, list):
            node.append(draw(json_values))
    return doc


def dumps(doc, depth: int) -> bytes:
    """JSON text of ``doc``, with every `DEEP` marker replaced by ``depth`` nested lists."""
    text = json.dumps(doc)   # NB: allow_nan: NaN and Infinity are what a hostile file may hold
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


def flip(data: bytes, positions: list[int], masks: list[int]) -> bytes:
    out = bytearray(data)
    for p, m in zip(positions, masks):
        if out:
            out[p % len(out)] ^= m
    return bytes(out)


flips = st.tuples(st.lists(st.integers(0, 1 << 30), min_size=1, max_size=6),
                  st.lists(st.integers(1, 255), min_size=6, max_size=6))


# --------------------------------------------------------------------------------------------
# what a valid result must look like


def load_everything(path: Path) -> None:
    """inspect, then the load path up to the user's code: tensors, batch, RNG, model and
    optimizer restored into a model of the captured architecture. BadInput or success only."""
    info = summarize(path)
    text = summary_text(info)
    assert isinstance(text, str) and "\x1b" not in text
    json.dumps(info)
    b = read_bundle(path)
    parts = [b.part(int(r)) for r in b.manifest["ranks"]] if b.multi_rank else [b]
    for part in parts:
        tensors = part.all_tensors()
        decode(part.manifest["batch"], tensors)
        RngState.decode(part.manifest["rng"], tensors)
        task = make_task()
        restore_model(task.model, part.manifest["model"], tensors, "fuzz")
        restore_modes(task.model, part.manifest["model"], "fuzz")
        if part.manifest.get("optimizer") is not None:
            restore_optimizer(task.optimizer, part.manifest["optimizer"], tensors, "fuzz")


def outcome(fn, *args):
    """"ok" or "bad-input" (a one-line `BadInput`); any other exception fails the property."""
    try:
        fn(*args)
    except BadInput as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg   # one line
        _event("bad-input")
        return "bad-input"
    _event("ok")
    return "ok"


def _event(name: str) -> None:
    """Count outcomes (``--hypothesis-show-statistics``) when inside a property."""
    try:
        event(name)
    except InvalidArgument:
        pass


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    path = bundle(tmp_path_factory.mktemp("fuzz") / "b")
    return path, json.loads((path / "manifest.json").read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = multi(tmp_path_factory.mktemp("fuzz") / "m")
    return path, json.loads((path / "manifest.json").read_text())


def test_fuzz_harness_sees_valid_bundles(one, two):
    """The properties below would be vacuous if the unmutated inputs did not load."""
    for path, _ in (one, two):
        assert outcome(load_everything, path) == "ok"


# --------------------------------------------------------------------------------------------
# properties


@FUZZ
@given(data=st.data(), depth=st.sampled_from([3, 255, 300, 5000]))
@pytest.mark.slow
def test_mutated_manifest(one, data, depth):
    path, base = one
    doc = data.draw(mutated(base))
    (path / "manifest.json").write_bytes(dumps(doc, depth))
    try:
        outcome(load_everything, path)
    finally:
        (path / "manifest.json").write_text(json.dumps(base))


@FUZZ
@given(data=st.data(), depth=st.sampled_from([3, 300]))
def test_mutated_multi_rank_manifest(two, data, depth):
    path, base = two
    (path / "manifest.json").write_bytes(dumps(data.draw(mutated(base)), depth))
    try:
        outcome(load_everything, path)
    finally:
        (path / "manifest.json").write_text(json.dumps(base))


@FUZZ
@given(mutation=flips, cut=st.none() | st.integers(0, 1 << 20))
@pytest.mark.slow
def test_manifest_bytes_flipped_or_cut(one, mutation, cut):
    path, base = one
    raw = flip(json.dumps(base).encode(), *mutation)
    (path / "manifest.json").write_bytes(raw[:cut] if cut is not None else raw)
    try:
        outcome(load_everything, path)
    finally:
        (path / "manifest.json").write_text(json.dumps(base))


def _reseal(path: Path, name: str, data: bytes, base: dict) -> None:
    (path / name).write_bytes(data)
    m = copy.deepcopy(base)
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.fixture(scope="module")
def tensor_file(one):
    path, _ = one
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, json.loads(raw[8:8 + n]), raw[8 + n:]


def _check_header_file(path: Path, name: str, base: dict, data: bytes) -> None:
    """The mutated file, resealed into the bundle: our reader and safetensors agree whenever we
    accept; inspect and the load path give BadInput or a result."""
    _reseal(path, name, data, base)
    try:
        try:
            head = read_header(path / name)
        except BadInput as e:
            assert "\n" not in str(e)
        else:   # accepted: safetensors itself must read it, with the same tensors
            got = load_file(str(path / name))
            assert sorted(got) == sorted(head)
        outcome(load_everything, path)
    finally:
        (path / "manifest.json").write_text(json.dumps(base))


@FUZZ
@given(data=st.data(), length=st.sampled_from(["exact", "short", "long", "huge"]),
       depth=st.sampled_from([3, 300]))
def test_mutated_safetensors_header_json(one, tensor_file, data, length, depth):
    path, base = one
    raw, head, body = tensor_file
    hb = dumps(data.draw(mutated(head)), depth)
    n = {"exact": len(hb), "short": max(0, len(hb) - 3), "long": len(hb) + 5,
         "huge": 1 << 62}[length]
    try:
        _check_header_file(path, "model.safetensors", base, struct.pack("<Q", n) + hb + body)
    finally:
        (path / "model.safetensors").write_bytes(raw)


@FUZZ
@given(mutation=flips, in_header=st.booleans(), cut=st.none() | st.integers(0, 4096))
def test_safetensors_bytes_flipped_or_cut(one, tensor_file, mutation, in_header, cut):
    path, base = one
    raw, head, _ = tensor_file
    n = struct.unpack("<Q", raw[:8])[0]
    positions, masks = mutation
    if in_header:   # most flips in the 8-byte length and the JSON header, where parsing happens
        positions = [p % (8 + n) for p in positions]
    data = flip(raw, positions, masks)
    try:
        _check_header_file(path, "model.safetensors", base, data[:cut] if cut else data)
    finally:
        (path / "model.safetensors").write_bytes(raw)


dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64,
                          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
                          torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2])


@FUZZ
@given(specs=st.dictionaries(st.text(min_size=1, max_size=10).filter(
    lambda k: k != "__metadata__"), st.tuples(dtypes, st.lists(st.integers(0, 4), max_size=3)),
    max_size=5))
def test_every_file_save_file_writes_is_accepted(tmp_path_factory, specs):
    """Never stricter than the writer: whatever save_file writes, read_header accepts."""
    d = tmp_path_factory.mktemp("st")
    tensors = {k: torch.zeros(shape, dtype=dt) for k, (dt, shape) in specs.items()}
    save_file(tensors, str(d / "x.safetensors"), metadata={"k": "v"})
    head = read_header(d / "x.safetensors")
    assert sorted(head) == sorted(tensors)
    for k, t in tensors.items():
        assert head[k]["shape"] == list(t.shape)
    shutil.rmtree(d)


# --------------------------------------------------------------------------------------------
# `run` itself (the code the CLI runs, in this process) against `inspect`, on mutated manifests
# of a real bundle: a report or a one-line error, never another exception, and the same verdict
# on the bundle from both

# What only the entry's code can tell, and `inspect` never runs it: the model it builds, its
# optimizer, its loss_fn on the batch. A mutant `inspect` accepts may still be refused by `run`
# for these (the message says so), never for anything else.
ENTRY_ONLY = ("replay with the code that captured it", "the entry's code fails on this bundle")
RUN_FUZZ = settings(FUZZ, max_examples=_N or 40)


@pytest.fixture(scope="module")
def nan_batch(tmp_path_factory):
    path = tmp_path_factory.mktemp("run-fuzz") / "nan_batch"
    shutil.copytree(FIXTURES / "nan_batch", path,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    return path, json.loads((path / "manifest.json").read_text())


def cli_outcome(*args) -> tuple[str, str]:
    """("ok", "") for exit 0, 1 or 3; ("bad-input", the line) for a one-line exit 2. Any other
    exception propagates out of `invoke`: the property fails."""
    res = invoke(*args)
    if res.code == 2:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nanbisect: error: "), res.stderr
        return "bad-input", lines[0]
    assert res.code in (0, 1, 3), (res.code, res.stderr[-2000:])
    return "ok", ""


def inspect_and_run(path: Path, out: Path) -> tuple[str, str, str]:
    seen, _ = cli_outcome("inspect", path)
    ran, why = cli_outcome("run", path, "--out", out, "--json")
    assert (out / "report.json").is_file() if ran == "ok" else not out.exists(), why
    return seen, ran, why


def test_fuzz_harness_runs_the_bundle(nan_batch, tmp_path):
    assert inspect_and_run(nan_batch[0], tmp_path / "out")[:2] == ("ok", "ok")


@RUN_FUZZ
@given(data=st.data(), depth=st.sampled_from([3, 255, 300]))
def test_run_and_inspect_agree_on_mutated_manifests(nan_batch, tmp_path_factory, data, depth):
    path, base = nan_batch
    out = tmp_path_factory.getbasetemp() / "run-fuzz-out"
    (path / "manifest.json").write_bytes(dumps(data.draw(mutated(base)), depth))
    try:
        seen, ran, why = inspect_and_run(path, out)
        assert seen == ran or (seen == "ok" and any(p in why for p in ENTRY_ONLY)), \
            (seen, ran, why)
        _event(f"inspect {seen}, run {ran}")
    finally:
        (path / "manifest.json").write_text(json.dumps(base))
        shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# the time dimension: a bundle's history and lookback sections (Guard(history=, lookback=))


def load_steps(path: Path) -> None:
    """What `run` reads of a bundle's history and lookback before any step runs: the history
    checked, the window's snapshot and every step's batch, RNG and hyper-parameters decoded and
    restored into the entry's model and optimizer."""
    import drift
    from nanbisect import history
    from nanbisect.bundle import lookback
    from nanbisect.bundle.manifest import Manifest

    b = read_bundle(path)
    history.findings(history.parse(Manifest.of(b).history, b.tensors(history.ROLE), "fuzz"))
    w = lookback.parse(b, "fuzz")
    if w is None:
        return
    view = w.state_view(b)
    task = drift.adam_task()
    for i in range(len(w.steps)):
        v = view.with_step(w, i)
        tensors = v.all_tensors()
        restore_model(task.model, v.manifest["model"], tensors, "fuzz")
        restore_modes(task.model, v.manifest["model"], "fuzz")
        if v.manifest.get("optimizer") is not None:
            restore_optimizer(task.optimizer, v.manifest["optimizer"], tensors, "fuzz")
        decode(v.manifest["batch"], tensors)
        decode(v.manifest["lookback_groups"], tensors)
        RngState.decode(v.manifest["rng"], tensors)


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    import drift
    import nanbisect

    guard = nanbisect.Guard(drift.adam_task(), entry="tests/tasks/drift.py:adam_task",
                            out=tmp_path_factory.mktemp("fuzz-steps"), lookback=3, history=6)
    e = drift.train(guard, drift.batches(200), schedule=lambda opt, i: [
        g.update(lr=1e30) for g in opt.param_groups] if i == 9 else None)
    return e.bundle, json.loads((e.bundle / "manifest.json").read_text())


def test_fuzz_harness_sees_a_valid_window(stepped):
    assert outcome(load_steps, stepped[0]) == "ok"
    assert len(stepped[1]["lookback"]["steps"]) >= 3 and len(stepped[1]["history"]["entries"]) == 6


@FUZZ
@given(data=st.data(), section=st.sampled_from(["history", "lookback"]))
@pytest.mark.slow
def test_mutated_history_and_lookback(stepped, tmp_path_factory, data, section):
    path, base = stepped
    doc = dict(base)
    doc[section] = data.draw(mutated(base[section]))
    d = tmp_path_factory.mktemp("m", numbered=True) / "b"
    shutil.copytree(path, d, ignore=shutil.ignore_patterns("nanbisect-report"))
    (d / "manifest.json").write_bytes(dumps(doc, 3))
    outcome(load_steps, d)
