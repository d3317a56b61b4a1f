"""Hostile bundles and archives: real files built to hurt (huge claimed world sizes, deep JSON,
malformed safetensors headers, links, compression bombs). Each is a one-line exit 2 (`BadInput`)
in bounded time and memory, and nothing is written half-way.

`HOSTILE_BUNDLES` and `HOSTILE_ARCHIVES` map a case to a builder that writes the hostile input
under a directory and returns what to pass to the CLI plus a phrase the error must contain; the
table in docs/RELIABILITY.md is these cases run through ``python -m nanbisect``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from helpers import invoke
from nanbisect import BadInput
from nanbisect.bundle.format import SCHEMA, read_bundle
from nanbisect.bundle.describe import summarize
from helpers.hostile import (DATA, HEAD, bundle, edit, ln, multi, put_file,
                             reseal_part, sha256, st, with_tensor)


# --------------------------------------------------------------------------------------------
# hostile bundles: name -> builder(dir) -> (bundle path, phrase the one-line error must hold)


def _world_1e8(d: Path):
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(
        {"schema": SCHEMA, "kind": "multi-rank", "entry": "x:y", "world_size": 100_000_000,
         "ranks": {"0": {"dir": "rank0"}}, "files": {}}))
    assert (d / "manifest.json").stat().st_size < 300
    return d, "'world_size' is an integer, not null or an integer from 1 to 1048576"


def _world_cap_parts_missing(d: Path):
    d.mkdir()
    world = 1 << 20     # allowed, and listed in full: the parts are simply not there
    # what json.dumps writes for {..., "ranks": {"0": {"dir": "rank0", "manifest_sha256": ""},
    # ...}, "files": {}}, written as text: building a million dicts first cost 5 s of CPU
    head = json.dumps({"schema": SCHEMA, "kind": "multi-rank", "entry": "x:y",
                       "world_size": world})[:-1]
    ranks = ", ".join(f'"{r}": {{"dir": "rank{r}", "manifest_sha256": ""}}' for r in range(world))
    (d / "manifest.json").write_text(f'{head}, "ranks": {{{ranks}}}, "files": {{}}}}')
    return d, "the part of rank 0 (rank0) is missing"


def _world_claims_more_than_listed(d: Path):
    multi(d)
    edit(d, lambda m: m.update(world_size=1 << 20))
    return d, "lists 2 parts, not one per rank 0..1048575"


def _manifest_65mib(d: Path):
    bundle(d)
    with open(d / "manifest.json", "r+b") as f:   # sparse: costs no disk
        f.truncate(65 << 20)
    return d, "more than the 67108864 nanbisect reads"


def _deep_manifest(d: Path):
    bundle(d)
    (d / "manifest.json").write_text('{"schema": "nanbisect.bundle/1", "batch": '
                                     + "[" * 100_000 + "]" * 100_000 + "}")
    return d, "nested deeper than 256 levels"


def _deep_manifest_300(d: Path):
    bundle(d)
    edit(d, lambda m: m.update(batch=json.loads("[" * 300 + "]" * 300)))
    return d, "nested deeper than 256 levels"


def _many_values(d: Path):
    bundle(d)
    (d / "manifest.json").write_text('{"schema": "nanbisect.bundle/1", "x": ['
                                     + "{}," * 5_000_000 + "{}]}")
    return d, "JSON values, more than the 4000000"


def _huge_int(d: Path):
    bundle(d)
    (d / "manifest.json").write_text('{"schema": "nanbisect.bundle/1", "step": '
                                     + "9" * 5000 + "}")
    return d, "not valid JSON"


def _field(key, value, phrase):
    def build(d: Path):
        bundle(d)
        edit(d, lambda m: m.update({key: value}))
        return d, phrase
    return build


def _model_field(key, value, phrase):
    def build(d: Path):
        bundle(d)
        edit(d, lambda m: m["model"].update({key: value}))
        return d, phrase
    return build


def _files_entry(value, phrase):
    def build(d: Path):
        bundle(d)
        edit(d, lambda m: m["files"].update({"model.safetensors": value}))
        return d, phrase
    return build


def _rank_entry(value, phrase, rank="1"):
    def build(d: Path):
        multi(d)
        edit(d, lambda m: m["ranks"].update({rank: value}))
        return d, phrase
    return build


def _top_field(key, value, phrase):
    def build(d: Path):
        multi(d)
        edit(d, lambda m: m.update({key: value}))
        return d, phrase
    return build


def _rank_dir_outside(target):
    def build(d: Path):
        multi(d)
        other = d.parent / "other"
        bundle(other, rank=1, world=2)
        dirname = str(other.resolve()) if target == "absolute" else "../other"
        sha = sha256(other / "manifest.json")
        edit(d, lambda m: m["ranks"].update({"1": {"dir": dirname, "manifest_sha256": sha}}))
        return d, "parts outside the bundle are refused"
    return build


def _rank_dir_symlink(d: Path):
    multi(d)
    other = d.parent / "other"
    (d / "rank1").rename(other)
    (d / "rank1").symlink_to(other.resolve(), target_is_directory=True)
    return d, "the part of rank 1 (rank1) is a symbolic link"


def _rank_part_lies_about_rank(d: Path):
    multi(d)
    edit(d / "rank1", lambda m: m.update(rank=0))
    reseal_part(d, 1)
    return d, "the part listed for rank 1 says it is rank 0"


def _ranks_share_dir(d: Path):
    multi(d)
    edit(d, lambda m: m["ranks"]["1"].update(dir="rank0"))
    return d, "ranks share the part directory 'rank0'"


def _part_is_multi(d: Path):
    multi(d)
    inner = json.loads((d / "manifest.json").read_text())
    (d / "rank1" / "manifest.json").write_text(json.dumps(inner))
    reseal_part(d, 1)
    return d, "the part of rank 1 is itself a multi-rank bundle"


def _file_symlink(d: Path):
    bundle(d)
    ln(d / "model.safetensors", "/etc/passwd")
    sha = sha256(Path("/etc/passwd"))
    size = Path("/etc/passwd").stat().st_size
    edit(d, lambda m: m["files"].update({"model.safetensors": {"sha256": sha, "bytes": size}}))
    return d, "model.safetensors is a symbolic link"


def _manifest_symlink(d: Path):
    bundle(d)
    real = d.parent / "elsewhere.json"
    (d / "manifest.json").rename(real)
    (d / "manifest.json").symlink_to(real)
    return d, "manifest.json is a symbolic link"


def _file_is_fifo(d: Path):
    bundle(d)
    (d / "rng.safetensors").unlink()
    os.mkfifo(d / "rng.safetensors")
    return d, "rng.safetensors is not a plain file"


def _listed_dotdot(d: Path):
    bundle(d)
    edit(d, lambda m: m["files"].update({"..": {"sha256": "0" * 64}}))
    return d, "'..', which is not a plain file name"


def _header(data: bytes, phrase: str):
    def build(d: Path):
        bundle(d)
        put_file(d, "model.safetensors", data)
        return d, phrase
    return build


def _header_too_deep(d: Path):
    bundle(d)
    put_file(d, "model.safetensors",
             st(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b""))
    return d, "nested deeper than 256 levels"


def _raw(change, phrase):
    """The manifest rewritten by Python's own json.dumps (which writes NaN and Infinity)."""
    def build(d: Path):
        bundle(d)
        m = json.loads((d / "manifest.json").read_text())
        change(m)
        (d / "manifest.json").write_text(json.dumps(m))    # NB: allow_nan, as a hand edit may
        return d, phrase
    return build


