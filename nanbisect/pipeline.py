"""`run_bundle`: bundle -> replay(target) [+ replay(reference)] -> phase -> module -> op -> report.

Passes over the step, each from the bundle's pre-step state:
  1. module statistics over the whole step (cheap: one small reduction per module call);
     decides reproduction and phase, and gives the module backtrace;
  2. op recording over the failing phase only; provenance from the failed value to its root op;
  3. a narrow replay that clones the root op's inputs (and takes the only Python stack), for the
     standalone repro, which then runs once in a subprocess.
A failure recorded in the manifest that the replay does not show is reported as
``not-reproduced``, never given an invented culprit.
"""
from __future__ import annotations

import math
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from nanbisect.locate.producers import (Culprit, backtrace, backward_producer, culprit_from_call, forward_producer,
                     optimizer_culprit, timeline)
from nanbisect.reference import kernels as registry
from nanbisect.reference.differential import (RandomReplay, RandomTape, ReferenceKernels, StepState,
                           diverging_call, first_divergence, isolate_window, step_state)
from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput
from nanbisect.reference.opcheck import OpCheck, check_op, move, resolve
from nanbisect.multirank.launcher import run_multirank
from nanbisect.locate.catch import catch_inputs, catch_module_call
from nanbisect.locate.ops import OpFinding, record_ops
from nanbisect.replay.recorder import tensor_args, written_tensors
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer, StepOutcome, parse_device, stacked
from nanbisect.report.model import Report
from nanbisect.report.write import staged, write_report
from nanbisect.report.repro import repro_imports, run_repro, write_module_repro, write_repro
from nanbisect.task import load_inject


def _num(x: float | None):
    """Losses as JSON: floats when finite, "nan"/"inf"/"-inf" otherwise."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))



@dataclass(frozen=True)
class RunOptions:
    target: str | None = None
    reference: str | None = None
    inject: str | None = None
    entry: str | None = None
    run_repro: bool = True


def _default_target(manifest: dict) -> str:
    dev = (manifest.get("devices") or {}).get("captured_on", "cpu")
    try:
        parse_device(dev)
        return dev
    except BadInput:
        return "cpu"


def _guarded(fn, what: str):
    """Run user code; turn its exceptions into a one-line BadInput naming where it broke."""
    try:
        return fn()
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not re-raised
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        raise BadInput(f"{what} raised {type(e).__name__}: {str(e)[:200]}{where}; the entry's "
                       "code fails on this bundle, fix it or pass --entry") from None


def run_bundle(path: str | Path, opts: RunOptions = RunOptions(), out: Path | None = None,
               progress: Callable[[str], None] = lambda msg: None) -> Report:
    """Replay a bundle, bisect its failure down to an op, write the report directory.

    ``out`` defaults to ``BUNDLE/nanbisect-report``; it is replaced atomically.

    >>> run_bundle("fixtures/bundles/forward_nan_behind_mask").culprit.op
    'aten.sqrt.default'
    """
    bundle = read_bundle(path)
    m = bundle.manifest
    out = Path(out) if out is not None else bundle.path / "nanbisect-report"
    target = opts.target or _default_target(m)
    t_dev, t_dtype = parse_device(target)
    if bundle.multi_rank:
        if opts.reference not in (None, "none"):
            raise BadInput("--reference is not supported for multi-rank bundles yet; replay "
                           "with --reference none")
        if opts.inject:
            load_inject(opts.inject)  # a bad --inject fails here, before any rank starts
        return run_multirank(bundle, target, opts.inject, out, opts.run_repro)
    reference = opts.reference or ("cpu" if t_dev.type != "cpu" else "none")
    ref = None if reference == "none" else parse_device(reference)
    wrap = load_inject(opts.inject) if opts.inject else nullcontext

    progress("building the task")
    rep = _guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry), "building the task")
    probe = ModuleProbe(rep.task.model)
    tape = RandomTape()

    progress(f"pass 1/3: replaying the step on {target} with module statistics")
    # the injected context first: the tape, inside it, sees what it returns
    first = _guarded(lambda: rep.run(phase=probing(probe), wrap=lambda: stacked(
        wrap(), *([tape] if ref is not None else []))),
                     "replaying the step on the target")
    observed = m.get("observed")
    original = (observed or {}).get("loss")  # a float, or "nan"/"inf" when it was not finite
    replay = {"original_loss": original, "target_loss": _num(first.loss), "reference_loss": None}
    if isinstance(original, float) and first.loss is not None:
        replay["bit_exact"] = first.loss == original

    side, side_note = None, None
    if ref is not None and first.phase != "input":
        registry.load_plugins()
        progress(f"replaying the step on the reference ({reference})")
        side, side_note = _reference_side(bundle, rep, first, ref, tape)
        if side is not None:
            replay["reference_loss"] = _num(side.outcome.loss)

    common = dict(replay=replay, bundle=str(bundle.path), entry=m["entry"], target=target,
                  reference=reference, observed=observed)
    pre_notes = [side_note] if side_note else []
    divergence = None
    if first.phase is None and not observed and side is not None:
        divergence = first_divergence(side.target_state, side.state, side.dtype_target)
    if divergence is not None:
        progress("isolating the target's ops on the reference")
        return _divergence_report(rep, probe, side, divergence, wrap, out, opts, common)
    if first.phase is None:
        if observed:
            report = Report("not-reproduced", "transient", None, None, None, notes=[
                "the manifest records a non-finite step, but the replay from the same state, "
                "RNG and batch was finite: suspect a transient (hardware, race, unsynchronised "
                "communication) or state the bundle does not hold", *pre_notes], **common)
        else:
            report = Report("clean", None, None, None, None, notes=pre_notes, **common)
    elif first.phase == "input":
        report = Report("input-nonfinite", "data", "input", first.kind, None,
                        input_nonfinite=first.bad, **common)
    else:
        classification = ("unknown" if side is None else
                          "numerics" if side.outcome.phase is not None else "device")
        progress(f"pass 2/3: recording the {first.phase} phase's ops")
        return _culprit_report(rep, probe, first, classification, wrap, out, opts, common, ref,
                               pre_notes, progress)
    with staged(out) as tmp:
        write_report(report, tmp)
    return report


@dataclass
class _Reference:
    """The reference replay: its outcome, module table and step state, plus the target's."""

    device: torch.device
    dtype: torch.dtype | None
    outcome: StepOutcome
    probe: ModuleProbe
    state: StepState
    target_state: StepState
    dtype_target: torch.dtype    # tolerances are the target's dtype's


