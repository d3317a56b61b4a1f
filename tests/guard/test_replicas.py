"""Replicas written once (the contract: "State that is identical on every rank of a data-parallel
group (DDP replicas) is written once, not once per rank"), and replicas out of sync as a finding.

Real processes: a gloo process group on CPU (`bundles.run_ranks`), 2 and 4 ranks,
tests/tasks/replicas.py; each capture runs once per module (fixtures), replays write their
reports under tmp_path.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.bundles import run_ranks
from helpers import TEST_TASKS, cli, invoke, run_json
from nanbisect import BadInput
from nanbisect.bundle.format import read_bundle, read_header
from nanbisect.guard.coord import ReplicaPlan, out_of_sync, share

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

TRAIN = TEST_TASKS / "replicas.py"
FC = "model/module.fc.weight"


def ranks_capture(func: str, ranks: int, out: Path) -> Path:
    """Train ``func``'s task under Guard on ``ranks`` ranks; return the bundle they wrote."""
    p = run_ranks(TRAIN, [func, str(out)], ranks)
    lines = [line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
             if line.startswith("BUNDLE ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-2000:]
    return Path(lines[0])


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory) -> Path:
    """4 ranks in sync; rank 1's forward takes sqrt of a negative number at step 1."""
    return ranks_capture("ddp_rank1_nan", 4, tmp_path_factory.mktemp("ddp4") / "g")


@pytest.fixture(scope="module")
def oos4(tmp_path_factory) -> Path:
    """4 ranks, healthy, odd ranks' fc.weight off by 0.25: copies [[0, 2], [1, 3]]."""
    return ranks_capture("ddp_out_of_sync", 4, tmp_path_factory.mktemp("oos4") / "g")


@pytest.fixture(scope="module")
def oos2(tmp_path_factory) -> Path:
    """2 ranks, healthy, rank 1's fc.weight off by 0.25."""
    return ranks_capture("ddp_out_of_sync", 2, tmp_path_factory.mktemp("oos2") / "g")


def size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def names(path: Path) -> list[str]:
    return sorted(read_header(path)) if path.exists() else []


def top(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


# --------------------------------------------------------------------------------------------
# (a) in sync: one replica on disk; (b) the replay is what it was


def test_in_sync_ddp_replicas_are_written_once(ddp4):
    replica = size(ddp4 / "rank0" / "model.safetensors") + size(
        ddp4 / "rank0" / "optimizer.safetensors")
    per_rank = size(ddp4 / "manifest.json") + sum(
        size(ddp4 / f"rank{r}" / n) for r in range(4)
        for n in ("batch.safetensors", "rng.safetensors", "manifest.json"))
    total = sum(f.stat().st_size for f in ddp4.rglob("*") if f.is_file()
                and "nanbisect-report" not in f.parts)
    assert replica > 20_000                     # the model and AdamW state dominate a replica
    assert total - per_rank <= 1.5 * replica    # written once; per rank it was 4 x replica
    for r in (1, 2, 3):
        assert sorted(p.name for p in (ddp4 / f"rank{r}").iterdir()) == [
            "batch.safetensors", "manifest.json", "rng.safetensors"]
    rep = top(ddp4)["replicas"]
    assert (rep["groups"], rep["out_of_sync"], rep["out_of_sync_count"]) == ([[0, 1, 2, 3]], [], 0)
    # every part reads back rank 0's tensors, bit for bit, through its references
    b = read_bundle(ddp4)
    # the collectives Guard recorded for --ranks (DDP's reduced gradients) are the same on
    # every rank too
    want = {role: b.part(0).tensors(role)
            for role in ("model", "optimizer", "collectives", "history")}
    assert len(want["model"]) == 4 and len(want["optimizer"]) == 12   # 4 x (step, exp_avg, ..sq)
    assert len(want["collectives"]) == 4                 # one reduced gradient per parameter
    assert list(want["history"]) == ["history/norms"]    # the steps' norms (Guard(history))
    for r in (1, 2, 3):
        part = b.part(r)
        for role, ts in want.items():
            got = part.tensors(role)
            assert got.keys() == ts.keys()
            assert all(got[n].dtype == t.dtype and torch.equal(   # bit for bit (NaN included)
                got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                for n, t in ts.items())
        assert not torch.equal(part.tensors("batch")["batch"], b.part(0).tensors("batch")["batch"])
    assert rep["shared_bytes"] == 3 * sum(t.numel() * t.element_size()
                                          for ts in want.values() for t in ts.values())
    shown = invoke("inspect", ddp4)
    assert shown.code == 0, shown.stderr
    count = 3 * sum(len(ts) for ts in want.values())
    assert (f"replicas  data-parallel group(s) [0-3]; {rep['shared_bytes']} bytes "
            f"({count} tensors) written once instead of per rank; replicas in sync"
            ) in shown.stdout
    assert "rank3/optimizer.safetensors" in shown.stdout and "in rank 0's file" in shown.stdout


def test_deduplicated_bundle_replays_to_the_same_culprit(ddp4, tmp_path):
    rep = run_json(ddp4, "--out", tmp_path / "rep")
    c = rep["culprit"]
    assert (c["rank"], c["phase"], c["op"], c["module"], c["module_call"]) == (
        1, "forward", "aten.sqrt.default", "module", 0)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1, 2, 3]
    assert rep["repro_result"]["reproduced"] is True
    assert rep["replicas_out_of_sync"] == []
    assert not any("replicas out of sync" in n for n in rep["notes"])


# --------------------------------------------------------------------------------------------
# (c) out of sync: written per rank, reported


def test_out_of_sync_copies_are_grouped_and_each_written_once(oos4):
    rep = top(oos4)["replicas"]
    assert rep["out_of_sync_count"] == 1 and rep["uncompared"] == []
    (row,) = rep["out_of_sync"]
    assert (row["tensor"], row["ranks"]) == ("model:module.fc.weight", [[0, 2], [1, 3]])
    assert row["max_abs_diff"] == pytest.approx(0.25, rel=1e-3)   # AdamW decay shrinks it a bit
    # each copy written by its lowest rank; rank 3 takes it from rank 1, the rest from rank 0
    assert FC in names(oos4 / "rank0" / "model.safetensors")
    assert names(oos4 / "rank1" / "model.safetensors") == [FC]
    assert not (oos4 / "rank2" / "model.safetensors").exists()
    assert not (oos4 / "rank3" / "model.safetensors").exists()
    shared3 = json.loads((oos4 / "rank3" / "manifest.json").read_text())["shared"]
    assert shared3["model.safetensors"] == {"rank": 0, "tensors": 4, "bytes": 9220,
                                            "from": {"1": [FC]}}
    assert shared3["optimizer.safetensors"]["rank"] == 0    # AdamW state: averaged gradients
    b = read_bundle(oos4)
    model = [b.part(r).tensors("model") for r in range(4)]
    assert torch.equal(model[3][FC], model[1][FC]) and torch.equal(model[2][FC], model[0][FC])
    assert (model[1][FC] - model[0][FC]).abs().max().item() == pytest.approx(0.25, rel=1e-3)
    assert all(torch.equal(m[n], model[0][n]) for m in model for n in m if n != FC)


def test_out_of_sync_replica_is_reported_by_inspect_and_the_run(oos2, tmp_path):
    assert FC in names(oos2 / "rank0" / "model.safetensors")     # written by both ranks
    assert names(oos2 / "rank1" / "model.safetensors") == [FC]
    shown = invoke("inspect", oos2)
    assert shown.code == 0, shown.stderr
    assert ("1 tensor(s) out of sync: model:module.fc.weight (ranks 0 vs 1, max |diff| "
            "0.25)") in shown.stdout
    rep = run_json(oos2, "--out", tmp_path / "rep", code=0)
    assert rep["verdict"] == "clean"        # a healthy step: the finding is the replicas
    (row,) = rep["replicas_out_of_sync"]
    assert (row["tensor"], row["ranks"]) == ("model:module.fc.weight", [[0], [1]])
    note = next(n for n in rep["notes"] if "replicas out of sync" in n)
    assert note.startswith("replicas out of sync on rank 1 (vs 0): the data-parallel "
                           "replicas differ (a bug of the job: unsynchronised init, a rank "
                           "skipping a step, non-deterministic update): 1 tensor(s): "
                           "model:module.fc.weight (ranks 0 vs 1, max |diff| 0.25)"), note
    assert note in (tmp_path / "rep" / "report.md").read_text()


# --------------------------------------------------------------------------------------------
# (d) hostile references: one line, exit 2, nothing followed outside the bundle


def _ref(change):
    def edit(m: dict) -> None:
        change(m["shared"])
    return edit


def _rename(new: str):
    return _ref(lambda s: s.__setitem__(new, s.pop("model.safetensors")))


HOSTILE = {
    "missing-rank": (_ref(lambda s: s["model.safetensors"].update(rank=7)),
                     "takes tensors of model.safetensors from rank 7, which is not a rank of "
                     "this bundle (world size 2)"),
    "own-rank": (_ref(lambda s: s["model.safetensors"].update(rank=1)),
                 "from rank 1, not a lower rank"),
    "missing-tensor": (_ref(lambda s: s["model.safetensors"].update(
        tensors=4, **{"from": {"0": ["model/no.such"]}})),
        "takes tensor 'model/no.such' of model.safetensors from rank 0, whose model.safetensors "
        "does not hold it"),
    "count-mismatch": (_ref(lambda s: s["model.safetensors"].update(tensors=99)),
                       "takes 99 tensors of model.safetensors from lower ranks, but their files "
                       "provide 3"),
    "other-file": (_rename("weights.safetensors"),
                   "takes tensors of weights.safetensors from rank 0, whose part has no "
                   "weights.safetensors"),
    "path-outside": (_rename("../rank0/model.safetensors"), "which is not a tensor file name"),
    "manifest-name": (_rename("manifest.json"), "which is not a tensor file name"),
    "batch": (_rename("batch.safetensors"), "every rank writes its batch and RNG itself"),
    "not-an-object": (_ref(lambda s: s.__setitem__("model.safetensors", "rank0")),
                      "its 'shared' entry for model.safetensors is not {rank: integer"),
    "shared-a-list": (lambda m: m.__setitem__("shared", []),
                      "field 'shared' is a list, not null or an object"),
}


def hostile(src: Path, dst: Path, change) -> Path:
    """A copy of ``src`` whose rank 1 part has ``change`` made to its manifest, resealed (the
    top manifest vouches for it again), so only the reference itself is hostile."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
    m1 = dst / "rank1" / "manifest.json"
    m = json.loads(m1.read_text())
    change(m)
    m1.write_text(json.dumps(m))
    t = top(dst)
    t["ranks"]["1"]["manifest_sha256"] = hashlib.sha256(m1.read_bytes()).hexdigest()
    (dst / "manifest.json").write_text(json.dumps(t))
    return dst


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_shared_reference_is_one_line_exit_2(oos2, tmp_path, case):
    change, phrase = HOSTILE[case]
    b = hostile(oos2, tmp_path / "b", change)
    for args in (("inspect", b), ("run", "--ckpt", b, "--out", tmp_path / "rep")):
        res = invoke(*args)
        assert res.code == 2, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and phrase in lines[0] and "Traceback" not in res.stderr, lines
    assert not (tmp_path / "rep").exists()


def test_hostile_reference_through_the_real_cli(oos2, tmp_path):
    b = hostile(oos2, tmp_path / "b", HOSTILE["missing-tensor"][0])
    res = cli("run", "--ckpt", b)
    assert res.code == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"nanbisect: error: bundle '{b}': the part of rank 1 takes tensor 'model/no.such' of "
        "model.safetensors from rank 0, whose model.safetensors does not hold it; the manifest "
        "was altered or damaged: re-capture the bundle"]


def test_a_part_opened_alone_says_to_open_the_whole_bundle(oos2):
    part = read_bundle(oos2 / "rank1")       # verified alone: its own files are sound
    with pytest.raises(BadInput, match=r"takes 3 tensors of model.safetensors from a lower "
                                       r"rank's part; open the whole bundle"):
        part.all_tensors()
    assert part.tensors("batch")["batch"].shape == (6, 16)   # what it holds itself still reads


def test_an_owner_file_altered_after_capture_is_refused(oos2, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(oos2, b, ignore=shutil.ignore_patterns("nanbisect-report"))
    f = b / "rank0" / "optimizer.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1                              # one bit of rank 0's (shared) AdamW state
    f.write_bytes(bytes(raw))
    whole = read_bundle(b, verify=False)
    with pytest.raises(BadInput, match=r"rank0/optimizer.safetensors does not match its sha256"):
        whole.part(1)                         # rank 1's own files are intact: the owner's is not


# --------------------------------------------------------------------------------------------
# the plan alone: more distinct copies than are compared tensor by tensor


def test_copies_beyond_the_compared_ones_share_with_their_own_copy():
    a, b = ("a" * 64, "float32", (2,)), ("b" * 64, "float32", (2,))
    keys = {"model": {"model/w": b, "model/v": a}}
    # ranks 0 and 1 broadcast their keys; rank 2's copy (b, a) was not compared: ranks 2 and 3
    plan = ReplicaPlan(rep={"model": [0, 1, 2, 2]},
                       known={"model": {0: {"model/w": a, "model/v": a},
                                        1: {"model/w": a, "model/v": b}}},
                       dp=[[0, 1, 2, 3]] * 4)
    tensors = {"model": {"model/w": torch.ones(2), "model/v": torch.zeros(2)}}
    kept2, shared2 = share(plan, 2, keys, tensors)
    assert kept2["model"].keys() == {"model/w"}            # its own copy: nobody lower has it
    assert shared2 == {"model.safetensors": {"rank": 0, "tensors": 1, "bytes": 8}}
    kept3, shared3 = share(plan, 3, keys, tensors)
    assert kept3["model"] == {}
    assert shared3 == {"model.safetensors": {"rank": 0, "tensors": 2, "bytes": 16,
                                             "from": {"2": ["model/w"]}}}
    rows, uncompared = out_of_sync(plan, {})
    assert uncompared == [2, 3]
    # w is the same on the compared ranks 0 and 1; v differs between them
    assert [(r["tensor"], r["ranks"]) for r in rows] == [("model:v", [[0], [1]])]
