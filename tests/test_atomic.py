"""Guard never loses a bundle (bundle/atomic.py, guard/write.py): writers racing for one name all
keep theirs, a bundle is never renamed over an existing path, and an ``out`` that disappears
after the Guard checked it still gets the bundle written (to the rescue directory, with a
warning)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
import torch
from conftest import ROOT, TASKS, TEST_TASKS

from nanbisect import Guard, NonFiniteStep
from nanbisect.bundle.atomic import place
from nanbisect.bundle.format import read_bundle, write_bundle


def test_place_never_replaces(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("new")
    (tmp_path / "b").mkdir()                      # even an empty directory is not replaced
    with pytest.raises(FileExistsError):
        place(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "f").read_text() == "new"
    assert place(tmp_path / "a", tmp_path / "b", unique=True) == tmp_path / "b-1"


M = {"entry": "m:f", "model": {"params": [], "buffers": [], "aliases": {}}, "batch": {},
     "rng": {}}


def test_write_bundle_unique_takes_the_next_free_name(tmp_path):
    one = write_bundle(tmp_path / "step1", M, {"batch": {"x": torch.ones(2)}})
    with pytest.raises(FileExistsError):
        write_bundle(tmp_path / "step1", M, {"batch": {"x": torch.ones(2)}})
    two = write_bundle(tmp_path / "step1", M, {"batch": {"x": torch.zeros(2)}}, unique=True)
    assert (one.name, two.name) == ("step1", "step1-1")
    assert read_bundle(one).tensors("batch")["x"].sum() == 2
    assert read_bundle(two).tensors("batch")["x"].sum() == 0


def test_four_processes_guarding_into_one_out_keep_four_bundles(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(TEST_TASKS / "guard_race.py"), str(out),
                               str(go)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    # every process has built its Guard and waits for the gun: then they write at once
    deadline = 120
    t0 = time.monotonic()
    while len(list(tmp_path.glob("ready-*"))) < 4:
        assert time.monotonic() - t0 < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    go.touch()
    results = [p.communicate(timeout=deadline) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-500:] for _, e in results]
    paths = sorted(o.strip() for o, _ in results)
    assert len(set(paths)) == 4, paths
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step000003", "step000003-1", "step000003-2", "step000003-3"], names
    for p in paths:
        b = read_bundle(p)                      # complete: every checksum verifies
        assert b.manifest["observed"]["step"] == 3


def test_out_removed_after_the_check_still_keeps_the_bundle(tmp_path, monkeypatch):
    sys.path.insert(0, str(TASKS))
    import nan_batch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "out"
    guard = Guard(nan_batch.task(), entry=str(TASKS / "nan_batch.py") + ":task", out=out,
                  start_step=3)
    shutil.rmtree(out)
    out.write_text("a file where the directory was")     # mkdir inside it now fails
    batch = list(zip(range(4), nan_batch.batches()))[3][1]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(NonFiniteStep) as e:
        warnings.simplefilter("always")
        guard.step(batch)
    assert e.value.bundle.parent == tmp_path / "tmp" / f"nanbisect-rescue-{os.getuid()}"
    assert read_bundle(e.value.bundle).manifest["observed"]["first"] == "loss"
    assert any(str(out) in str(w.message) and str(e.value.bundle) in str(w.message)
               for w in caught)
    assert out.read_text() == "a file where the directory was"


def test_guard_refuses_an_out_it_cannot_write_at_construction(tmp_path):
    """Found when the Guard is made, not when the NaN happens (and the bundle would be lost)."""
    from nanbisect.errors import BadInput

    sys.path.insert(0, str(TASKS))
    import nan_batch

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(BadInput, match="cannot be written there") as e:
        Guard(nan_batch.task(), entry=str(TASKS / "nan_batch.py") + ":task", out=blocker / "out")
    assert str(blocker / "out") in str(e.value) and "\n" not in str(e.value)