def _reference_side(bundle, rep: Replayer, first: StepOutcome, ref, tape: RandomTape
                    ) -> tuple["_Reference | None", str | None]:
    """Replay on the reference; (None, why) when the reference cannot run the step."""
    t_dtype = next(rep.task.model.parameters()).dtype
    target_state = step_state(rep, first)
    ref_rep = _guarded(lambda: Replayer(bundle, ref[0], ref[1], entry=rep.entry),
                       "building the task on the reference")
    probe = ModuleProbe(ref_rep.task.model)

    try:
        outcome = _guarded(lambda: ref_rep.run(
            phase=probing(probe), wrap=lambda: stacked(ReferenceKernels(), RandomReplay(tape))),
                           "replaying the step on the reference")
    except BadInput as e:
        return None, (f"the reference could not replay the step ({e}); register reference "
                      "implementations with nanbisect.reference_impl for ops it has no kernel "
                      "for; classification is unknown")
    return _Reference(ref[0], ref[1], outcome, probe, step_state(ref_rep, outcome),
                      target_state, t_dtype), None


def _catch_and_write(rep: Replayer, finding_like, wrap, tmp: Path, culprit: Culprit, kind: str,
                     target: str, opts: RunOptions):
    """Narrow pass + repro; returns (caught, repro path or None, repro result or None)."""
    caught = _guarded(lambda: catch_inputs(rep, finding_like, wrap), "catching the op's inputs")
    if caught is None:
        return None, None, None
    culprit = replace(culprit, source=caught.source or culprit.source)
    script = write_repro(tmp / "repro", caught, culprit=culprit.__dict__, kind=kind, target=target,
                         imports=repro_imports(caught.op, rep.entry))
    result = run_repro(script, target) if opts.run_repro else None
    return caught, "repro/repro.py", result


