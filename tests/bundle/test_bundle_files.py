"""The bundle on disk: its files and manifest, an atomic write, a path that exists, what a
malformed bundle reads as (one line, exit 2), the manifest view."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn as nn

import nanbisect
from nanbisect import BadInput, Task, capture
from nanbisect.bundle.format import SCHEMA, read_bundle
from nanbisect.bundle.state import decode
from helpers.tiedlm import (ENTRY, make_batch, sha256, trained_task)


@pytest.fixture
def trained():
    """A tied model trained two steps with Adam (`helpers.tiedlm.trained_task`)."""
    return trained_task()


# --------------------------------------------------------------------------------------------
# files and manifest


def test_bundle_files_and_manifest(tmp_path, trained):
    path = capture(trained, make_batch(3), tmp_path / "b", entry=ENTRY, step=41)
    names = sorted(p.name for p in path.iterdir() if p.name != "code")
    assert names == ["batch.safetensors", "manifest.json", "model.safetensors",
                     "optimizer.safetensors", "rng.safetensors"]
    assert all(p.is_file() for p in path.iterdir() if p.name != "code")
    assert (path / "code").is_dir()             # the entry's source travels with the bundle

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
    assert sorted(p.name for p in path.iterdir() if p.name != "code") == [
        "manifest.json", "model.safetensors", "rng.safetensors"]
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
    from nanbisect.bundle.describe import summarize, summary_text

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
