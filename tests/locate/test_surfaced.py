"""The NaN that hides in forward and surfaces in backward (issue 24): cross-phase provenance,
``culprit.surfaced``, ``inf_origin`` across phases, and the legitimate non-finite values that must
stay clean. Tiny models from tests/tasks/surfaced.py, captured and replayed in process."""
from __future__ import annotations

import json

import pytest
import torch

import nanbisect
import surfaced
from helpers import TEST_TASKS
from nanbisect.locate.provenance import culprit_root, points_to_forward
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.records import Culprit, OpRef, RankResult
from nanbisect.replay.recorder import OpRecorder
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.report.page import to_html
from nanbisect.report.prose import headline, terminal, to_markdown

TASKS = TEST_TASKS / "surfaced.py"


def line_of(text: str) -> int:
    return next(i for i, t in enumerate(TASKS.read_text().splitlines(), 1) if text in t)


def replay(tmp_path, func: str, batch=None, run_repro: bool = False):
    """Capture ``func``'s task on ``batch`` and replay it in process; (report, pass keys)."""
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(surfaced, func)(), surfaced.batch() if batch is None else batch,
                      bundle, entry=f"{TASKS}:{func}")
    passes = []
    report = run_bundle(bundle, RunOptions(run_repro=run_repro), tmp_path / "report",
                        progress=lambda key, text: passes.append(key))
    return report, passes


@pytest.mark.parametrize("func, op, made, surfaced_ops, bug", [
    ("where_sqrt", "aten.sqrt.default", "nan", {"aten.mul.Scalar"}, "BUG: sqrt of negatives"),
])
def test_where_over_a_bad_branch_is_born_in_forward(tmp_path, func, op, made, surfaced_ops, bug):
    """forward is finite (where drops the bad branch); backward multiplies the zero gradient by
    the branch's derivative there: the culprit is the branch's op in forward, the repro
    re-runs it, and surfaced names the backward op where the NaN showed."""
    r, passes = replay(tmp_path, func, run_repro=True)
    c = r.culprit
    # the report's phase is the birth's; where it showed is surfaced's (DESIGN, v5)
    assert (r.verdict, r.phase, r.failed_phase, r.kind) == ("culprit", "forward", "backward",
                                                            "nan")
    assert (c.phase, c.module, c.module_call, c.op) == ("forward", "act", 0, op)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "- first bad phase: forward" in md
    assert "Module calls around the culprit (backward order)" in md
    assert c.source.endswith(f"surfaced.py:{line_of(bug)}")
    s = c.surfaced
    assert (s.phase, s.module, s.module_call) == ("backward", "act", 0) and s.op in surfaced_ops
    assert s.op_index > c.op_index
    assert "cross-phase" in passes and r.op_recording.phases == ("forward", "backward")
    note = next(n for n in r.notes if "surfaced" in n)
    assert f"{made} born in {op} in forward (act, call 0), masked there by aten.where.self" in note
    assert r.repro_result.reproduced
    assert f"produces {made} from {made}-free inputs" in r.repro_result.output
    # the backward op gets a repro of its own where it shows the failure alone (log's 0/0),
    # not where it was handed the NaN (sqrt's saved result)
    if made == "nan":
        assert r.surfaced_repro is None and "surfaced-repro" not in passes
    else:
        assert r.surfaced_repro.result.reproduced
        assert (tmp_path / "report" / "repro" / "surfaced" / "inputs.safetensors").is_file()
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["culprit"]["surfaced"] == {"phase": "backward", "op": s.op, "module": "act",
                                           "module_call": 0, "op_index": s.op_index}
    assert data["op_recording"]["phases"] == ["forward", "backward"]
    assert data["phase"] == "forward"
    as_nan = "" if made == "nan" else " as nan"
    assert headline(r) == (f"{made} born in {op} in forward at module 'act' (call 0), "
                           f"surfaced{as_nan} in backward at {s.op}")


