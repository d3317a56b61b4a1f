"""What a capture killed half-way leaves (bundle/leftovers.py): never a directory that looks
like a bundle; a hidden staging directory, carrying nanbisect's marker, that `find_leftovers`
lists with its size and `nanbisect clean` removes, while a young one (a capture that may still
be running), one without the marker (a user's `.ssh.old-20240101`, an older nanbisect's),
bundles, reports and other files are kept; `clean` looks only where nanbisect stages writes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import FIXTURES, ROOT, TEST_TASKS, aged, invoke, tree_digest

from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.leftovers import find_leftovers
from nanbisect.util.staging import MARKER, is_marked, make_staging_dir


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


@pytest.mark.slow
def test_killed_capture_is_listed_and_cleaned(tmp_path):
    out = tmp_path / "out"
    left = killed_capture(out, tmp_path)
    assert left.kind == "tmp" and left.path.parent == out and left.marked
    assert left.path.name.startswith(".step000001.tmp-") and is_marked(left.path)
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
    d = make_staging_dir(tmp_path / ".step000002.tmp-0123abcd")
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


@pytest.mark.slow
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


def test_clean_never_removes_by_name_alone(tmp_path):
    """The user's directories that have a staging name's shape (an 8-digit date matches the
    hex suffix), days old, are kept: the top-level one listed with why, the one in a
    subdirectory that is no bundle not even looked at."""
    ssh = tmp_path / ".ssh.old-20240101"
    (ssh / "keys").mkdir(parents=True)
    (ssh / "keys" / "id_ed25519").write_text("private key")
    data = tmp_path / "proj" / ".data.tmp-00c0ffee"
    data.mkdir(parents=True)
    (data / "train.bin").write_bytes(b"\0" * 1000)
    forged = tmp_path / ".step000003.tmp-89abcdef"     # a marker naming another directory
    forged.mkdir()
    (forged / MARKER).write_text('{"schema": "nanbisect.staging/1", "name": ".x.tmp-00000000"}')
    aged(ssh, data, forged)
    before = tree_digest(tmp_path)
    res = invoke("clean", tmp_path, "--min-age", "0")
    assert res.code == 0, res.stdout + res.stderr
    assert f"kept {ssh}: no nanbisect marker" in res.stdout, res.stdout
    assert f"kept {forged}: no nanbisect marker" in res.stdout
    assert "proj" not in res.stdout and "removed 0 leftover(s)" in res.stdout
    assert tree_digest(tmp_path) == before and ssh.is_dir() and data.is_dir() and forged.is_dir()
    # listed, not looked into: no size for a directory nanbisect did not mark
    [x] = [x for x in find_leftovers([tmp_path]) if x.path == ssh]
    assert (x.marked, x.bytes) == (False, None)
    assert "no nanbisect marker" in invoke("inspect", tmp_path).stdout


def test_clean_looks_in_bundles_not_in_other_subdirectories(tmp_path):
    """A report write killed in a bundle and a capture killed in the directory given are
    removed; the same leftovers one level down in a directory that is no bundle are not looked
    at; a pre-marker leftover (an older nanbisect's) in the bundle is listed and kept."""
    bundle = tmp_path / "step000000"
    shutil.copytree(FIXTURES / "healthy", bundle,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    report_left = make_staging_dir(bundle / ".nanbisect-report.tmp-0123abcd")
    (report_left / "report.json").write_text("{}")
    capture_left = make_staging_dir(tmp_path / ".step000001.tmp-0123abcd")
    deeper = make_staging_dir(tmp_path / "logs" / ".step000002.tmp-0123abcd", parents=True)
    older = bundle / ".nanbisect-report.old-fedcba98"     # no marker: before this version
    older.mkdir()
    (older / "report.md").write_text("# kept")
    aged(report_left, capture_left, deeper, older)
    res = invoke("clean", tmp_path, "--min-age", "0", "--dry-run")
    assert res.code == 0 and f"would remove {report_left}" in res.stdout, res.stdout
    assert f"would keep {older}: no nanbisect marker" in res.stdout and report_left.exists()
    res = invoke("clean", tmp_path, "--min-age", "0")
    assert res.code == 0 and "removed 2 leftover(s)" in res.stdout, res.stdout
    assert not report_left.exists() and not capture_left.exists()
    assert deeper.is_dir() and (older / "report.md").read_text() == "# kept"
    read_bundle(bundle)
    res = invoke("clean", tmp_path / "logs", "--min-age", "0")      # named: looked in
    assert res.code == 0 and not deeper.exists(), res.stdout