def _text(old: str, new: str, phrase: str):
    """The manifest's text with ``old`` replaced by ``new`` (what no dict can hold)."""
    def build(d: Path):
        bundle(d)
        text = json.dumps(json.loads((d / "manifest.json").read_text()))
        assert old in text, old
        (d / "manifest.json").write_text(text.replace(old, new, 1))
        return d, phrase
    return build


def _section(key, value, phrase, section):
    def build(d: Path):
        bundle(d)
        edit(d, lambda m: m.update({section: {**(m.get(section) or {}), key: value}}))
        return d, phrase
    return build


def _header_without_the_manifests_tensors(d: Path):
    """A safetensors header of 5,000 tensors (300 kB; the issue's was 90 MB), none of them one
    the manifest names: `inspect` used to list it, `run` refused it."""
    bundle(d)
    head = {f"junk/{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
            for i in range(5_000)}
    put_file(d, "model.safetensors", st(head, b""))
    return d, "tensor 'model/0.weight' named in the manifest is missing from the bundle's " \
              "model.safetensors"


def _unnamed_tensor(d: Path):
    bundle(d)
    tensors = read_bundle(d).tensors("model")
    put_file(d, "model.safetensors", save({**tensors, "model/stowaway": torch.zeros(3)}))
    return d, "its tensor files hold 1 tensor(s) the manifest does not name (e.g. " \
              "'model/stowaway')"