@pytest.mark.parametrize("func, inf_op, inf_phase, op, node, bug", [
    # log's backward divides the zero gradient by x = 0: forward's -inf starts the chain
    ("where_log", "aten.log.default", "forward", "aten.div.Tensor", "LogBackward0",
     "BUG: log(0)"),
    # div's backward divides by b*b = 0 itself (an inf born there), then multiplies it by 0
    ("where_div", "aten.div.Tensor", "backward", "aten.mul.Tensor", "DivBackward0",
     "BUG: 1/0"),
])
def test_an_infinity_behind_where_starts_the_chain_of_a_nan_born_in_backward(
        tmp_path, func, inf_op, inf_phase, op, node, bug):
    """The rule of birth: forward's infinity (log(0) = -inf, 1/0 = inf, dropped by where) is
    no NaN; the NaN is born in backward, where the branch's derivative meets the zero gradient
    (0/0, 0 * inf). The culprit is that backward op, its source the forward line that made its
    autograd node; the infinity is ``inf_origin``, the start of the chain."""
    r, passes = replay(tmp_path, func, run_repro=True)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind) == ("culprit", "backward", "nan")
    assert (c.phase, c.module, c.module_call, c.op, c.surfaced) == (
        "backward", "act", 0, op, None)
    assert c.source.endswith(f"surfaced.py:{line_of(bug)}")
    assert c.node.name == node
    assert c.node.forward_source.endswith(f"surfaced.py:{line_of(bug)}")
    o = r.inf_origin
    assert (o.op, o.phase, o.module, o.module_call) == (inf_op, inf_phase, "act", 0)
    assert o.op_index < c.op_index
    assert "cross-phase" in passes            # only forward could tell where the inf was born
    assert r.repro_result.reproduced
    assert "produces nan from nan-free inputs" in r.repro_result.output
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (data["culprit"]["phase"], data["culprit"]["surfaced"], data["inf_origin"]["op"]) == (
        "backward", None, inf_op)


def test_a_custom_function_that_saves_nan_in_forward(tmp_path):
    r, _ = replay(tmp_path, "saved_nan")
    c = r.culprit
    assert (c.phase, c.module, c.op) == ("forward", "act", "aten.sqrt.default")
    assert c.source.endswith(f"surfaced.py:{line_of('BUG: NaN saved for backward')}")
    assert (c.surfaced.phase, c.surfaced.op) == ("backward", "aten.mul.Tensor")
    assert any("which nothing in forward read (saved for backward)" in n for n in r.notes)


def test_layer_norm_fp16_constant_row_saved_rstd_inf(tmp_path):
    """native_layer_norm's output is finite, its saved rstd (output 2) is inf (a float16
    overflow): an infinity, not a NaN. The NaN is born in its backward, the culprit;
    native_layer_norm in forward is ``inf_origin``, the start of the chain."""
    r, _ = replay(tmp_path, "layer_norm_fp16", run_repro=True)
    c = r.culprit
    assert (c.phase, c.module, c.op, c.surfaced) == (
        "backward", "act", "aten.native_layer_norm_backward.default", None)
    assert c.source.endswith(f"surfaced.py:{line_of('nn.functional.layer_norm(x.half()')}")
    o = r.inf_origin
    assert (o.op, o.phase, o.module) == ("aten.native_layer_norm.default", "forward", "act")
    assert o.op_index < c.op_index
    out = r.repro_result.output             # the saved inf turned into NaN, alone
    assert r.repro_result.reproduced and "nan=0 inf=2\noutputs: nan=16" in out
    assert "REPRODUCED: aten.native_layer_norm_backward.default produces nan" in out
    assert "native_layer_norm" in to_markdown(r)


def test_a_fused_op_with_a_non_finite_secondary_output(tmp_path):
    r, _ = replay(tmp_path, "fused_secondary")
    c = r.culprit
    assert (c.phase, c.module, c.op) == ("forward", "act", "nbsurf.row_scale.default")
    assert (c.surfaced.phase, c.surfaced.op) == ("backward", "aten.mul.Tensor")
    assert r.inf_origin is None
    assert any("kept in output 1 of 2, which nothing in forward read" in n for n in r.notes)


def test_masked_attention_stays_legitimate(tmp_path):
    """The causal mask's -inf (born in masked_fill, recorded by the cross-phase pass) is not the
    culprit nor an inf origin: the NaN's root is the sqrt after the attention."""
    r, _ = replay(tmp_path, "masked_attention", surfaced.seq_batch())
    c = r.culprit
    assert (c.phase, c.module, c.op, c.surfaced.phase) == (
        "forward", "act", "aten.sqrt.default", "backward")
    assert r.inf_origin is None
    healthy, _ = replay(tmp_path / "healthy", "masked_attention_healthy", surfaced.seq_batch())
    assert healthy.verdict == "clean"


def test_norm_at_zero_backward_stays_clean(tmp_path):
    """torch's norm backward divides 0/0 at a zero row and masks it: not a failure, and not the
    culprit when a real one follows."""
    clean, _ = replay(tmp_path / "clean", "norm_at_zero")
    assert clean.verdict == "clean"
    r, _ = replay(tmp_path, "norm_at_zero_then_fault")
    assert (r.culprit.phase, r.culprit.module, r.culprit.op) == (
        "forward", "act", "aten.sqrt.default")


