"""``--ranks R,...``: replay some ranks of a multi-rank bundle alone (real multi-rank captures,
gloo, CPU; the replay processes run without any process group between them).

At capture, Guard re-runs the failing step on every rank and records what each collective gave
that rank; a replay of some ranks serves it to them. The culprit must be the lockstep replay's;
what a subset cannot decide (who fed a collective NaN when that rank is not replayed, whether a
collective corrupted finite inputs) is said in ``subset`` and the notes, never guessed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import cli, run_json
from test_multirank import ranks_capture

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow


def marks(tmp: Path) -> Path:
    d = tmp / "marks"
    d.mkdir(parents=True)
    return d


def culprit(rep: dict) -> tuple:
    c = rep["culprit"]
    return (c["rank"], c["phase"], c["op"], c["module"], c["module_call"])


@pytest.fixture(scope="module")
def rank1_nan(tmp_path_factory) -> Path:
    return ranks_capture("rank1_nan", tmp_path_factory.mktemp("sub2") / "g")


@pytest.fixture(scope="module")
def rank1_nan_4(tmp_path_factory) -> Path:
    return ranks_capture("rank1_nan", tmp_path_factory.mktemp("sub4") / "g", ranks=4)


@pytest.mark.parametrize("bundle", ["rank1_nan", "rank1_nan_4"])
def test_one_rank_alone_names_the_lockstep_culprit_in_one_process(bundle, request, tmp_path):
    b = request.getfixturevalue(bundle)
    world = json.loads((b / "manifest.json").read_text())["world_size"]
    lock_marks, alone_marks = marks(tmp_path / "l"), marks(tmp_path / "a")
    lockstep = run_json(b, "--out", tmp_path / "lockstep", "--remedy-budget", "4",
                        env={"MR_MARK_DIR": str(lock_marks)})
    alone = run_json(b, "--ranks", "1", "--out", tmp_path / "alone", "--remedy-budget", "4",
                     env={"MR_MARK_DIR": str(alone_marks)})
    assert culprit(alone) == culprit(lockstep) == (1, "forward", "aten.sqrt.default", "module", 0)
    assert len(list(lock_marks.iterdir())) == world          # lockstep: every rank
    assert [p.name.split("-")[0] for p in alone_marks.iterdir()] == ["rank1"]  # one process
    assert alone["subset"] == {"replayed": [1], "world_size": world, "decided": True,
                               "next_ranks": [], "why": None}
    assert [r["rank"] for r in alone["ranks"]] == [1]
    assert alone["repro_result"]["reproduced"] is True
    # remedies (issue 27): in lockstep the culprit rank cannot replay its step alone: listed as
    # skipped (no rank waits for it); alone it replays them, judged through its forward
    assert lockstep["remedies"] and all(
        m["outcome"] == "skipped" and "--ranks 1" in m["detail"]["reason"]
        for m in lockstep["remedies"])
    tried = [m for m in alone["remedies"] if m["outcome"] != "skipped"]
    assert tried and all(m["detail"]["judged_on"].startswith("this rank's forward")
                         for m in tried)
    assert alone["culprit"]["samples"] == lockstep["culprit"]["samples"] == [2]   # rank 1's row
    assert [(m["kind"], m["outcome"]) for m in tried][-1] == ("samples", "finite")


def test_collectives_identical_across_ranks_are_stored_once(rank1_nan_4):
    for r in (1, 2, 3):
        part = json.loads((rank1_nan_4 / f"rank{r}" / "manifest.json").read_text())
        assert part["collectives"]["ddp"]["params"]      # the reduced gradients were recorded
        assert "collectives.safetensors" in part["shared"]    # ... and are rank 0's bytes
        assert "collectives.safetensors" not in part["files"]


def test_a_rank_that_only_received_it_names_the_rank_to_replay(rank1_nan, tmp_path):
    res = cli("run", "--ckpt", rank1_nan, "--ranks", "0", "--json", "--out", tmp_path / "r")
    assert res.code == 1, res.stderr
    rep = json.loads(res.stdout)
    assert (rep["verdict"], rep["classification"]) == ("culprit", "unknown")
    assert culprit(rep) == (1, "forward", None, "", None)      # the rank and phase, not an op
    assert rep["subset"]["decided"] is False and rep["subset"]["next_ranks"] == [1]
    assert rep["ranks"][0]["reduction_in_bad"] is False
    assert rep["ranks"][0]["reduction_out_bad"] is True
    assert any("replay with --ranks 1 to find the op" in n for n in rep["notes"])
    shown = cli("run", "--ckpt", rank1_nan, "--ranks", "0", "--out", tmp_path / "t")
    assert "came from rank 1 (forward), which was not replayed" in shown.stdout


def test_a_rank_alone_with_a_reference(rank1_nan, tmp_path):
    rep = run_json(rank1_nan, "--ranks", "1", "--reference", "cpu", "--out", tmp_path / "r")
    assert culprit(rep)[:3] == (1, "forward", "aten.sqrt.default")
    assert rep["classification"] == "numerics"                # the reference fails too
    assert rep["ranks"][0]["reference"]["phase"] == "forward"


def test_tensor_parallel_and_fsdp2_ranks_alone(tmp_path):
    tp = ranks_capture("tp_rank1_nan", tmp_path / "tp")
    rep = run_json(tp, "--ranks", "1", "--out", tmp_path / "tp1")
    assert culprit(rep) == (1, "forward", "aten.sqrt.default", "row", 0)
    rep = run_json(tp, "--ranks", "0", "--out", tmp_path / "tp0")
    assert rep["ranks"][0]["root"]["op"] == "c10d.allreduce_.default"   # served, received
    assert rep["subset"]["next_ranks"] == [1]
    # code that issues a collective the capture did not: the tape does not fit, one line
    res = cli("run", "--ckpt", tp, "--ranks", "0", "--out", tmp_path / "extra",
              env={"EXTRA_COLLECTIVE_ON_REPLAY": "1"})
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "collective #0: the replay issued c10d.allreduce_.default writing [[3]]" in res.stderr
    assert "replay all ranks (drop --ranks)" in res.stderr and "Traceback" not in res.stderr
    fsdp = ranks_capture("fsdp_rank1_backward_nan", tmp_path / "fsdp")
    rep = run_json(fsdp, "--ranks", "1", "--out", tmp_path / "f1")
    assert culprit(rep) == (1, "backward", "aten.sqrt.default", "gate", 0)
    rep = run_json(fsdp, "--ranks", "0", "--out", tmp_path / "f0")
    assert rep["ranks"][0]["root"]["op"] == "c10d._reduce_scatter_base_.default"
    assert rep["subset"]["next_ranks"] == [1]


def test_a_faulty_collective_is_decided_only_with_every_rank(tmp_path):
    bundle = ranks_capture("comm_corrupt", tmp_path / "g")
    some = run_json(bundle, "--ranks", "1", "--out", tmp_path / "one")
    assert (some["classification"], some["subset"]["decided"]) == ("unknown", False)
    assert "needs all its participants' inputs" in some["subset"]["why"]
    everyone = run_json(bundle, "--ranks", "0,1", "--out", tmp_path / "all")
    assert (everyone["classification"], everyone["phase"]) == ("communication", "grad-reduce")
    assert everyone["subset"]["decided"] is True


@pytest.mark.parametrize("spec", ["5", "x", "", "-1"])
def test_bad_ranks_are_one_line_errors(rank1_nan, tmp_path, spec):
    res = cli("run", "--ckpt", rank1_nan, "--ranks", spec, "--out", tmp_path / "r")
    assert res.code == 2 and "Traceback" not in res.stderr
    assert "--ranks" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_ranks_need_a_bundle_that_recorded_its_collectives(tmp_path, fixture_bundle):
    captured = ranks_capture("tp_healthy", tmp_path / "g")   # nanbisect.capture: no re-run
    res = cli("run", "--ckpt", captured, "--ranks", "1", "--out", tmp_path / "r")
    assert res.code == 2 and "records no collectives" in res.stderr, res.stderr
    single = fixture_bundle("forward_nan_behind_mask")
    res = cli("run", "--ckpt", single, "--ranks", "0", "--out", tmp_path / "s")
    assert res.code == 2 and "has one rank; drop --ranks" in res.stderr, res.stderr


@pytest.mark.parametrize("edit", [
    lambda c: c.update(entries="x"),
    lambda c: c["entries"][0].update(shapes=[[-1]]),
    lambda c: c["entries"][0].update(op=["not", "a", "string"]),
    lambda c: c["entries"][0].update(extra=1),
    lambda c: c.update(ddp={"params": "module.fc.weight", "micro_batches": 1}),
])
def test_hostile_recorded_collectives_are_one_line_errors(rank1_nan, tmp_path, edit):
    import hashlib
    import shutil

    b = tmp_path / "b"
    shutil.copytree(rank1_nan, b, ignore=shutil.ignore_patterns("nanbisect-report"))
    part = b / "rank0" / "manifest.json"
    m = json.loads(part.read_text())
    edit(m["collectives"])
    part.write_text(json.dumps(m))
    top = json.loads((b / "manifest.json").read_text())
    top["ranks"]["0"]["manifest_sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
    (b / "manifest.json").write_text(json.dumps(top))
    res = cli("run", "--ckpt", b, "--ranks", "0", "--out", tmp_path / "r")
    assert res.code == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "recorded collectives" in res.stderr and "re-capture the bundle" in res.stderr
    assert not (tmp_path / "r").exists()


def test_the_sender_is_found_among_the_collective_s_participants(tmp_path):
    # 4-rank tensor parallel, rank 2's shard is corrupt: after the all-reduce every rank's loss
    # is NaN, but only rank 2 fed the all-reduce NaN: that is the rank to replay next
    bundle = ranks_capture("tp_rank2_nan", tmp_path / "g", ranks=4)
    rep = run_json(bundle, "--ranks", "0", "--out", tmp_path / "r0")
    assert rep["subset"]["next_ranks"] == [2] and rep["culprit"]["rank"] == 2
    rep = run_json(bundle, "--ranks", "2", "--out", tmp_path / "r2")
    assert culprit(rep) == (2, "forward", "aten.sqrt.default", "row", 0)


def test_a_fault_present_only_at_capture_is_never_blamed_on_the_collective(tmp_path):
    from test_multirank_reference import MOE, capture

    bundle = capture(MOE, "moe_ddp_broken", tmp_path / "g")
    # replayed without the fault, rank 1 computes finite gradients where the capture recorded
    # NaN going into the reduction: not reproduced, not "communication"
    rep = run_json(bundle, "--ranks", "0,1", "--out", tmp_path / "all", code=3)
    assert (rep["verdict"], rep["classification"]) == ("not-reproduced", "unknown")
    assert rep["subset"]["decided"] is False and "compute finite values" in rep["subset"]["why"]
    # with the fault on rank 1's target and a reference: the op check, not the reference's
    # served NaN, decides (device)
    rep = run_json(bundle, "--ranks", "1", "--reference", "cpu", "--inject",
                   f"{MOE}:rank1_broken", "--out", tmp_path / "one")
    assert (rep["classification"], rep["op_check"]["status"]) == ("device", "mismatch")
    assert rep["culprit"]["op"] == "nbtest.unpermute_backward.default"

