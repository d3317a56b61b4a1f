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
  the gradient of sqrt(0) born in the last stage's backward;
- megatron-core's ``forward_backward_pipelining_without_interleaving``, 2 stages, 4 micro-batches
  (examples/megatron_pipeline.py, on CPU through its shims): 0/0 on stage 0 in micro-batch 2;
- one stage replayed alone (``--ranks``), its receives served from the capture's tape: the stage
  that computed it gets the same verdict, the other names the rank its message came from.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TEST_TASKS
from helpers.bundles import culprit_report, one_bundle
from helpers.paths import ROOT
from nanbisect.bundle.format import read_bundle, read_manifest

EXAMPLE = ROOT / "examples" / "pipeline_train.py"
MEGATRON = ROOT / "examples" / "megatron_pipeline.py"
ENV = {"NANBISECT_RANK_TIMEOUT": "60"}    # a replay that hangs ends, and says where


def _capture(script: Path, args: list[str], ranks: int) -> Path:
    bundle = one_bundle(script, args, ranks, env=ENV, timeout=180)
    assert bundle.name == "step000002" and read_bundle(bundle).multi_rank
    return bundle


def _replay(bundle: Path, out: Path, *more: str) -> dict:
    return culprit_report(bundle, out, *more, env=ENV)


def _ranks(report: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in report["ranks"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_schedules_forward_nan_names_stage_0_its_op_and_micro_batch(tmp_path, kind):
    bundle = _capture(EXAMPLE, [kind, str(tmp_path / "out")], 2)
    # the Guard's re-run recorded the step's sends and receives as such (never waited twice)
    entries = read_manifest(bundle / "rank1")["collectives"]["entries"]
    assert {e["kind"] for e in entries if e["op"] == "c10d.send.default"} == {"p2p"}, entries
    # every receive kept as what arrived (served to a replay of this rank alone), from rank 0;
    # the NaN in micro-batch 2's
    got = [e for e in entries if e["op"] == "c10d.recv_.default"]
    assert {(e["kind"], tuple(e["group"])) for e in got} == {("tape", (0, 1))}, got
    assert [e["out_nan"] > 0 for e in got[:4]] == [False, False, True, False], got
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
    if kind == "gpipe":
        # stage 0 alone, its gradients' receives served from the tape: the same verdict
        alone = _replay(bundle, tmp_path / "r0", "--ranks", "0")
        keys = ("rank", "phase", "module", "module_call", "op", "micro_batch", "source")
        assert {k: alone["culprit"][k] for k in keys} == {k: c[k] for k in keys}, alone
        assert _ranks(alone)[0]["phase"] == "forward", alone["ranks"]
        # stage 1 alone: it received the NaN from rank 0 (the capture's record of its send)
        got = _replay(bundle, tmp_path / "r1", "--ranks", "1")
        assert (got["culprit"]["rank"], got["culprit"]["op"]) == (0, None), got["culprit"]
        assert "--ranks 0" in " ".join(got["notes"])


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
    # one stage alone, its receives served from the tape: the same verdict for the stage
    # that computed it; the other names where its gradient came from
    alone = _replay(bundle, tmp_path / "r1", "--ranks", "1")["culprit"]
    assert (alone["rank"], alone["phase"], alone["module"], alone["op"], alone["node"]) == (
        1, "backward", "dist", c["op"], c["node"]), alone
    other = _replay(bundle, tmp_path / "r0", "--ranks", "0")
    assert (other["culprit"]["rank"], other["culprit"]["op"]) == (1, None), other["culprit"]
    assert "at capture, rank 1 fed it non-finite input" in " ".join(other["notes"])


@pytest.mark.slow
def test_megatron_cores_1f1b_schedule_names_stage_0_and_the_micro_batch(tmp_path):
    """Megatron's batched sends and receives (``send_forward_recv_backward``: activations out,
    gradients in, in one batch) each carry what their name says."""
    bundle = _capture(MEGATRON, [str(tmp_path / "out")], 2)
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (report["phase"], c["rank"], c["op"], c["micro_batch"]) == (
        "forward", 0, "aten.div.Tensor", 2), c
    assert c["source"].startswith("examples/megatron_pipeline.py:"), c["source"]
    ranks = _ranks(report)
    assert (ranks[0]["how"], ranks[0]["phase"]) == ("computed", "forward"), ranks[0]
    got = ranks[1]
    assert (got["how"], got["from_ranks"], got["via"]["op"], got["via"]["phase"]) == (
        "received", [0], "c10d.recv_.default", "forward"), got