def _size_before_hash(d: Path):
    """A 32 GiB (sparse) model.safetensors listed first with its size, and a later file whose
    size is wrong: refused by the size, without hashing 32 GiB first (that took 159 s)."""
    bundle(d)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(32 << 30)
    edit(d, lambda m: (m["files"]["model.safetensors"].update(bytes=32 << 30),
                       m["files"]["rng.safetensors"].update(
                           bytes=m["files"]["rng.safetensors"]["bytes"] + 1)))
    assert list(json.loads((d / "manifest.json").read_text())["files"])[0] == "model.safetensors"
    return d, "rng.safetensors does not match its sha256 in the manifest ("


def _optimizer_group_without_params(d: Path):
    bundle(d)
    edit(d, lambda m: m["optimizer"].update(param_groups=[{"__dict__": [["lr", 0.1]]}]))
    return d, "the bundle's optimizer state is not {state:"


def _batch_names_missing_tensor(d: Path):
    bundle(d)
    edit(d, lambda m: m["batch"].update({"__tensor__": "batch/nope"}))
    return d, "tensor 'batch/nope' named in the manifest is missing"


def _rank_observed(d: Path):
    multi(d)
    edit(d, lambda m: m["ranks"]["1"].update(observed=[1]))
    return d, "field 'ranks.1.observed' is a list, not null or an object"


