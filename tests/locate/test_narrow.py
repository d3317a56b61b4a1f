"""Op-level bisection in process, on tasks built for one trap each (tests/tasks/traps.py)."""
from __future__ import annotations

import json

import pytest
import torch

import nanbisect
from helpers import TEST_TASKS
from nanbisect.bundle.format import read_bundle
from nanbisect.locate.catch import catch_inputs
from nanbisect.locate.ops import record_ops
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.replay.replayer import Replayer

TRAPS = TEST_TASKS / "traps.py"


def line_of(text: str) -> int:
    """Line number in traps.py of the first line containing ``text``."""
    return next(i for i, line in enumerate(TRAPS.read_text().splitlines(), 1) if text in line)


def guard_bundle(tmp_path, func: str, batch) -> str:
    """Run the task under Guard until it fails; return the bundle."""
    from nanbisect.task import load_task

    entry = f"{TRAPS}:{func}"
    guard = nanbisect.Guard(load_task(entry), entry=entry, out=tmp_path / "g")
    with pytest.raises(nanbisect.NonFiniteStep) as e:
        guard.step(batch)
        guard.close()      # a fault born in the update: read by the next reading, or here
    return e.value.bundle


def run(bundle, tmp_path):
    return run_bundle(bundle, RunOptions(), tmp_path / "report")


def test_nan_zeroed_by_relu_backward_is_not_blamed(tmp_path):
    """`late` makes NaN in backward first, but relu's backward zeroes it; the NaN that reaches
    the gradients is born later in backward order, in `early.1` (sqrt of a negative)."""
    torch.manual_seed(1)
    bundle = guard_bundle(tmp_path, "relu_masked_then_real", torch.randn(5, 8))
    r = run(bundle, tmp_path)
    c = r.culprit
    assert (r.verdict, c.phase, c.module, c.module_call, c.op) == (
        "culprit", "backward", "early.1", 0, "aten.sqrt.default")
    assert c.source.endswith(f"traps.py:{line_of('BUG: sqrt of negative')}")
    rows = {(t.module, t.call): t.role for t in r.backtrace}
    assert rows[("early.1", 0)] == "culprit"


@pytest.mark.parametrize("func, op", [
    ("adam_foreach", "aten._foreach_addcdiv_.ScalarList"),
    ("adam_fused", "aten._fused_adam_.default"),
])
def test_optimizer_phase_whatever_the_implementation(tmp_path, func, op):
    tokens = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0))
    r = run(guard_bundle(tmp_path, func, tokens), tmp_path)
    c = r.culprit
    assert (c.phase, c.module, c.parameter, c.module_call) == (
        "optimizer", "embed", "embed.weight", None)
    assert c.op == op


def test_op_phases_are_labelled(tmp_path):
    """Every recorded op carries the phase it ran in: custom backward bodies are backward."""
    torch.manual_seed(1)
    bundle = guard_bundle(tmp_path, "relu_masked_then_real", torch.randn(5, 8))
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    f = record_ops(rep, "backward", "nan")
    assert f.phase == "backward" and all(c.phase == "backward" for c in f.context)
    assert f.total_ops > f.op_index


def test_culprit_inputs_caught_with_rng_state(tmp_path):
    """The narrow pass clones the culprit's inputs and the generator state just before it."""
    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "drop_then_sqrt", torch.randn(6, 8))
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    f = record_ops(rep, "forward", "nan")
    assert (f.op, f.module) == ("aten.sqrt.default", "")
    caught = catch_inputs(rep, f.site)
    assert caught.op == "aten.sqrt.default" and caught.source.endswith(f"traps.py:{line_of('torch.sqrt(self.drop')}")
    # the dropout mask drawn in the replay is the one drawn when the guard ran: the caught
    # input equals what the original forward fed to sqrt
    model = rep.task.model
    rep.restore()
    torch.set_rng_state(caught.rng["rng/cpu"])
    x = caught.args[0]
    assert torch.isnan(torch.sqrt(x)).any() and not torch.isnan(x).any()
    # the saved RNG state is the one right before sqrt: drawing from it repeats the draw
    # that follows sqrt in the step (none here), and differs from the step-start state
    assert not torch.equal(caught.rng["rng/cpu"], rep.rng.torch_cpu)
    assert model is rep.task.model


