"""The pure deciders and renderers, in-process and in milliseconds: the multi-rank plan, rank choice
and job report, the module-level producers, the triage signature, and the headline, markdown,
terminal text and page of every verdict. Built from records, with no torch.distributed and no
replay, so a renderer that breaks on one verdict is caught without a torchrun job."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import same_run

from nanbisect.locate.producers import backtrace, backward_producer, forward_producer, timeline
from nanbisect.multirank.verdict import choose_rank, decide, job_report
from nanbisect.records import (BadValue, Bucket, CallId, Comparison, ContextRow, Culprit,
                               Divergence, Fidelity, Losses, OpCheck, OpRef, Plan, RankResult,
                               RankRoot, RankSummary, ReproResult, RunFacts, Stats)
from nanbisect.replay.probe import CallStats, ParamGrad, ProbeTable
from nanbisect.report.model import Report
from nanbisect.report.page import to_html
from nanbisect.report.prose import headline, terminal, to_markdown
from nanbisect.nightly import signature
from nanbisect.util.recordjson import dumps

OK, NAN, NEGINF = Stats(0, 0, 0, 1.0), Stats(4, 0, 0, 2.0), Stats(0, 0, 6, 3.0)


def facts(observed=None) -> RunFacts:
    return RunFacts("b", "train.py:task", "cpu", "none", observed, Losses(1.0, "nan"))


# ------------------------------------------------------------------------------------------
# multi-rank


def summary(rank, phase=None, buckets=(), bad=()):
    return RankSummary(rank, phase, "nan" if phase else 1.0, "nan" if phase else None,
                       list(buckets), list(bad))


def bucket(in_nan=0, out_nan=0):
    return Bucket(0, ["fc.weight", "fc.bias"], in_nan, 0, out_nan, 0)


@pytest.mark.parametrize("summaries, plan", [
    ([summary(0), summary(1)], Plan(None, None)),
    ([summary(0), summary(1, "input", bad=[BadValue("batch", "x", 1, 0, 0)])], Plan("input", 1)),
    ([summary(0, "backward"), summary(1, "forward")], Plan("forward", 1)),
    # rank 1's gradients went into the reduction bad: it computed them
    ([summary(0, "backward", [bucket(0, 3)]), summary(1, "backward", [bucket(3, 3)])],
     Plan("backward", 1)),
    # nobody's went in bad, everyone's came out bad: the reduction
    ([summary(0, "backward", [bucket(0, 3)]), summary(1, "backward", [bucket(0, 3)])],
     Plan("grad-reduce", None)),
    ([summary(0), summary(1, "optimizer")], Plan("optimizer", 1)),
])
def test_decide(summaries, plan):
    assert decide(summaries) == plan


def root(op="aten.sqrt.default", collective=False):
    return RankRoot(op, 12, "row", 0, ["float32"], [[4]], collective)


def test_choose_rank():
    ar = root("c10d.allreduce_.default", True)
    assert choose_rank([ar, root()], 0) == (1, False)           # rank 1 computed it
    assert choose_rank([ar, ar], 0) == (0, True)                 # only received: communication
    assert choose_rank([None, None], 1) == (1, False)            # nothing traced: the plan's


def rank_result(rank, plan, phase=None, **kw):
    return RankResult(rank, plan=plan, summary=summary(rank, phase, kw.pop("buckets", ()),
                                                       kw.pop("bad", ())), **kw)


def job(results, observed=None):
    return job_report(facts(observed), len(results), "gloo", results)


def round_trip(x: dict) -> None:
    """``Report.from_json`` inverts ``to_json`` on report.json as written and read back."""
    x = json.loads(dumps(x))
    assert json.loads(dumps(Report.from_json(x).to_json())) == x


def render_all(r: Report) -> str:
    """Every renderer, as the CLI and the report directory use them; JSON must serialise."""
    json.dumps(r.to_json(), allow_nan=False)
    round_trip(r.to_json())
    to_html(r)
    terminal(r, Path("out"))
    return headline(r) + "\n" + to_markdown(r)


def test_job_input_nonfinite_names_the_rank_and_renders():
    plan = Plan("input", 1)
    r = job([rank_result(0, plan), rank_result(1, plan, "input",
                                               bad=[BadValue("batch", "x", 2, 0, 0)])])
    assert (r.verdict, r.classification, r.culprit) == ("input-nonfinite", "data", None)
    assert [b.name for b in r.input_nonfinite] == ["rank 1: x"]
    text = render_all(r)
    assert "before the step ran: batch 'rank 1: x' (nan=2" in text


def test_job_not_reproduced_and_clean():
    plan = Plan(None, None)
    results = [rank_result(0, plan), rank_result(1, plan)]
    r = job(results, observed={"0": None, "1": {"first": "loss"}})
    assert (r.verdict, r.classification) == ("not-reproduced", "transient")
    render_all(r)
    assert job(results, observed={"0": None, "1": None}).verdict == "clean"


def test_a_job_gets_the_one_rank_fidelity_rule():
    """A job's failure that does not come back on another CPU is unknown, not transient; a
    culprit found by a replay whose loss is beyond tolerance is replay-mismatch (one rule:
    `Fidelity` and `classify_not_reproduced`, as on one rank)."""
    from dataclasses import replace

    other = Fidelity([], [], True, True, hardware_changed=["cpu processor: A at capture, B now"])
    plan = Plan(None, None)
    results = [rank_result(0, plan), rank_result(1, plan)]
    f = replace(facts({"0": None, "1": {"first": "loss"}}), fidelity=other)
    r = job_report(f, 2, "gloo", results)
    assert (r.verdict, r.classification) == ("not-reproduced", "unknown")
    assert "cpu processor: A at capture, B now" in r.notes[-1] and "transient" in r.notes[-1]
    far = replace(other, bit_exact=False, loss_rel_diff=0.02, tolerance=1e-3,
                  tolerance_dtype="float32")
    assert (far.tier, far.mismatch, replace(far, loss_rel_diff=1e-7).tier) == (
        "mismatch", True, "within-tolerance")
    plan = Plan("grad-reduce", None)
    bad = [bucket(0, 3)]
    r = job_report(replace(facts(), fidelity=far), 2, "gloo",
                   [rank_result(0, plan, "backward", buckets=bad),
                    rank_result(1, plan, "backward", buckets=bad)])
    assert (r.verdict, r.classification) == ("culprit", "replay-mismatch")
    assert "replay: mismatch, loss off by a relative 0.02" in render_all(r)


def test_job_grad_reduce_is_communication():
    plan = Plan("grad-reduce", None)
    bad = [bucket(0, 3)]
    r = job([rank_result(0, plan, "backward", buckets=bad),
             rank_result(1, plan, "backward", buckets=bad)])
    assert (r.verdict, r.classification, r.phase) == ("culprit", "communication", "grad-reduce")
    assert (r.culprit.parameter, r.culprit.module) == ("fc.weight", "fc")
    assert "the collective (or the comm hook around it) is at fault" in render_all(r)


def test_job_collective_root_everywhere_is_communication():
    plan = Plan("backward", 0, through_collective=True)
    ar = root("c10d._reduce_scatter_base_.default", True)
    r = job([rank_result(0, plan, "backward", root=ar), rank_result(1, plan, "backward", root=ar)])
    assert (r.classification, r.phase, r.culprit.op) == (
        "communication", "grad-reduce", "c10d._reduce_scatter_base_.default")
    render_all(r)


def test_job_local_culprit_and_received_elsewhere():
    plan = Plan("forward", 1)
    culprit = Culprit("forward", "row", 0, ["float32"], [[4]], "m.py:3", "aten.sqrt.default", 12,
                      rank=1)
    r = job([rank_result(0, plan, "forward", root=root("c10d.allreduce_.default", True)),
             rank_result(1, plan, "forward", root=root(), culprit=culprit,
                         module_stats={"inputs": OK, "output": NAN, "grad_arriving": None,
                                       "grad_leaving": None})])
    assert r.culprit == culprit and r.classification == "unknown"
    text = render_all(r)
    assert "rank 0 received it through c10d.allreduce_.default in row call 0" in text
    assert "| 1 | forward | nan |" in text


def test_rank_results_survive_the_json_the_workers_write():
    res = rank_result(1, Plan("forward", 1), "forward", root=root(),
                      culprit=Culprit("forward", "", None, [], [], None, rank=1),
                      module_stats={"inputs": OK, "output": None, "grad_arriving": None,
                                    "grad_leaving": None},
                      context=[ContextRow(3, "aten.sqrt.default", "", None, "forward", True,
                                          False, None, True)],
                      inf_origin=OpRef("aten.exp.default", 1, "forward", "", None),
                      buckets=[bucket(1, 1)], bad=[BadValue("batch", "x", 1, 0, 0)])
    back = RankResult.from_json(json.loads(json.dumps(res.to_json())))
    assert back == res
    error = RankResult(2, error="rank 2 raised")
    assert RankResult.from_json(json.loads(json.dumps(error.to_json()))) == error


# ------------------------------------------------------------------------------------------
# module-level producers


def call(name, k, parent, end, inputs, output, grad_in=None, grad_out=None, order=None):
    return CallStats(CallId(name, k), parent, ["float32"], [[2]], end, order, inputs, output,
                     grad_in, grad_out)


def test_forward_producer_is_innermost_and_skips_absorbed_neg_inf():
    root_ = CallId("", 0)
    table = ProbeTable([
        call("", 0, None, 4, OK, NAN),
        call("attn", 0, root_, 0, OK, OK),               # -inf inside, absorbed: clean
        call("attn.mask", 0, CallId("attn", 0), 1, OK, NEGINF),
        call("mlp", 0, root_, 3, OK, NAN),
        call("mlp.act", 0, CallId("mlp", 0), 2, OK, NAN),  # the producer
    ], [])
    assert forward_producer(table, "nan").call == CallId("mlp.act", 0)
    assert forward_producer(table, "inf") is None or \
        forward_producer(table, "inf").call != CallId("attn.mask", 0)
    rows = backtrace(table, table.get(CallId("mlp.act", 0)), "forward", "nan")
    assert {r.module: r.role for r in rows}["mlp"] == "encloses culprit"
    assert [t.module for t in timeline(table, "forward")] == ["attn", "attn.mask", "mlp.act",
                                                              "mlp", ""]


def test_backward_producer_names_a_parameter_when_only_its_gradient_went_bad():
    table = ProbeTable([call("", 0, None, 1, OK, OK, OK, OK, 9),
                        call("fc", 0, CallId("", 0), 0, OK, OK, OK, OK, 8)],
                       [ParamGrad("fc.weight", NAN, 5, "fc")])
    c, param = backward_producer(table, "nan")
    assert (c.call, param) == (CallId("fc", 0), "fc.weight")


# ------------------------------------------------------------------------------------------
# every verdict renders


def comparison(ok=False):
    return Comparison(ok, 16, 3, 0.5, (1, 2), 1.5, 1.0, 0.5, 0.99, 0.1)


CULPRIT = Culprit("forward", "blocks.0.act", 1, ["float32"], [[4, 8]], "model.py:12",
                  "aten.sqrt.default", 40)
REPORTS = {
    "clean": Report("clean", None, None, None, None, facts()),
    "not-reproduced": Report("not-reproduced", "transient", None, None, None,
                             facts({"loss": "nan"})),
    "input-nonfinite": Report("input-nonfinite", "data", "input", "nan", None, facts(),
                              input_nonfinite=[BadValue("batch", "[0]", 1, 0, 0)]),
    "culprit": Report("culprit", "device", "forward", "nan", CULPRIT, facts(),
                      repro="repro/repro.py", repro_result=ReproResult(True, 1, "REPRODUCED"),
                      inf_origin=OpRef("aten.exp.default", 30, "forward", "blocks.0", 0),
                      context=[ContextRow(40, "aten.sqrt.default", "blocks.0.act", 1, "forward",
                                          True, False, None, True)],
                      op_check=OpCheck("aten.sqrt.default", 40, "mismatch", "kernel",
                                       [comparison()])),
    "mismatch": Report("culprit", "device", "forward", "mismatch", CULPRIT, facts(),
                       divergence=Divergence("forward", "loss", comparison()),
                       uncomparable=[OpCheck("npu.fused.default", 3, "uncomparable")]),
}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_every_verdict_renders(name):
    r = REPORTS[name]
    text = render_all(r)
    assert text.startswith(headline(r)) and f"# nanbisect report: {r.verdict}" in text
    data = r.to_json()
    assert data["schema"] == "nanbisect.report/1" and data["verdict"] == r.verdict
    assert (data["culprit"] is None) == (r.verdict != "culprit")


def test_headlines_say_what_happened():
    assert headline(REPORTS["culprit"]) == (
        "nan born in aten.sqrt.default in forward at module 'blocks.0.act' (call 1)")
    assert headline(REPORTS["mismatch"]).startswith(
        "target diverges from the reference first in aten.sqrt.default")
    assert "batch '[0]'" in headline(REPORTS["input-nonfinite"])


# ------------------------------------------------------------------------------------------
# triage signature


def test_signature_normalises_layers_and_names_non_culprits():
    data = REPORTS["culprit"].to_json()
    assert signature(data) == "aten.sqrt @ model.py:12 · blocks.N.act · forward · float32 · device"
    assert signature(REPORTS["input-nonfinite"].to_json()) == "input-nonfinite · data"
    assert signature(REPORTS["not-reproduced"].to_json()) == "not-reproduced · transient"
    changed = {**REPORTS["not-reproduced"].to_json(), "classification": "code-changed"}
    assert signature(changed) == "not-reproduced · code-changed"   # a fixed bug, not a transient
    assert signature(REPORTS["clean"].to_json()) is None


# ------------------------------------------------------------------------------------------
# Report.from_json


def test_from_json_inverts_to_json_with_every_field_filled():
    from nanbisect.records import (CompilerFinding, Finding, HistoryEntry, ModuleRepro, Node,
                                   OpRecording, ReplicaDiff, Remedy, StageError, StepRow,
                                   StepsWindow, Subset, TimelineRow, TraceRow)
    from nanbisect.records.ranks import RankReference
    cmp = Comparison(False, 8, 2, float("inf"), (1, 0), float("nan"), 1.0, 0.5, 0.9, 0.25, 1,
                     "why")
    culprit = Culprit("backward", "act", 0, ["float32"], [[4]], "t.py:3", "aten.sqrt.default", 7,
                      step=3, surfaced=OpRef("aten.mul.Tensor", 9, "backward", None, None),
                      samples=[1], node=Node("SqrtBackward0", "aten.sqrt.default", "t.py:3"),
                      likely_cause="a square root of a negative")
    fid = Fidelity(["t.py"], ["torch 2.4 at capture"], False, False, ["x"],
                   ["cpu: A at capture, B now"], True, 2e-4, 1e-3, "float32", True)
    ranks = [rank_result(0, Plan("forward", 0), "forward", buckets=[bucket(1, 1)],
                         root=root(), module_stats={"act": NAN, "fc": None},
                         reference=RankReference(None, 1.0, "loss", "inf")),
             RankResult(1)]
    r = Report(
        "culprit", "numerics", "backward", "nan", culprit,
        RunFacts("b", "t.py:task", "cpu", "cpu:float64", {"first": "loss"},
                 Losses(1.0, "nan", 1.0, False), fid),
        input_nonfinite=[BadValue("batch", "x", 1, 0, 0)],
        backtrace=[TraceRow(0, "act", 0, "culprit", OK, NEGINF)], notes=["n"], repro="repro.py",
        repro_result=ReproResult(True, 1, "nan"), inf_origin=OpRef("aten.exp", 2, "forward", "",
                                                                   0),
        context=[ContextRow(1, "aten.exp", "fc", 0, "forward", False, True, None, False)],
        divergence=Divergence("backward", "grad:fc.weight", cmp),
        op_check=OpCheck("aten.sqrt.default", 7, "mismatch", "kernel", [cmp], "d"),
        uncomparable=[OpCheck("npu::op", 3, "uncomparable")], ranks=ranks,
        timeline=[TimelineRow("act", 0, 1, 0, float("inf"))],
        module_repro=ModuleRepro("module_repro.py", None),
        surfaced_repro=ModuleRepro("s.py", ReproResult(False, None, "", ran=False)),
        op_recording=OpRecording(CallId("act", 0), "backward", 3, 40, ("forward", "backward")),
        replicas_out_of_sync=[ReplicaDiff("model:w", [[0], [1]], "inf", [2])],
        subset=Subset([1], 4, False, [0], "rank 0 sent it"),
        history=[HistoryEntry(1, float("nan"), 2.0, 1e-3, True)],
        history_findings=[Finding("lr-jump", "the lr jumped", 1, value=1.0, baseline=0.1,
                                  ratio=10.0)],
        steps=StepsWindow([StepRow(1, 1.0, "nan", 1.0, 0.5, True, "target failed")], 1, 2,
                          {"bit_exact": True}, 0.25),
        timings={"read": 0.5}, remedies=[Remedy("samples", "without rows [1]", "finite", 0.5,
                                               {"rows": [1]})],
        compiler=CompilerFinding("finite", "nan", "inductor", "lowerings", 3, None, "d"),
        errors=[StageError("remedies", "RuntimeError: x")])
    x = json.loads(dumps(r.to_json()))
    back = Report.from_json(x)
    assert json.loads(dumps(back.to_json())) == x
    assert back.culprit == culprit and back.divergence.phase == "backward"
    assert back.facts.fidelity.tier == fid.tier and back.facts.fidelity.faithful == fid.faithful


@same_run("overflow_then_nan")
def test_from_json_inverts_a_shipped_bundles_report(replayed):
    _, rep = replayed("overflow_then_nan")
    round_trip(rep)
    assert Report.from_json(rep).culprit.op == rep["culprit"]["op"]


def test_culprit_constructors_build_what_the_stages_built_by_hand():
    from types import SimpleNamespace as NS

    assert Culprit.phase_only("forward", rank=None) == Culprit("forward", "", None, [], [], None,
                                                               rank=None)
    assert Culprit.of_parameter("grad-reduce", "fc.weight", rank=2) == Culprit(
        "grad-reduce", "fc", None, [], [], None, rank=2, parameter="fc.weight")
    r = root()
    assert Culprit.of_root("backward", r, 1) == Culprit(
        "backward", "row", 0, ["float32"], [[4]], None, op=r.op, op_index=12, rank=1)
    assert Culprit.of_root("backward", None, 1) == Culprit.phase_only("backward", rank=1)
    t = NS(dtype="torch.float16", shape=(2, 3))
    assert Culprit.of_tensors("forward", CallId("act", 1), [t], op="aten.exp", op_index=4) == \
        Culprit("forward", "act", 1, ["float16"], [[2, 3]], None, "aten.exp", 4)
    assert Culprit.phase_only("forward").in_phase("backward").phase == "backward"