_DEV = "not a device such as 'cpu' or 'cuda:0'"
# what `run` ended in a traceback for (exit 1) while `inspect` accepted it (issue 23), and what
# `run` refused (exit 2) while `inspect` accepted it
DECODED = {
    "observed-loss-NaN": _raw(lambda m: m.update(observed={"loss": float("nan")}),
                              "manifest.json holds NaN, which is not a finite JSON number"),
    "observed-summary-Infinity": _raw(lambda m: m.update(
        observed={"summary": {"loss": float("inf")}}), "holds Infinity"),
    "observed-step-minus-Infinity": _raw(lambda m: m.update(observed={"step": float("-inf")}),
                                         "holds -Infinity"),
    "observed-loss-1e999": _text('"observed": null', '"observed": {"loss": 1e999}',
                                 "holds 1e999, which is not a finite JSON number"),
    "captured-on-list": _section("captured_on", ["cpu"], "field 'devices.captured_on' is a "
                                 f"list, {_DEV}", "devices"),
    "captured-on-object": _section("captured_on", {"type": "cpu"}, "is an object, " + _DEV,
                                   "devices"),
    "captured-on-empty": _section("captured_on", "", "is a string, " + _DEV, "devices"),
    "captured-on-integer": _section("captured_on", 0, "is an integer, " + _DEV, "devices"),
    "observed-250-deep": _section("x", json.loads("[" * 250 + "]" * 250), "field 'observed' is "
                                  "nested deeper than 8 levels", "observed"),
    "observed-summary-list": _section("summary", [1], "field 'observed.summary' is a list",
                                      "observed"),
    "task-accumulate-string": _section("accumulate", "2", "field 'task.accumulate' is a string",
                                       "task"),
    "task-autocast-not-a-dtype": _section("autocast", "Tensor", "field 'task.autocast' is a "
                                          "string, not null or a torch dtype name", "task"),
    "grad-scaler-missing-keys": _field("grad_scaler", {"scale": 1.0}, "field 'grad_scaler' is "
                                       "an object, not {} or {scale, growth_factor"),
    "environment-threads-1e9": _section("torch_threads", 10 ** 9, "field "
                                        "'environment.torch_threads' is an integer, not an "
                                        "integer from 1 to 65536", "environment"),
    "code-sources-list": _section("sources", ["/x.py"], "field 'code.sources' is a list",
                                  "code"),
    "entry-control-characters": _field("entry", "evil.py:task\x1b]0;pwned\x07", "field 'entry' "
                                       r"'evil.py:task\x1b]0;pwned\x07' is not of the form "
                                       "'pkg.module:function'"),
    "entry-file-from-bundle-absolute": _field("entry_file_from_bundle", "/etc/passwd",
                                              "field 'entry_file_from_bundle' is a string, not "
                                              "null or a path to a .py file relative"),
    "entry-file-NUL": _field("entry_file", "/x\x00.py", "field 'entry_file' is a string, not "
                             "null or a path"),
    "history-is-string": _field("history", "x", "unreadable history"),
    "lookback-is-list": _field("lookback", [], "unreadable lookback"),
    "rng-numpy-position-1e9": _section("numpy", ["MT19937", 10 ** 9, 0, 0.0], "'numpy' is "
                                       "['MT19937', 1000000000, 0, 0.0], not ['MT19937', "
                                       "position 0..624", "rng"),
    "rng-accel-count-negative": _section("accel", {"cuda": -1}, "'accel' is {'cuda': -1}",
                                         "rng"),
    "batch-names-a-missing-tensor": _batch_names_missing_tensor,
    "model-lists-a-parameter-not-in-its-file": _model_field(
        "params", ["0.weight", "0.bias", "2.weight", "2.bias", "ghost"],
        "tensor 'model/ghost' named in the manifest is missing from the bundle's "
        "model.safetensors"),
    "optimizer-group-without-params": _optimizer_group_without_params,
    "st-header-5000-tensors-none-of-the-manifests": _header_without_the_manifests_tensors,
    "st-tensor-the-manifest-does-not-name": _unnamed_tensor,
    "size-checked-before-hashing-32GiB": _size_before_hash,
    "rank-observed-is-list": _rank_observed,
}