def test_input_catch_of_a_forward_culprit_ends_the_replay_there(tmp_path):
    """The last pass stops right after the culprit's inputs are cloned: the ops after it in the
    forward (sum, mean) and the backward never run; the catch is what a whole pass catches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "drop_then_sqrt", torch.randn(6, 8))
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    f = record_ops(rep, "forward", "nan")
    seen = Ops()
    caught = catch_inputs(rep, f.site, wrap=lambda: seen)
    assert caught is not None and caught.op == "aten.sqrt.default"
    # (the catcher is the inner mode: it stops before the sqrt reaches the counter; what it
    # dispatches itself after the sub is the clone of the sqrt's input)
    assert "aten.sub.Tensor" in seen.ops and "aten.sqrt.default" not in seen.ops
    assert "aten.sum.dim_IntList" not in seen.ops
    rep.lockstep = True         # a lockstep replay runs on to the end of the phase
    seen = Ops()
    again = catch_inputs(rep, f.site, wrap=lambda: seen)
    assert "aten.sum.dim_IntList" in seen.ops[seen.ops.index("aten.sqrt.default"):]
    assert all(torch.equal(a, b) for a, b in zip(caught.args, again.args)
               if isinstance(a, torch.Tensor))


def test_report_json_has_op_fields(tmp_path):
    torch.manual_seed(1)
    bundle = guard_bundle(tmp_path, "relu_masked_then_real", torch.randn(5, 8))
    run(bundle, tmp_path)
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["culprit"]["op"] == "aten.sqrt.default"
    assert rep["repro_result"]["reproduced"] is True
    assert (tmp_path / "report" / "repro" / "inputs.safetensors").is_file()


def test_top_level_module_has_one_name_in_every_report(tmp_path):
    """A culprit in the model's own forward (outside any submodule): "" in report.json (DESIGN),
    the same printed name in the terminal lines, report.md, report.html and the triage
    signature."""
    from nanbisect.records import ROOT
    from nanbisect.report.prose import terminal
    from nanbisect.nightly import signature

    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "drop_then_sqrt", torch.randn(6, 8))
    r = run(bundle, tmp_path)
    out = tmp_path / "report"
    rep = json.loads((out / "report.json").read_text())
    assert (rep["culprit"]["op"], rep["culprit"]["module"]) == ("aten.sqrt.default", "")
    md, page, term = (out / "report.md").read_text(), (out / "report.html").read_text(), terminal(r, out)
    assert f"module={ROOT} call=0" in term and f"at module '{ROOT}'" in term
    assert f"`{ROOT}`" in md and "outside any submodule" not in md + page
    assert f"<code>{ROOT.replace('<', '&lt;').replace('>', '&gt;')}</code>" in page
    assert f" · {ROOT} · forward · " in signature(rep)


@pytest.mark.slow
def test_op_that_needs_state_falls_back_to_its_module_call(tmp_path):
    """The op alone does not reproduce (a scale set outside its inputs); the module call does."""
    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "hidden_state", torch.randn(5, 8))
    r = run(bundle, tmp_path)
    c = r.culprit
    assert (c.op, c.module, c.module_call) == ("nbtrap.scaled.default", "hidden", 0)
    assert r.repro_result.reproduced is False
    assert r.module_repro.script == "repro/module_repro.py"
    assert r.module_repro.result.reproduced is True, r.module_repro
    assert (tmp_path / "report" / "repro" / "module_inputs.safetensors").is_file()


@pytest.mark.slow
def test_backward_op_that_needs_state_falls_back_to_its_module_call(tmp_path):
    """A backward op that reads a scale set in forward: alone it does not reproduce; the module
    call run forward and backward from the gradient that arrived at its output does."""
    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "hidden_grad_state", torch.randn(5, 8))
    r = run(bundle, tmp_path)
    c = r.culprit
    assert (r.phase, c.op, c.module, c.module_call) == (
        "backward", "nbtrap.gradscaled.default", "hidden", 0)
    assert r.repro_result.reproduced is False
    assert r.module_repro.result.reproduced is True, r.module_repro
    assert "forward + backward" in r.module_repro.result.output
    # the saved gradient is the one that arrived at the call's output: finite
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "report" / "repro" / "module_inputs.safetensors")
    grads = [v for k, v in saved.items() if k.startswith("grad_out")]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_forward_recording_is_scoped_to_the_producing_module_call(tmp_path):
    """Pass 2 starts recording at the producing module call (the ops before it are not
    recorded); an inf born before the call makes it record the whole phase (for inf_origin)."""
    from helpers import ROOT

    r = run_bundle(str(ROOT / "fixtures" / "bundles" / "forward_nan_behind_mask"),
                   RunOptions(run_repro=False), tmp_path / "a")
    rec = r.op_recording
    assert rec.scope == (r.culprit.module, r.culprit.module_call)
    assert 0 < rec.recorded_ops < rec.step_ops / 2
    r = run_bundle(str(ROOT / "fixtures" / "bundles" / "overflow_then_nan"),
                   RunOptions(run_repro=False), tmp_path / "b")
    assert r.op_recording.scope is None and r.inf_origin.op == "aten.exp.default"


def test_forward_catch_rides_along_the_recording(tmp_path):
    """Pass 3 folded into pass 2 (a forward culprit on the CPU): what `AheadCatch` caught at the
    root on the recording's way is what the narrow replay catches (arguments, RNG state right
    after a dropout, source line, batch rows), and a run then has no input-catch pass."""
    from nanbisect.locate.catch import AheadCatch
    from nanbisect.locate.rows import RowTracer

    torch.manual_seed(0)
    bundle = guard_bundle(tmp_path, "drop_then_sqrt", torch.randn(6, 8))
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    ahead = AheadCatch(rep, RowTracer(None, "nan"))
    f = record_ops(rep, "forward", "nan", ahead=ahead)
    caught, rows = ahead.caught(f.site.op, f.op_index)
    tracer = RowTracer(f.site, "nan")
    narrow = catch_inputs(rep, f.site, rows=tracer)
    assert (caught.op, caught.source, caught.mutated) == (narrow.op, narrow.source, [])
    assert caught.source.endswith(f"traps.py:{line_of('torch.sqrt(self.drop')}")
    assert torch.equal(caught.rng["rng/cpu"], narrow.rng["rng/cpu"])
    assert len(caught.args) == len(narrow.args) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(caught.args, narrow.args))
    narrow_rows = tracer.result()       # the narrow replay ends at the culprit: no reach
    assert (rows.samples, rows.rows, rows.why) == (narrow_rows.samples, narrow_rows.rows,
                                                   narrow_rows.why) and rows.samples
    assert rows.reached and set(rows.reached) <= set(rows.samples)
    assert ahead.caught("aten.sub.Tensor", f.op_index) is None     # not the root's name
    r = run_bundle(bundle, RunOptions(remedies=0, run_repro=False), tmp_path / "report")
    assert r.culprit.op == "aten.sqrt.default" and r.culprit.samples == rows.samples
    assert "input-catch" not in r.timings and "op-recording" in r.timings
    # over its byte budget nothing is kept: the pipeline then replays to catch (pass 3)
    small = AheadCatch(rep, None, max_bytes=0)
    f = record_ops(rep, "forward", "nan", ahead=small)
    assert f is not None and small.caught(f.site.op, f.op_index) is None


@pytest.mark.parametrize("tasks, func, root_phase", [
    ("traps", "relu_masked_then_real", "backward"),   # a custom Function's backward
    ("surfaced", "where_log", "backward"),   # a built-in formula: its node names its forward op
    ("surfaced", "where_div", "backward"),
    ("surfaced", "where_sqrt", "forward"),   # born in forward: found by the cross-phase replay
])
def test_backward_catch_rides_along_the_recording(tmp_path, tasks, func, root_phase):
    """Pass 3 folded into pass 2 for a backward failure on the CPU: `AheadCatch(backward=True)`
    catches at the root what the narrow replay of `catch_inputs` catches (arguments, source
    line, the autograd node with the forward op and line that made it, batch rows), also for a
    root the cross-phase replay finds in forward; a run then has no input-catch pass."""
    import importlib

    from nanbisect.locate.catch import AheadCatch
    from nanbisect.locate.rows import RowTracer

    module = importlib.import_module(tasks)
    torch.manual_seed(1)
    batch = module.batch() if tasks == "surfaced" else torch.randn(5, 8)
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(module, func)(), batch, bundle,
                      entry=f"{TEST_TASKS / (tasks + '.py')}:{func}")
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    ahead = AheadCatch(rep, RowTracer(None, "nan"), backward=True)
    f = record_ops(rep, "backward", "nan", ahead=ahead)
    assert f.site.phase == root_phase
    caught, rows = ahead.caught(f.site.op, f.op_index)
    tracer = RowTracer(f.site, "nan")
    narrow = catch_inputs(rep, f.site, rows=tracer)
    assert (caught.op, caught.source, caught.node, caught.mutated) == (
        narrow.op, narrow.source, narrow.node, narrow.mutated)
    if root_phase == "backward":
        assert caught.node is not None and caught.node.forward_source is not None
        assert (caught.node.forward_op is None) == (tasks == "traps")   # a Function: its apply
    assert len(caught.args) == len(narrow.args) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(caught.args, narrow.args))
    narrow_rows = tracer.result()
    assert (rows.samples, rows.rows, rows.why) == (narrow_rows.samples, narrow_rows.rows,
                                                   narrow_rows.why) and rows.samples
    assert rows.reached and set(rows.reached) <= set(rows.samples)
    r = run_bundle(bundle, RunOptions(remedies=0, run_repro=False), tmp_path / "report")
    assert (r.culprit.op, r.culprit.phase, r.culprit.source) == (f.site.op, root_phase,
                                                                 caught.source)
    assert "input-catch" not in r.timings and "op-recording" in r.timings


def test_recorder_offers_only_roots_it_can_hand_over():
    """`OpRecorder(born=...)` offers an op that made the kind from clean inputs, right after it
    ran; not one fed a bad value, nor one that wrote its argument (its input is gone)."""
    from nanbisect.replay.recorder import OpRecorder

    for kind, expect in (("nan", ["aten.sqrt.default"]),
                         ("inf", ["aten.sqrt.default", "aten.log.default"])):
        offered = []
        rec = OpRecorder(None, {"forward"}, kind=kind,
                         born=lambda i, func, args, kw: offered.append(
                             (str(func), args[0].clone())))
        x, z = torch.tensor([-1.0, 4.0]), torch.tensor([1.0, 0.0])
        with rec:
            y = x.sqrt()                # clean in, NaN out: offered, its input intact
            y + 1                       # NaN in: not a root
            z.log()                     # -inf out of clean inputs: a root of an inf failure
            x.clone().sqrt_()           # writes its argument: not offered
        assert [op for op, _ in offered] == expect
        assert torch.equal(offered[0][1], x)
