"""A multi-rank Guard never loses its bundle because one rank's write fails (guard/parts.py): real
2-rank gloo runs (`bundles.run_ranks`: torchrun's environment, an agent-hosted store, a failed
rank stopping the other with SIGTERM) of tests/tasks/write_faults.py, whose step 1 fails on rank
1, with one rank's write made to fail: ENOSPC from a real, full tmpfs; the rank exiting; the
rank hanging. Each leaves a bundle marked partial, the failing rank's part in its rescue
directory, and a bounded wait (NANBISECT_WRITE_TIMEOUT=3 here), never the process group's."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from helpers.bundles import run_ranks
from helpers import TEST_TASKS, cli, invoke
from helpers.mounts import tmpfs
from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.describe import directory_summary

# slow (multi-rank runs): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

SCRIPT = TEST_TASKS / "write_faults.py"
TIMEOUT = 3
MESSAGES: dict[int, str] = {}


def train(tmp_path: Path, out: Path, fault: str, rank: int) -> tuple[dict, dict, float]:
    """Run write_faults.py with ``fault`` on ``rank``: (rank -> the bundle path it printed,
    rank -> exit status, seconds); rank -> its NonFiniteStep's message in ``MESSAGES``."""
    (tmp_path / "tmp").mkdir()
    t0 = time.monotonic()
    p = run_ranks(SCRIPT, [str(out)], 2, timeout=200, statuses=tmp_path / "statuses.json",
                  env={"TMPDIR": str(tmp_path / "tmp"), "NANBISECT_WRITE_TIMEOUT": str(TIMEOUT),
                       "WRITE_FAULT": fault, "WRITE_FAULT_RANK": str(rank)})
    took = time.monotonic() - t0
    said = {int(line.split()[1]): line.split(" ", 3)[3] for line in p.stdout.splitlines()
            if line.startswith("RANK ") and " BUNDLE " in line}
    MESSAGES.clear()
    MESSAGES.update({int(line.split()[1]): line.split(" ", 3)[3] for line in p.stdout.splitlines()
                     if line.startswith("RANK ") and " MESSAGE " in line})
    statuses = json.loads((tmp_path / "statuses.json").read_text())["statuses"]
    return said, {int(r): c for r, c in statuses.items()}, took


def rescued(tmp_path: Path, rank: int) -> Path:
    return tmp_path / "tmp" / f"nanbisect-rescue-{os.getuid()}" / f"step000001-rank{rank}"


def test_rank_0_out_of_space_leaves_a_partial_bundle_that_replays(tmp_path):
    """Rank 0 (which writes the replicas every rank shares) gets ENOSPC from the kernel: its part
    goes to its rescue directory, rank 1 rewrites its part whole (it took the model from rank
    0's) and adds the top manifest. `inspect` shows the bundle partial, `run` refuses it with
    one line, and `run --ranks 1` replays the rank it holds."""
    with tmpfs(tmp_path / "out", "2m") as out:
        said, statuses, _ = train(tmp_path, out, "enospc", 0)
        assert statuses == {0: 0, 1: 0}
        assert said[0] == said[1] == str(out / "step000001"), said
        assert MESSAGES[0].endswith(f"replay it with: nanbisect run {said[0]} --ranks 1 (a "
                                    "partial bundle: the other ranks could not write their parts)")
        b = read_bundle(said[0])                                  # verified: every listed part
        partial = b.manifest["partial"]
        assert partial["missing_ranks"] == [0] and list(b.manifest["ranks"]) == ["1"]
        reason = partial["reasons"]["0"]
        assert "No space left on device" in reason and str(rescued(tmp_path, 0)) in reason, reason
        one = b.part(1)
        assert "shared" not in one.manifest                       # whole: nothing from rank 0
        assert set(one.tensors("model")) == set(read_bundle(rescued(tmp_path, 0)).tensors("model"))
        assert sorted(p.name for p in out.iterdir()) == ["step000001"]   # no filler, no leftover

        res = invoke("inspect", said[0])
        assert res.code == 0 and "partial   rank 0 could not write its part" in res.stdout
        res = invoke("run", "--ckpt", said[0])
        assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "is partial: rank 0 could not write its part" in res.stderr
        assert "No space left on device" in res.stderr and "--ranks 1" in res.stderr
        res = invoke("run", "--ckpt", said[0], "--ranks", "0,1")
        assert res.code == 2 and "--ranks names rank 0," in res.stderr
        res = cli("run", "--ckpt", said[0], "--ranks", "1", "--out", tmp_path / "rep", "--json")
        assert res.code == 1, res.stdout[-2000:] + res.stderr
        culprit = json.loads(res.stdout)["culprit"]
        assert (culprit["rank"], culprit["op"]) == (1, "aten.sqrt.default")


