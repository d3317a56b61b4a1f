"""nanbisect triage through the CLI: groups, counts, exit protocol, a corrupted bundle, cache."""
from __future__ import annotations

import json
import shutil

from conftest import FIXTURES, cli

from nanbisect.triage import normalise_module


def make_tree(root):
    for name in ["forward_nan_behind_mask", "backward_nan_custom_function", "nan_batch",
                 "healthy"]:
        shutil.copytree(FIXTURES / name, root / name,
                        ignore=shutil.ignore_patterns("nanbisect-report"))
    shutil.copytree(FIXTURES / "forward_nan_behind_mask", root / "night2" / "same_fault",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    broken = root / "corrupted"
    shutil.copytree(FIXTURES / "healthy", broken, ignore=shutil.ignore_patterns("nanbisect-report"))
    (broken / "model.safetensors").write_bytes(b"truncated")
    return root


def test_normalise_module():
    assert normalise_module("layers.3.mlp") == normalise_module("layers.17.mlp") == "layers.N.mlp"
    assert normalise_module("blocks.0.attn.qkv") == "blocks.N.attn.qkv"
    assert normalise_module("fc1") == "fc1"


def cache_entries(out) -> dict[str, float]:
    """What joblib's cache holds: one directory per cached call, with its output's mtime."""
    return {str(f.parent.relative_to(out)): f.stat().st_mtime
            for f in (out / "cache").rglob("output.pkl")}


def test_triage_groups_counts_errors_and_cache(tmp_path):
    root = make_tree(tmp_path / "night")
    out = tmp_path / "t"
    res = cli("triage", root, "--out", out, "--jobs", "2")
    assert res.code == 3, res.stdout + res.stderr                  # new signatures
    data = json.loads((out / "triage.json").read_text())
    sigs = {g["signature"]: g for g in data["signatures"]}
    sqrt = next(g for s, g in sigs.items() if s.startswith("aten.sqrt.default"))
    assert sqrt["count"] == 2 and "blocks.N.mlp.act" in sqrt["signature"]
    assert any(s.startswith("aten.div.Tensor · blocks.N.mlp.act · backward") for s in sigs)
    assert "input-nonfinite · data" in sigs
    assert [e["bundle"].endswith("corrupted") for e in data["errors"]] == [True]
    assert "sha256" in data["errors"][0]["error"]
    assert {b["bundle"].rsplit("/", 1)[1]: b["verdict"] for b in data["bundles"]}["healthy"] \
        == "clean"
    md = (out / "triage.md").read_text()
    assert "| 2 | `aten.sqrt.default" in md and "corrupted" in md

    # one cache entry per distinct bundle content (same_fault is a copy: it shares its entry)
    assert not any(b["cached"] for b in data["bundles"])
    entries = cache_entries(out)
    assert len(entries) == len(data["bundles"]) - 1

    # second run: the cache answers, and with every signature known the exit code says so
    (tmp_path / "known.json").write_text((out / "triage.json").read_text())
    res2 = cli("triage", root, "--out", out, "--known", tmp_path / "known.json", "--jobs", "2")
    assert res2.code == 2, res2.stdout                 # known only, but an error remains
    again = json.loads((out / "triage.json").read_text())
    assert all(b["cached"] for b in again["bundles"]) and len(again["bundles"]) == 5
    assert cache_entries(out) == entries               # nothing recomputed, nothing rewritten
    shutil.rmtree(root / "corrupted")
    assert cli("triage", root, "--out", out, "--known", tmp_path / "known.json").code == 1


def test_triage_all_clean_and_bad_root(tmp_path):
    shutil.copytree(FIXTURES / "healthy", tmp_path / "h" / "b",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    assert cli("triage", tmp_path / "h", "--out", tmp_path / "o").code == 0
    res = cli("triage", tmp_path / "nope", "--out", tmp_path / "o")
    assert res.code == 2 and "does not exist" in res.stderr
