"""What a capture killed half-way leaves (bundle/leftovers.py): never a directory that looks
like a bundle; a hidden staging directory that `find_leftovers` lists with its size and
`nanbisect clean` removes, while a young one (a capture that may still be running), bundles,
reports and other files are kept."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from conftest import FIXTURES, ROOT, TEST_TASKS, invoke

from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.leftovers import find_leftovers


def killed_capture(out, tmp_path):
    """Run a real capture in a child, kill -9 it mid-write; return its leftover."""
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, str(TEST_TASKS / "capture_killed.py"), str(out),
                          str(ready)], cwd=ROOT)
    t0 = time.monotonic()
    while not ready.exists():
        assert p.poll() is None and time.monotonic() - t0 < 120, "the capture never started"
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    [left] = find_leftovers([out])
    return left


def test_killed_capture_is_listed_and_cleaned(tmp_path):
    out = tmp_path / "out"
    left = killed_capture(out, tmp_path)
    assert left.kind == "tmp" and left.path.parent == out
    assert left.path.name.startswith(".step000001.tmp-")
    written = sum(f.stat().st_size for f in left.path.rglob("*") if f.is_file())
    assert left.bytes == written > 0
    assert not (out / "step000001").exists()          # nothing looks complete
    # a bundle and a user's file beside it
    shutil.copytree(FIXTURES / "healthy", out / "step000000",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    (out / ".my-hidden-notes").write_text("mine")

    res = invoke("clean", out)                     # just killed: too young to be sure
    assert res.code == 0 and "kept" in res.stdout and left.path.exists(), res.stdout
    res = invoke("clean", out, "--dry-run", "--min-age", "0")
    assert res.code == 0 and "would remove" in res.stdout and left.path.exists()
    res = invoke("clean", out, "--min-age", "0")
    assert res.code == 0 and f"removed {left.path}" in res.stdout, res.stdout
    assert not left.path.exists()
    read_bundle(out / "step000000")                # the bundle is intact
    assert (out / ".my-hidden-notes").read_text() == "mine"
    assert find_leftovers([out]) == []


def test_clean_keeps_a_leftover_holding_a_link(tmp_path):
    d = tmp_path / ".step000002.tmp-0123abcd"
    d.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, d / "model.safetensors")
    old = time.time() - 3600
    os.utime(d, (old, old))
    res = invoke("clean", tmp_path, "--min-age", "0")
    assert res.code == 0 and "links" in res.stdout, res.stdout
    assert d.exists() and victim.read_text() == "precious"


def test_clean_refuses_a_missing_directory(tmp_path):
    res = invoke("clean", tmp_path / "nope")
    assert res.code == 2 and "is not a directory" in res.stderr


def test_inspect_lists_bundles_and_leftovers_of_a_directory(tmp_path):
    out = tmp_path / "out"
    left = killed_capture(out, tmp_path)
    shutil.copytree(FIXTURES / "healthy", out / "step000000",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    res = invoke("inspect", out)
    assert res.code == 0, res.stderr
    assert "1 bundle(s) and 1 leftover(s)" in res.stdout and "step000000" in res.stdout
    assert f"{left.path}  {left.bytes} bytes" in res.stdout
    assert f"nanbisect clean {out}" in res.stdout
    listing = json.loads(invoke("inspect", out, "--json").stdout)
    assert listing["leftovers"][0]["bytes"] == left.bytes and listing["bundles"] == ["step000000"]