def test_a_nan_born_in_backward_costs_no_extra_pass(tmp_path):
    """A custom Function's backward makes the NaN from finite values: the backward root stands,
    surfaced is null, and forward is not recorded."""
    r, passes = replay(tmp_path, "backward_born")
    c = r.culprit
    assert (c.phase, c.module, c.op, c.surfaced) == ("backward", "act", "aten.mul.Tensor", None)
    # a custom Function's node: its name, no one forward op, the line that applied it
    assert (c.node.name, c.node.forward_op) == ("_BackwardNaNBackward", None)
    assert c.node.forward_source.endswith(f"surfaced.py:{line_of('_BackwardNaN.apply(x)')}")
    assert "cross-phase" not in passes and r.op_recording.phases == ()
    assert json.loads((tmp_path / "report" / "report.json").read_text())["culprit"][
        "surfaced"] is None


def test_micro_batches_name_the_call_and_micro_batch_it_was_born_in(tmp_path):
    r, _ = replay(tmp_path, "where_sqrt_accumulated", surfaced.accumulated_batch(),
                  run_repro=True)
    c = r.culprit
    assert (c.phase, c.module, c.module_call, c.micro_batch, c.op) == (
        "forward", "act", 1, 1, "aten.sqrt.default")
    assert c.surfaced.module_call == 1 and r.repro_result.reproduced


# ------------------------------------------------------------------------------------------
# the pieces: the recorder's autograd nodes, the trigger, the records and renderers


def record_step(fn, x: torch.Tensor, phases: set[str], nodes: bool = False):
    """Forward ``fn(x).sum()`` and backward under one recorder; (table, x's gradient mark)."""
    x = x.clone().requires_grad_()
    tracker = ModuleTracker(torch.nn.Identity(), map_nodes=True)
    rec = OpRecorder(tracker, phases=phases, nodes=nodes)
    with tracker, rec:
        y = fn(x).sum()
        rec.follow("backward")
        y.backward()
        rec.mark("x", x.grad)
    table, marks = rec.read()
    return table, [marks["x"]] if marks["x"] is not None else []


def test_a_backward_formula_knows_the_forward_op_that_made_its_node():
    x = torch.tensor([-1.0, 0.0, 2.0])
    table, _ = record_step(lambda t: torch.where(t > 0, torch.log(t.abs()), 0.0), x,
                           {"forward", "backward"}, nodes=True)
    log = next(o for o in table.ops if o.op == "aten.log.default")
    div = next(o for o in table.ops if o.op == "aten.div.Tensor" and o.phase == "backward")
    assert log.node is not None and div.node == log.node and div.formula
    custom = record_step(lambda t: surfaced._BackwardNaN.apply(t), x, {"backward"})[0]
    assert not any(o.formula for o in custom.ops if o.op == "aten.div.Tensor")


def test_only_a_failure_that_points_to_forward_triggers_the_extra_pass():
    x = torch.tensor([-1.0, 0.0, 2.0])
    for fn, expect in [(lambda t: torch.where(t > 0, torch.sqrt(t), 0.0), True),   # NaN saved
                       (lambda t: torch.where(t > 0, torch.log(t.abs()), 0.0), True),  # formula
                       (lambda t: surfaced._BackwardNaN.apply(t), False)]:    # born in backward
        table, starts = record_step(fn, x, {"backward"})
        assert points_to_forward(table, starts, culprit_root(table, starts, "nan"), "nan") \
            is expect


def test_surfaced_travels_through_json_records_and_renderers(tmp_path):
    s = OpRef("aten.mul.Scalar", 35, "backward", "act", 0)
    c = Culprit("forward", "act", 0, ["float32"], [[6, 8]], "m.py:3", "aten.sqrt.default", 3,
                surfaced=s)
    assert Culprit.from_json(json.loads(json.dumps(c.to_json()))) == c
    row = RankResult.from_json({"rank": 0, "culprit": c.to_json()})
    assert row.culprit.surfaced == s
    r, _ = replay(tmp_path, "where_sqrt")
    assert "surfaced: aten.mul.Scalar in backward" in terminal(r, tmp_path)
    assert "where it became visible" in to_html(r)


def test_a_module_owns_the_nodes_it_makes_before_handing_its_value_to_a_child():
    """A module that works on its input (mul, abs, sqrt) before its child (a Linear): its own
    nodes belong to its call, the child's to the child's; the walk from the module's output
    goes through the child's nodes to reach its own (it once stopped at the child's and left
    them to the model's root call)."""
    class Pre(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.fc = torch.nn.Parameter(torch.ones(3)), torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.fc((x * self.scale).abs().sqrt())

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = Pre()

        def forward(self, x):
            return self.pre(x).exp()

    model = Net()
    tracker = ModuleTracker(model, map_nodes=True)
    with tracker:
        y = model(torch.randn(2, 3)).sum()
    owner, todo, seen = {}, [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        call = tracker.node_call(node)
        owner[node.name()] = call.module if call is not None else None
        todo.extend(n for n, _ in node.next_functions)
    assert owner["SqrtBackward0"] == owner["AbsBackward0"] == owner["MulBackward0"] == "pre"
    assert owner["AddmmBackward0"] == "pre.fc" and owner["ExpBackward0"] == ""