BIG = "world-size-2**20-listed-parts-absent"     # 55 MB of manifest: seconds, not milliseconds
HOSTILE_BUNDLES = {
    # size and shape of the manifest
    "world-size-1e8-300-byte-manifest": _world_1e8,
    "world-size-2**20-listed-parts-absent": _world_cap_parts_missing,
    "world-size-exceeds-listed-parts": _world_claims_more_than_listed,
    "manifest-65MiB-sparse": _manifest_65mib,
    "manifest-100k-deep-nesting": _deep_manifest,
    "manifest-300-deep-batch": _deep_manifest_300,
    "manifest-5M-empty-objects": _many_values,
    "manifest-5000-digit-integer": _huge_int,
    # wrong types
    "files-is-a-list": _field("files", [], "field 'files' is a list"),
    "files-entry-not-object": _files_entry("x", "is a string, not {sha256: string, bytes: "
                                           "integer}"),
    "files-bytes-negative": _files_entry({"sha256": "0" * 64, "bytes": -1}, "not {sha256"),
    "step-is-string": _field("step", "3", "field 'step' is a string, not null or an integer"),
    "step-is-float": _field("step", 1.5, "field 'step' is a number, not null or an integer"),
    "step-is-bool": _field("step", True, "field 'step' is a boolean"),
    "entry-is-number": _field("entry", 5, "field 'entry' is an integer, not a non-empty string"),
    "world-size-string": _field("world_size", "2", "field 'world_size' is a string"),
    "rank-negative": _field("rank", -1, "field 'rank' is an integer, not null or an integer >= 0"),
    "optimizer-is-list": _field("optimizer", [], "field 'optimizer' is a list"),
    "observed-is-list": _field("observed", [1], "field 'observed' is a list"),
    "devices-is-string": _field("devices", "cpu", "field 'devices' is a string"),
    "kind-unknown": _field("kind", "multi-rank-v9", "field 'kind' is a string, not absent or "
                           "'multi-rank'"),
    "model-params-not-list": _model_field("params", "w", "field 'model' is an object, not an "
                                          "object with params and buffers"),
    "model-aliases-not-strings": _model_field("aliases", {"a": 1}, "field 'model'"),
    "rng-is-null": _field("rng", None, "field 'rng' is null, not an object"),
    "schema-not-string": _field("schema", ["nanbisect.bundle/1"], "no 'nanbisect.bundle/N' "
                                "schema"),
    "schema-version-huge": _field("schema", "nanbisect.bundle/" + "9" * 5000, "unreadable schema"),
    # multi-rank parts
    "rank-entry-without-dir": _rank_entry({"manifest_sha256": "x"}, "has no plain directory "
                                          "name in the bundle ('dir': None)"),
    "rank-entry-not-object": _rank_entry("rank1", "('dir': None)"),
    "rank-dir-not-string": _rank_entry({"dir": 5}, "('dir': 5)"),
    "rank-dir-dotdot": _rank_dir_outside("dotdot"),
    "rank-dir-absolute": _rank_dir_outside("absolute"),
    "rank-dir-symlink": _rank_dir_symlink,
    "rank-key-not-a-number": _rank_entry({"dir": "rank1"}, "lists 3 parts", rank="one"),
    "ranks-share-a-dir": _ranks_share_dir,
    "rank-part-claims-other-rank": _rank_part_lies_about_rank,
    "rank-part-is-multi-rank": _part_is_multi,
    "ranks-is-list": _top_field("ranks", [], "field 'ranks' is a list"),
    "world-size-null-multi": _top_field("world_size", None, "world_size is null"),
    # links and special files
    "tensor-file-symlink-etc-passwd": _file_symlink,
    "manifest-symlink": _manifest_symlink,
    "tensor-file-is-fifo": _file_is_fifo,
    "file-named-dotdot": _listed_dotdot,
    # safetensors headers (the manifest vouches for the file: only its contents are hostile)
    "st-header-longer-than-file": _header(st(HEAD, n=10 ** 6), "the header claims 1000000 "
                                          "bytes, the file has"),
    "st-header-2**63": _header(st(HEAD, n=2 ** 63), "the header claims 9223372036854775808"),
    "st-header-not-json": _header(st(b"{not json"), "safetensors header is not valid JSON"),
    "st-header-json-list": _header(st(b"[1, 2]"), "the header is not a JSON object"),
    "st-header-leading-space": _header(st(b" " + json.dumps(HEAD).encode()),
                                       "the header is not a JSON object"),
    "st-header-not-utf8": _header(st(b'{"\xff": 1}'), "not valid JSON (UnicodeDecodeError"),
    "st-entry-not-object": _header(st({**HEAD, "a": "x"}), "tensor 'a' is a string, not an "
                                   "object"),
    "st-dtype-unknown": _header(st(with_tensor(dtype="F17")), "unknown dtype 'F17'"),
    "st-dtype-not-string": _header(st(with_tensor(dtype=32)), "unknown dtype 32"),
    "st-shape-negative": _header(st(with_tensor(shape=[-2, -3])), "has shape [-2, -3], not a "
                                 "list of at most 64 sizes >= 0"),
    "st-shape-not-list": _header(st(with_tensor(shape="23")), "has shape '23'"),
    "st-shape-bool": _header(st(with_tensor(shape=[True, 6])), "has shape [True, 6]"),
    "st-shape-2**64": _header(st(with_tensor(shape=[2 ** 64, 0])), "not a list of at most 64"),
    "st-shape-65-dims": _header(st(with_tensor(shape=[1] * 63 + [2, 3])), "at most 64 sizes"),
    "st-shape-times-dtype-mismatch": _header(st(with_tensor(shape=[2, 2])), "shape [2, 2] of F32 "
                                             "needs 16 bytes, its data_offsets span 24"),
    "st-shape-overflow": _header(st(with_tensor(shape=[2 ** 40, 2 ** 40, 2 ** 40])), "needs"),
    "st-offsets-out-of-range": _header(st({**HEAD, "a": {**HEAD["a"], "data_offsets": [32, 1000],
                                                         "shape": [242]}}),
                                       "the tensors cover 1000 bytes of data, the file holds 56"),
    "st-offsets-overlap": _header(st({**HEAD, "a": {**HEAD["a"], "data_offsets": [8, 32]}}),
                                  "starts at byte 8 of the data, not 32 (tensors overlap"),
    "st-offsets-reversed": _header(st(with_tensor(data_offsets=[56, 32])), "not [begin, end]"),
    "st-offsets-three": _header(st(with_tensor(data_offsets=[32, 56, 60])), "not [begin, end]"),
    "st-offsets-missing": _header(st({**HEAD, "a": {"dtype": "F32", "shape": [2, 3]}}),
                                  "has data_offsets None"),
    "st-data-truncated": _header(st(HEAD, DATA[:-4]), "the tensors cover 56 bytes of data, the "
                                 "file holds 52"),
    "st-data-trailing-bytes": _header(st(HEAD, DATA + b"xxxx"), "the file holds 60"),
    "st-duplicate-tensor-name": _header(st(json.dumps(HEAD).encode()[:-1] + b', "a": '
                                           + json.dumps(HEAD["a"]).encode() + b"}"),
                                        "duplicate key 'a'"),
    "st-metadata-not-strings": _header(st({**HEAD, "__metadata__": {"x": 1}}), "'__metadata__' "
                                       "is not an object of strings"),
    "st-empty-file": _header(b"", "0 bytes, shorter than a header"),
    "st-7-byte-file": _header(b"\x01" * 7, "7 bytes, shorter than a header"),
    "st-header-100k-deep": _header_too_deep,
    "st-header-trailing-nul": _header(st(json.dumps(HEAD).encode() + b"\0\0"), "not valid JSON"),
    # every decode is total: values of the wrong type or non-finite numbers anywhere (issue 23)
    **DECODED,
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == BIG else c
                                  for c in sorted(HOSTILE_BUNDLES)])
