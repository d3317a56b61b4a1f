"""Pipeline parallelism on real gloo ranks (docs/guide/multirank.md, "Pipeline parallelism"): a
NaN in a pipelined job is captured by the Guard without a hang and its replay names the stage
(rank) that computed it, its phase, module, op and micro-batch; the other stages `received` it
through a receive, from the rank that sent it.

- torch.distributed.pipelining, ScheduleGPipe and Schedule1F1B, 2 stages, 4 micro-batches
  (examples/pipeline_train.py, as the guide runs it): 0/0 in stage 0's masked mean in
  micro-batch 2;
- the same on 4 ranks, 2 stages x 2 data-parallel replicas: the other replica receives it through
  the gradient average;
- two stages written by hand (``Task(step_fn=...)``: send/recv forward, isend/irecv backward),
  the gradient of sqrt(0) born in the last stage's backward.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TEST_TASKS, cli
from helpers.bundles import run_ranks
from helpers.paths import ROOT
from nanbisect.bundle.format import read_bundle, read_manifest

EXAMPLE = ROOT / "examples" / "pipeline_train.py"
ENV = {"NANBISECT_RANK_TIMEOUT": "60"}    # a replay that hangs ends, and says where


def _capture(script: Path, args: list[str], ranks: int) -> Path:
    """The one bundle every rank of ``script`` wrote (each prints ``RANK r BUNDLE path``)."""
    p = run_ranks(script, args, ranks, timeout=180, env=ENV)
    said = {line.split()[1]: line.split()[3] for line in p.stdout.splitlines()
            if line.startswith("RANK ") and line.split()[2] == "BUNDLE"}
    assert len(said) == ranks and len(set(said.values())) == 1, p.stdout + p.stderr[-3000:]
    bundle = Path(next(iter(said.values())))
    assert bundle.name == "step000002" and read_bundle(bundle).multi_rank
    return bundle


def _replay(bundle: Path, out: Path, *more: str) -> dict:
    res = cli("run", str(bundle), "--out", str(out), "--no-remedies", *more, env=ENV,
              timeout=240)
    assert res.code == 1, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _ranks(report: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in report["ranks"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_schedules_forward_nan_names_stage_0_its_op_and_micro_batch(tmp_path, kind):
    bundle = _capture(EXAMPLE, [kind, str(tmp_path / "out")], 2)
    # the Guard's re-run recorded the step's sends and receives as such (never waited twice)
    kinds = {e["kind"] for e in read_manifest(bundle / "rank1")["collectives"]["entries"]}
    assert "p2p" in kinds, kinds
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (report["verdict"], report["phase"]) == ("culprit", "forward"), report["notes"]
    assert (c["rank"], c["module"], c["op"], c["micro_batch"]) == (
        0, "pool", "aten.div.Tensor", 2), c
    ranks = _ranks(report)
    assert ranks[0]["how"] == "computed" and ranks[0]["phase"] == "forward"
    got = ranks[1]
    assert got["how"] == "received" and got["from_ranks"] == [0], got
    assert got["via"]["op"] == "c10d.recv_.default" and got["via"]["phase"] == "forward"
    assert "rank 1 received it through c10d.recv_.default, in forward, from rank 0" in \
        " ".join(report["notes"])


@pytest.mark.slow
def test_pipeline_and_data_parallel_on_4_ranks(tmp_path):
    """Ranks 0 and 1 are replica 0's stages, 2 and 3 replica 1's: stage 0 of replica 0 computed
    it; its stage 1 received it through the receive; replica 1's stages through the gradient
    average, each from its own stage's replica."""
    bundle = _capture(EXAMPLE, ["gpipe", str(tmp_path / "out")], 4)
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (c["rank"], c["phase"], c["module"], c["micro_batch"]) == (0, "forward", "pool", 2)
    ranks = _ranks(report)
    assert ranks[0]["how"] == "computed"
    assert (ranks[1]["how"], ranks[1]["via"]["op"], ranks[1]["from_ranks"]) == (
        "received", "c10d.recv_.default", [0])
    for r, stage_replica in ((2, 0), (3, 1)):
        assert (ranks[r]["how"], ranks[r]["via"]["op"], ranks[r]["from_ranks"]) == (
            "received", "c10d.allreduce_.default", [stage_replica]), ranks[r]


@pytest.mark.slow
def test_a_hand_written_stage_born_in_backward_names_the_last_stage(tmp_path):
    """send/recv forward, isend/irecv backward: the gradient of sqrt(0) (a triplet's anchor
    equals its positive) is born in rank 1's backward; rank 0 received it through its irecv."""
    bundle = _capture(TEST_TASKS / "pipelined.py", ["p2p", str(tmp_path / "out")], 2)
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (report["phase"], c["rank"], c["module"]) == ("backward", 1, "dist"), c
    assert c["node"]["name"] == "PowBackward0", c["node"]
    ranks = _ranks(report)
    got = ranks[0]
    assert got["how"] == "received" and got["from_ranks"] == [1], got
    assert got["via"]["op"] == "c10d.recv_.default" and got["via"]["phase"] == "backward"
    assert ranks[1]["how"] == "computed"
    # a replay of some ranks cannot serve a receive yet: refused in one line, before any rank
    res = cli("run", str(bundle), "--ranks", "1", "--out", str(tmp_path / "r1"), env=ENV)
    assert res.code == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
    assert "drop --ranks" in res.stderr and not (tmp_path / "r1").exists()