def test_rank_that_exits_while_writing_leaves_a_partial_bundle(tmp_path):
    """Rank 1 exits (status 3) in its write; the launcher then SIGTERMs rank 0, as torchrun's
    agent does. Rank 0 holds the signal back, waits for rank 1 at most twice the write timeout,
    writes the bundle without it, and only then lets SIGTERM end it."""
    out = tmp_path / "out"
    said, statuses, took = train(tmp_path, out, "exit", 1)
    assert statuses == {0: -15, 1: 3}                 # rank 0 ended by the held-back SIGTERM
    assert said == {}                                  # neither got as far as printing
    (bundle,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    b = read_bundle(bundle)
    assert b.manifest["partial"]["missing_ranks"] == [1]
    assert "no word from it within" in b.manifest["partial"]["reasons"]["1"]
    assert set(b.part(0).tensors("model"))            # rank 0 wrote the model itself
    # what rank 1 was writing when it exited: a hidden staging directory, listed as a leftover
    left = directory_summary(out)["leftovers"]
    assert [Path(x["path"]).name.startswith(".step000001-rank1.tmp-") for x in left] == [True]
    assert took < 120


def test_rank_whose_write_hangs_is_bounded_by_the_write_timeout(tmp_path):
    """Rank 1's write hangs (an hour's sleep): after NANBISECT_WRITE_TIMEOUT it gives up on it,
    writes its part to the rescue directory, and both ranks raise NonFiniteStep with the partial
    bundle; the run ends in seconds, not at the process group's timeout (30 minutes)."""
    out = tmp_path / "out"
    said, statuses, took = train(tmp_path, out, "hang", 1)
    assert statuses == {0: 0, 1: 0}
    assert said[0] == said[1] == str(out / "step000001"), said
    b = read_bundle(said[0])
    reason = b.manifest["partial"]["reasons"]["1"]
    assert f"writing its part did not finish within {TIMEOUT}s" in reason, reason
    assert str(rescued(tmp_path, 1)) in reason
    rescue = read_bundle(rescued(tmp_path, 1))
    assert rescue.manifest["rank"] == 1 and "shared" not in rescue.manifest
    assert took < 120


def test_no_rank_can_write_every_rank_still_raises_with_its_part_rescued(tmp_path):
    """``out`` full for every rank (not even the bundle's staging directory, with its marker,
    can be made): no bundle; each rank's NonFiniteStep has bundle None and every rank's reason,
    and each rank's whole part is in its rescue directory."""
    with tmpfs(tmp_path / "out", "1m") as out:
        with open(out / "filler", "wb") as f:        # full before training starts (the Guard's
            try:                                     # check of `out` writes no byte: it passes)
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        said, statuses, _ = train(tmp_path, out, "", 0)
        assert statuses == {0: 0, 1: 0} and said == {0: "None", 1: "None"}, said
        for r in (0, 1):
            msg = MESSAGES[r]
            assert "no bundle could be written: no rank could write its part of the bundle" in msg
            assert msg.count("No space left on device") == 2, msg      # both ranks' reasons
            assert str(rescued(tmp_path, 0)) in msg and str(rescued(tmp_path, 1)) in msg
            assert "shared" not in read_bundle(rescued(tmp_path, r)).manifest
        assert sorted(p.name for p in out.iterdir()) == ["filler"]      # nothing half-written