def _divergence_report(rep: Replayer, probe: ModuleProbe, side: "_Reference", div, wrap,
                       out: Path, opts: RunOptions, common: dict) -> Report:
    phase = div.phase
    call = None
    if phase in ("forward", "backward"):
        call = diverging_call(probe.read(), side.probe.read(), phase, side.dtype_target)
    call_id = (call.call.module, call.call.call) if call is not None else None
    iso = _guarded(lambda: isolate_window(rep, phase, call_id, side.device, side.dtype, wrap),
                   "isolating the target's ops on the reference")
    notes = [f"target and reference diverge first at {div.what}: "
             + div.comparison.message().replace("\n", "; ")]
    if iso.uncomparable:
        notes.append(f"{len(iso.uncomparable)} op(s) could not be compared (no reference kernel "
                     "or registered reference_impl): " + ", ".join(sorted({u.op for u in
                                                                          iso.uncomparable})))
    with staged(out) as tmp:
        repro = result = None
        if iso.culprit is not None:
            c = iso.culprit
            culprit = Culprit(phase, iso.module or "", iso.module_call, iso.input_dtypes,
                              iso.input_shapes, None, op=c.op, op_index=c.op_index)
            finding = OpFinding(c.op, c.op_index, phase, iso.module, iso.module_call,
                                iso.input_dtypes, iso.input_shapes, occurrence=iso.occurrence)
            caught, repro, result = _catch_and_write(rep, finding, wrap, tmp, culprit,
                                                     "mismatch", common["target"], opts)
            if caught is not None:
                culprit = replace(culprit, source=caught.source)
        elif call is not None:
            culprit = culprit_from_call(rep.task.model, call, phase)
            notes.append(f"every op inside the diverging module call passed its isolated check "
                         f"({iso.checked} checked): the divergence comes from the call as a "
                         "whole (e.g. an op without a comparable reference)")
        else:
            culprit = Culprit(phase, "", None, [], [], None)
            notes.append("no module call or op could be isolated as the first divergence")
        report = Report("culprit", "device", phase, "mismatch", culprit, notes=notes, repro=repro,
                        timeline=timeline(probe.read(), phase),
                        repro_result=result, divergence={"what": div.what,
                                                         **div.comparison.to_json()},
                        op_check=iso.culprit.to_json() if iso.culprit else None,
                        uncomparable=[u.to_json() for u in iso.uncomparable], **common)
        write_report(report, tmp)
    return report


