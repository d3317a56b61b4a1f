"""Guard never loses a bundle (bundle/atomic.py, guard/freeze.py): writers racing for one name all
keep theirs, a bundle is never renamed over an existing path, and an ``out`` that disappears
after the Guard checked it still gets the bundle written (to the rescue directory, with a
warning)."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import pytest
import torch
from helpers import TASKS, TEST_TASKS, run_python, start_python
from helpers.mounts import tmpfs

from nanbisect import Guard, NonFiniteStep
from nanbisect.bundle.atomic import place
from nanbisect.bundle.format import read_bundle, write_bundle
from nanbisect.bundle.state import RngState


def test_place_never_replaces(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("new")
    (tmp_path / "b").mkdir()                      # even an empty directory is not replaced
    with pytest.raises(FileExistsError):
        place(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "f").read_text() == "new"
    assert place(tmp_path / "a", tmp_path / "b", unique=True) == tmp_path / "b-1"


_RNG: dict = {}
# the smallest manifest `read_bundle` accepts: a batch of one tensor, a real RNG state
M = {"entry": "m:f", "model": {"params": [], "buffers": [], "aliases": {}},
     "batch": {"__tensor__": "x", "requires_grad": False, "device": "cpu"},
     "rng": RngState.get([]).encode(_RNG)}


def tensors(x: torch.Tensor) -> dict:
    return {"batch": {"x": x}, "rng": _RNG}


def test_write_bundle_unique_takes_the_next_free_name(tmp_path):
    one = write_bundle(tmp_path / "step1", M, tensors(torch.ones(2)))
    with pytest.raises(FileExistsError):
        write_bundle(tmp_path / "step1", M, tensors(torch.ones(2)))
    two = write_bundle(tmp_path / "step1", M, tensors(torch.zeros(2)), unique=True)
    assert (one.name, two.name) == ("step1", "step1-1")
    assert read_bundle(one).tensors("batch")["x"].sum() == 2
    assert read_bundle(two).tensors("batch")["x"].sum() == 0


def test_four_processes_guarding_into_one_out_keep_four_bundles(tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    # four processes of their own (forked from the worker's fork server: torch imported once)
    procs = [start_python([str(TEST_TASKS / "guard_race.py"), str(out), str(go)],
                          tmp_path / f"p{i}") for i in range(4)]
    try:
        # every process has built its Guard and waits for the gun: then they write at once
        deadline = 120
        t0 = time.monotonic()
        while len(list(tmp_path.glob("ready-*"))) < 4:
            assert time.monotonic() - t0 < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        go.touch()
        results = [p.finish(timeout=deadline) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [r.code for r in results] == [0] * 4, [r.stderr[-500:] for r in results]
    paths = sorted(r.stdout.strip() for r in results)
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


def _fill(fs, leave: int = 0) -> None:
    """Fill the file system holding ``fs`` to the last byte (a real ENOSPC from the kernel), then
    give ``leave`` bytes back."""
    with open(fs / "filler", "wb", buffering=0) as f:
        with pytest.raises(OSError) as e:
            while True:
                f.write(b"\0" * 4096)
        assert e.value.errno == 28
        f.truncate(max(0, f.tell() - leave))


def _nan_guard(out):
    sys.path.insert(0, str(TASKS))
    import nan_batch

    guard = Guard(nan_batch.task(), entry=str(TASKS / "nan_batch.py") + ":task", out=out,
                  start_step=3)
    return guard, list(zip(range(4), nan_batch.batches()))[3][1]


def test_full_disk_safetensors_error_still_rescues_the_bundle(tmp_path, monkeypatch):
    """The issue's case: ``out`` on a full file system, room in $TMPDIR. safetensors raises its
    own SafetensorError ("No space left on device"), not an OSError: the bundle still goes to
    the rescue directory and NonFiniteStep is raised."""
    with tmpfs(tmp_path / "out", "256k") as out:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
        (tmp_path / "tmp").mkdir()
        guard, batch = _nan_guard(out)        # the Guard checked `out`: it was writable then
        _fill(out, leave=8192)    # room for the staging directory's marker and one small file
        with warnings.catch_warnings(record=True) as caught, pytest.raises(NonFiniteStep) as e:
            warnings.simplefilter("always")
            guard.step(batch)
        assert e.value.bundle.parent == tmp_path / "tmp" / f"nanbisect-rescue-{os.getuid()}"
        assert read_bundle(e.value.bundle).manifest["observed"]["first"] == "loss"   # verified
        said = [str(w.message) for w in caught if "could not write the bundle" in str(w.message)]
        assert len(said) == 1 and "Error while serializing" in said[0], said   # safetensors' own
        assert "No space left on device" in said[0] and str(e.value.bundle) in said[0]
        assert sorted(p.name for p in out.iterdir()) == ["filler"]   # nothing half-written left


def test_no_room_anywhere_still_raises_non_finite_step_without_a_bundle(tmp_path):
    """Every write of the process fails (RLIMIT_FSIZE in a child: EFBIG), the bundle's and the
    rescue's: NonFiniteStep all the same, bundle None, both reasons in its message; never a bare
    library exception, nothing half-written left."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # forked from the worker's fork server (this checkout's nanbisect, everything imported
    # before the limit is set)
    p = run_python([str(TEST_TASKS / "guard_file_limit.py"), str(tmp_path / "out"), "1024"],
                   env={**os.environ, "TMPDIR": str(tmp)}, timeout=120)
    assert p.code == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["bundle"] is None
    msg = got["message"]
    assert msg.startswith("non-finite training step 3: loss=nan") and "\n" not in msg
    assert "no bundle could be written: writing it into" in msg
    assert msg.count("File too large") == 2, msg          # into out, then into the rescue
    assert f"nanbisect-rescue-{os.getuid()}" in msg and got["error"] in msg
    assert list((tmp_path / "out").iterdir()) == []
    assert list((tmp / f"nanbisect-rescue-{os.getuid()}").iterdir()) == []