def test_hostile_bundle_is_one_line_exit_2(tmp_path, case):
    path, phrase = HOSTILE_BUNDLES[case](tmp_path / "b")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    t0, cpu0 = time.monotonic(), time.process_time()
    with pytest.raises(BadInput) as ei:
        summarize(path)
    # NB: bounded by the bytes really there: a 55 MB manifest listing 2**20 parts takes seconds
    # (about 10 of CPU time here; bounded by that, not by the clock, which a loaded machine
    # stretches several times over)
    if case == BIG:
        assert time.process_time() - cpu0 < 30 and time.monotonic() - t0 < 300
    else:
        assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert phrase in msg, msg
    assert "\n" not in msg and str(path) in msg
    if case != BIG:   # (the same read again: 10 s of CPU more; `inspect` reads it as above)
        res = invoke("inspect", path)
        assert res.code == 2 and res.stderr.strip().splitlines() == [f"nanbisect: error: {msg}"]
        assert "Traceback" not in res.stderr
        with pytest.raises(BadInput):   # the run path opens bundles the same way
            b = read_bundle(path)
            b.all_tensors() if not b.multi_rank else [b.part(r).all_tensors() for r in range(2)]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before   # nothing written


@pytest.mark.parametrize("case", sorted(DECODED))
def test_run_refuses_what_inspect_refuses(tmp_path, case):
    """One validation for both: `run` gives the same one line as `inspect` (before: a
    traceback and exit 1 for non-finite numbers and devices.captured_on of another type), and
    writes nothing (no report directory)."""
    path, phrase = DECODED[case](tmp_path / "b")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    seen = invoke("inspect", path)
    ran = invoke("run", path, "--out", tmp_path / "out")   # any other exception fails here
    assert seen.code == ran.code == 2, (seen, ran)
    assert ran.stderr == seen.stderr and len(ran.stderr.strip().splitlines()) == 1
    assert phrase in ran.stderr, ran.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