def _culprit_report(rep: Replayer, probe: ModuleProbe, first: StepOutcome, classification: str,
                    wrap, out: Path, opts: RunOptions, common: dict,
                    ref: tuple | None = None, pre_notes: list[str] = (),
                    progress: Callable[[str], None] = lambda msg: None) -> Report:
    model, phase, kind = rep.task.model, first.phase, first.kind or "nan"
    notes: list[str] = list(pre_notes)
    table = probe.read()
    call, param = None, None
    if phase == "forward":
        call = forward_producer(table, kind)
    elif phase == "backward":
        call, param = backward_producer(table, kind)
    if call is not None:
        culprit = culprit_from_call(model, call, phase, param)
    elif phase == "optimizer":
        culprit = optimizer_culprit(model, [b.name for b in first.bad])
    else:
        culprit = Culprit(phase, "", None, [], [], None)

    scope = (call.call.module, call.call.call) if phase == "forward" and call is not None \
        else None
    finding = _guarded(lambda: record_ops(rep, phase, kind, wrap, scope),
                       "recording the step's ops")
    if finding is None:
        notes.append("op-level provenance found no root op inside the recorded phase; the "
                     "culprit is the module call that produced the value")
    else:
        culprit = Culprit(phase=finding.phase, module=finding.module,
                          module_call=finding.module_call, input_dtypes=finding.input_dtypes,
                          input_shapes=finding.input_shapes, source=culprit.source,
                          op=finding.op, op_index=finding.op_index, parameter=finding.parameter)
        if (call is None or (call.call.module, call.call.call) != (finding.module,
                                                                   finding.module_call)):
            match = [c for c in table.calls
                     if (c.call.module, c.call.call) == (finding.module, finding.module_call)]
            call = match[0] if match else call
    trace = backtrace(table, call, phase, kind) if call is not None and phase != "optimizer" \
        else []
    with staged(out) as tmp:
        caught = repro = repro_result = op_check = module_repro = None
        if finding is not None:
            progress("pass 3/3: catching the culprit's inputs; running the repro")
            caught, repro, repro_result = _catch_and_write(rep, finding, wrap, tmp, culprit, kind,
                                                           common["target"], opts)
            if caught is None:
                notes.append("the culprit op could not be caught again in a narrow replay (the "
                             "step is not deterministic); no repro was written")
            else:
                culprit = replace(culprit, source=caught.source or culprit.source)
                if repro_result and not repro_result["reproduced"] and opts.inject:
                    notes.append(f"the repro did not reproduce on {common['target']}: it runs "
                                 f"the op without --inject {opts.inject}, which emulated the "
                                 "fault here; run repro/repro.py on the device that has the "
                                 "faulty kernel")
                elif (repro_result and not repro_result["reproduced"]
                        and phase in ("forward", "backward")
                        and culprit.module and culprit.module_call is not None):
                    progress("the op alone did not reproduce: catching its module call")
                    module_repro = _module_fallback(rep, culprit, kind, common["target"], wrap,
                                                    tmp, opts)
                    notes.append("the culprit op alone did not reproduce (it depends on state "
                                 "outside its inputs); module_repro replays its module call "
                                 "with the module's state: " + ("reproduced" if module_repro
                                                                and module_repro["result"] and
                                                                module_repro["result"]
                                                                ["reproduced"] else
                                                                "did not reproduce either"))
                if ref is not None:
                    op_check = _guarded(lambda: _check_caught(caught, finding.op_index, rep, ref, wrap),
                                        "re-running the culprit op").to_json()
                    if op_check["status"] == "uncomparable":
                        notes.append(f"{caught.op} cannot run on the reference ({op_check['detail']})"
                                     "; it is reported as uncomparable, not as correct")
        report = Report("culprit", classification, phase, kind, culprit, backtrace=trace,
                        timeline=timeline(table, phase),
                        notes=notes, repro=repro, repro_result=repro_result,
                        inf_origin=finding.inf_origin if finding else None,
                        context=finding.context if finding else [], op_check=op_check,
                        module_repro=module_repro,
                        op_recording=({"scope": ({"module": finding.scope[0],
                                                  "module_call": finding.scope[1]}
                                                 if finding.scope else None),
                                       "phase": finding.phase, "recorded_ops": finding.recorded,
                                       "step_ops": finding.total_ops} if finding else None),
                        uncomparable=[op_check] if op_check and op_check["status"] == "uncomparable"
                        else [], **common)
        write_report(report, tmp)
    return report


def _module_fallback(rep: Replayer, culprit: Culprit, kind: str, target: str, wrap, tmp: Path,
                     opts: RunOptions) -> dict | None:
    """Write (and run once) a repro of the culprit's whole module call, with its state."""
    mc = _guarded(lambda: catch_module_call(rep, culprit.module, culprit.module_call, wrap,
                                            backward=culprit.phase == "backward"),
                  "catching the culprit's module call")
    if mc is None:
        return None
    script = write_module_repro(tmp / "repro", mc, culprit=culprit.__dict__, kind=kind,
                                target=target, entry=rep.entry)
    return {"script": "repro/module_repro.py",
            "result": run_repro(script, target) if opts.run_repro else None}


def _check_caught(caught, index: int, rep: Replayer, ref: tuple, wrap) -> OpCheck:
    """Run the caught op on the target (under its injected context) and judge it on the
    reference from the same inputs."""
    args, kwargs = move(caught.args, rep.device), move(caught.kwargs, rep.device)
    with wrap():
        out = resolve(caught.op)(*args, **kwargs)
    returned, mutated = written_tensors(resolve(caught.op), out, tuple(args), kwargs)
    target_out = [t.detach().cpu() for t, _ in tensor_args(returned + mutated)]
    return check_op(caught.op, index, caught.args, caught.kwargs, target_out, ref[0], ref[1])
