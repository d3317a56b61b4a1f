"""Batches large next to the model: the kept steps' copies are written to a file by a thread of
their own (`nanbisect.guard.spill`), the snapshot keeps the cadence its time cost chose, and a
fault born in an update is still rebuilt bit-exact from the file; a full disk only brings the
snapshot sooner."""
from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from nanbisect import Guard, NonFiniteStep
from nanbisect.guard import keep
from nanbisect.guard.spill import Spill, Spilled

from helpers.held import count_takes
from test_rebuild import CPU, inf_at_step_5, task  # noqa: F401  (the same Net and entry)
from nanbisect.bundle.format import read_bundle
from nanbisect.replay.replayer import Replayer

ENTRY = "tests/guard/test_rebuild.py:task"
ROWS = 4096          # a batch of 4096 x 64 float32: 1 MiB, about 2.5x the state's bytes


def big_batch(i: int) -> torch.Tensor:
    return torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(i))


def settle(keeper: keep.Keeper, deadline: float = 30.0) -> None:
    """Wait (at most ``deadline`` s) until the writer reported every record handed to it."""
    end = time.monotonic() + deadline
    while keeper._spill.pending() and time.monotonic() < end:
        keeper._spill.collect(keeper._spilled)
        time.sleep(0.01)


def test_big_batches_are_spilled_and_the_snapshot_keeps_its_cadence(tmp_path):
    """Before, each kept step passed the memory share at once and a snapshot was written every
    other step. Now the snapshot comes when its time cost says (or when the file passes its
    cap), and what stays in memory is within the share beyond the step being written."""
    t = task()
    guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
    at = count_takes(guard)
    k = guard._keeper
    over, check = [], k.over_share
    k.over_share = lambda: over.append(check()) or over[-1]
    for i in range(16):
        guard.step(big_batch(i))
        settle(k)          # (a loaded machine's writer may lag a step: not what is tested)
    assert True not in over and len(at) < 8, at   # before: a snapshot every other step
    spilled = [r.step for r in k.records if isinstance(r.tensors, Spilled)]
    assert spilled and spilled == [r.step for r in k.records][:len(spilled)], spilled
    assert k._copies_in_memory() <= keep.RECORD_SHARE * k.state_bytes + \
        k.records[-1].tensor_bytes
    assert k._spill.disk_bytes == sum(r.tensor_bytes for r in k.records
                                      if isinstance(r.tensors, Spilled))
    where, writer = Path(k._store._dir), k._spill._thread
    assert (where / "kept.bin").stat().st_size >= k._spill.disk_bytes
    assert writer.name == "nanbisect-spill" and writer.is_alive()
    guard.close()
    assert not where.exists() and not writer.is_alive()


def test_a_fault_born_in_an_update_is_rebuilt_bit_exact_from_spilled_steps(tmp_path):
    """An infinite learning rate at step 5; the snapshot of step 0 and steps 0-4 read back from
    the spill's file: the bundle is step 5 as it began, the rebuild bit-exact, and the replay
    finds the NaN in the optimizer."""
    def at_step_4(i, guard):
        if i == 4:
            settle(guard._keeper)
            # each step's copy alone passes the share: every one is in the file
            assert [isinstance(r.tensors, Spilled) for r in guard._keeper.records] == [True] * 5

    err = inf_at_step_5(tmp_path, "b", batches=big_batch, after=at_step_4)
    obs = err.observed
    assert (obs["step"], obs["first"]) == (5, "param")
    rb = obs["rebuild"]
    assert (rb["from_step"], rb["steps"], rb["fidelity"]) == (0, 5, "bit-exact")
    bundle = read_bundle(err.bundle)
    (kept,) = bundle.tensors("batch").values()      # step 5's batch, as training gave it
    assert torch.equal(kept, big_batch(5))
    assert Replayer(bundle, CPU).run().phase == "optimizer"


def test_a_full_disk_stops_the_spill_and_brings_the_snapshot_sooner(tmp_path, monkeypatch):
    """A real tmpfs with room for the snapshot (about 0.4 MiB) but not for the spill: each
    write fails, the copies stay in memory, the snapshot comes sooner (which empties what the
    steps kept), nothing is said, the training goes on, and a fault born in an update is still
    rebuilt bit-exact."""
    from helpers.mounts import tmpfs

    with tmpfs(tmp_path / "tmp", "1m") as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        t = task()
        guard = Guard(t, entry=ENTRY, out=tmp_path / "b")
        at = count_takes(guard)
        k = guard._keeper
        with warnings.catch_warnings(record=True) as said, pytest.raises(NonFiniteStep) as e:
            warnings.simplefilter("always")
            for i in range(12):
                if i == 10:
                    for g in t.optimizer.param_groups:
                        g["lr"] = float("inf")
                guard.step(big_batch(i))
                settle(k)
                if i == 9:
                    assert k._spill.failed is not None and "No space" in k._spill.failed
                    assert not any(isinstance(r.tensors, Spilled) for r in k.records)
        assert [str(w.message) for w in said] == []
        assert len(at) >= 4, at                 # sooner than K: memory held the copies
        rb = e.value.observed["rebuild"]
        assert rb["fidelity"] == "bit-exact" and rb["from_step"] == at[-1]
        guard.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.int64, torch.float64,
                                   torch.complex64, "1500 tensors"])
def test_the_file_gives_back_every_dtype_and_shape(dtype):
    """Raw bytes with dtypes and shapes kept beside them: what goes in comes back, a 0-d and an
    empty tensor too, and a batch of more tensors than one write call takes (a list of
    samples); a newer snapshot makes the old entries unreadable, not wrong."""
    class Rec:
        def __init__(self, ts):
            self.tensors = ts
    g = torch.Generator().manual_seed(0)
    if dtype == "1500 tensors":
        ts = {f"a{i}": torch.randn(3, generator=g) for i in range(1500)}
        ts |= {"b": torch.ones(()), "c": torch.empty(0, 4)}
    else:
        ts = {"a": (torch.randn(5, 3, generator=g) * 100).to(dtype),
              "b": torch.ones((), dtype=dtype), "c": torch.empty(0, 4, dtype=dtype)}
    spill, rec, got = Spill(), Rec(dict(ts)), []
    try:
        assert spill.put(rec, 100)
        end = time.monotonic() + 30
        while not isinstance(rec.tensors, Spilled) and time.monotonic() < end:
            spill.collect(lambda r, n: got.append(n))
            time.sleep(0.01)
        assert got == [100] and sorted(rec.tensors) == sorted(ts)
        for k, v in ts.items():
            back = rec.tensors[k]
            assert back.dtype == v.dtype and back.shape == v.shape and torch.equal(back, v)
        spill.reset([])
        with pytest.raises(RuntimeError, match="newer snapshot"):
            rec.tensors["b"]
    finally:
        spill.close()
        spill.scratch.close()


def test_a_guard_dropped_unclosed_ends_its_writer(tmp_path):
    """A Guard whose failure ended the loop and that nobody closes: its writer thread holds no
    reference to it, so collecting the Guard ends the thread and removes its directory."""
    import gc

    guard = Guard(task(), entry=ENTRY, out=tmp_path / "b")
    for i in range(3):
        guard.step(big_batch(i))
    writer, where = guard._keeper._spill._thread, Path(guard._keeper._store._dir)
    assert writer.is_alive() and where.is_dir()
    del guard
    gc.collect()
    writer.join(30)
    assert not writer.is_alive() and not where.exists()
