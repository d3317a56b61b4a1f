"""Hostile bundles, continued: what the checks must still let through (valid bundles, real
headers, limits raised for a real giant), terminal escapes, malformed state tags, the umask."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import ROOT, cli, invoke, one_line_exit_2
from nanbisect import BadInput
from nanbisect.bundle import bounded
from nanbisect.bundle.format import read_bundle, read_header
from nanbisect.bundle.describe import summarize, summary_text
from helpers.hostile import (_modes, bundle, edit, measured, multi)
from test_hostile import _deep_manifest, _world_1e8


def test_valid_bundles_still_read(tmp_path):
    """The checks refuse only what is wrong: real single- and multi-rank bundles pass."""
    one = bundle(tmp_path / "one", fresh=True)
    info = summarize(one)
    assert info["files"]["model.safetensors"]["tensors"] == 4 and info["checksums"] == "ok"
    assert set(read_bundle(one).all_tensors()) >= {"model/0.weight", "model/2.bias"}
    two = multi(tmp_path / "two", fresh=True)
    info = summarize(two)
    assert info["world_size"] == 2 and sorted(info["observed"]) == ["0", "1"]
    assert read_bundle(two).part(1).manifest["rank"] == 1
    for name in sorted(os.listdir(ROOT / "fixtures" / "bundles")):
        b = read_bundle(ROOT / "fixtures" / "bundles" / name)
        assert b.all_tensors(), name
        assert summarize(b.path)["checksums"] == "ok"


def test_read_header_accepts_what_save_file_writes(tmp_path):
    tensors = {"f": torch.randn(3, 5), "h": torch.zeros(2, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.0),
               "b": torch.tensor([True, False]), "u": torch.arange(3, dtype=torch.uint8),
               "c": torch.zeros(2, dtype=torch.complex64),
               "e": torch.zeros(0, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    head = read_header(tmp_path / "x.safetensors")
    assert sorted(head) == sorted(tensors)
    assert head["f"]["shape"] == [3, 5] and head["h"]["dtype"] == "BF16"


def test_too_many_tensors_is_bad_input(tmp_path, monkeypatch):
    save_file({f"t{i}": torch.zeros(1) for i in range(5)}, str(tmp_path / "x.safetensors"))
    monkeypatch.setattr(bounded, "MAX_TENSORS", 4)
    with pytest.raises(BadInput, match="5 tensors, more than the 4 nanbisect reads"):
        read_header(tmp_path / "x.safetensors")


def test_limits_can_be_raised_for_a_real_giant(tmp_path, monkeypatch):
    path = bundle(tmp_path / "b")
    size = (path / "manifest.json").stat().st_size
    monkeypatch.setenv("NANBISECT_MAX_MANIFEST_BYTES", str(size - 1))
    with pytest.raises(BadInput, match=f"has {size} bytes, more than the {size - 1} .*raise "
                                       "NANBISECT_MAX_MANIFEST_BYTES"):
        read_bundle(path)
    monkeypatch.setenv("NANBISECT_MAX_MANIFEST_BYTES", str(size))
    monkeypatch.setenv("NANBISECT_MAX_JSON_ITEMS", "10")
    with pytest.raises(BadInput, match="more than the 10 nanbisect reads"):
        read_bundle(path)
    monkeypatch.setenv("NANBISECT_MAX_JSON_ITEMS", "lots")
    res = invoke("inspect", path)
    assert res.code == 2 and "NANBISECT_MAX_JSON_ITEMS='lots' is not a number" in res.stderr
    monkeypatch.delenv("NANBISECT_MAX_JSON_ITEMS")
    assert read_bundle(path).manifest["step"] == 3


def test_inspect_text_escapes_terminal_control_characters(tmp_path):
    path = bundle(tmp_path / "b")
    edit(path, lambda m: m.update(created="2026\x1b]0;pwned\x07\r\nfake line",
                                  observed={"summary": {"loss": "\x1b[2J"}, "first": "x"}))
    text = summary_text(summarize(path))
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert "\\x1b]0;pwned" in text
    assert len(text.splitlines()) == len(summary_text(summarize(bundle(tmp_path / "c")))
                                         .splitlines())


def test_observed_of_odd_shape_still_prints(tmp_path):
    path = bundle(tmp_path / "b")
    edit(path, lambda m: m.update(observed={"r0": 5, "r1": "x"}))
    res = invoke("inspect", path)
    assert res.code == 0 and '"r0": 5' in res.stdout


# --------------------------------------------------------------------------------------------
# decode: malformed tagged values in a manifest are BadInput, and name only torch types


@pytest.mark.parametrize("meta", [
    {"__dtype__": "load"}, {"__dtype__": 5}, {"__torch__": "save"}, {"__device__": "nowhere:x"},
    {"__float__": "1e5"}, {"__float__": [1]}, {"__tuple__": 5}, {"__dict__": [[1]]},
    {"__dict__": [[[1], 2]]}, {"__dict__": 3}, {"__tensor__": ["x"]}, {"__what__": 1},
])
def test_decode_refuses_malformed_tags(meta):
    from nanbisect.bundle.state import decode

    with pytest.raises(BadInput):
        decode({"__dict__": [["x", meta]]}, {})


def test_rng_state_malformed_is_bad_input(tmp_path):
    from nanbisect.bundle.state import RngState

    b = read_bundle(bundle(tmp_path / "b"))
    good = b.manifest["rng"]
    RngState.decode(good, b.tensors("rng"))
    for bad in ({**good, "python": [3]}, {**good, "numpy": ["MT19937", 1, 0]},
                {**good, "python": [99, None]}, {**good, "accel": {"cuda": 2}}):
        with pytest.raises(BadInput, match="RNG state"):
            RngState.decode(bad, b.tensors("rng"))
    with pytest.raises(BadInput, match="RNG state"):
        RngState.decode(good, {k: v for k, v in b.tensors("rng").items()
                               if k != "rng/torch_cpu"})
    short = dict(b.tensors("rng"), **{"rng/torch_cpu": torch.zeros(3, dtype=torch.uint8)})
    with pytest.raises(BadInput, match="RNG state"):
        RngState.decode(good, short)


# --------------------------------------------------------------------------------------------
# umask: files a colleague can read


@pytest.mark.parametrize("umask, want", [(0o022, {("dir", 0o755), ("file", 0o644)}),
                                         (0o077, {("dir", 0o700), ("file", 0o600)}),
                                         (0o002, {("dir", 0o775), ("file", 0o664)})])
def test_bundle_files_follow_the_umask(tmp_path, umask, want):
    old = os.umask(umask)
    try:
        path = bundle(tmp_path / "b", fresh=True)
    finally:
        os.umask(old)
    assert _modes(path) == want
    assert len(list(path.glob("*.safetensors"))) == 4


@pytest.mark.slow
def test_capture_in_a_fresh_process_under_umask_022(tmp_path):
    here = Path(__file__).resolve().parent          # the test file's folder, and tests/ (helpers)
    code = (f"import os, sys; os.umask(0o022); sys.path[:0] = {[str(here), str(here.parent)]!r}\n"
            "import torch, helpers.hostile as h\n"
            f"h.bundle(__import__('pathlib').Path({str(tmp_path / 'b')!r}), fresh=True)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert _modes(tmp_path / "b") == {("dir", 0o755), ("file", 0o644)}


def test_run_reads_the_manifest_only_through_the_bounded_reader(tmp_path):
    """Issue 38 item 10: `run` (which reads the manifest before the pipeline does, to start the
    repro's interpreter early) refuses a manifest nested 100,000 levels deep as `inspect` does:
    one line, exit 2, no traceback, nothing written (before: a RecursionError, exit 1)."""
    path, phrase = _deep_manifest(tmp_path / "b")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for flags in ([path], ["--ckpt", path, "--target", "cuda"]):
        res = cli("run", *flags, "--out", tmp_path / "out")
        assert one_line_exit_2(res, phrase, str(path)) == invoke("inspect", path).stderr.strip()
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_world_size_1e8_through_the_cli_is_fast_and_small(tmp_path):
    """The issue's case end to end: a 300-byte manifest claiming 10^8 ranks."""
    path, phrase = _world_1e8(tmp_path / "b")
    baseline = measured("inspect", ROOT / "fixtures" / "bundles" / "healthy")
    assert baseline[0] == 0, baseline
    code, _, err, seconds, peak, cpu = measured("inspect", path)
    assert code == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
    # the CLI's own start (import torch) is most of it: compare with inspecting a real bundle.
    # By CPU time, the work each did: the wall clock of two processes one after the other also
    # holds what else the machine ran meanwhile (seconds, on a loaded -n 3 run)
    assert cpu < baseline[5] + 5 and peak < baseline[4] + 200, (cpu, peak, baseline)
    assert seconds < 60, (seconds, baseline)
