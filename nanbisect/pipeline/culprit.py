"""A culprit's report: the op-recording and input-catch passes, the finisher (`nanbisect.finish`:
culprit, repro started in the background, op check), the module-call repro when the op alone
does not reproduce, and the classification from the evidence; or, without NaN, the isolated
first divergence from the reference.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from nanbisect.bundle import lookback
from nanbisect.bundle.lookback import BundleView
from nanbisect.finish import Evidence, classify_culprit, finish
from nanbisect.locate.catch import AheadCatch, catch_inputs, catch_module_call
from nanbisect.locate.ops import record_ops
from nanbisect.locate.rows import RowTracer
from nanbisect.locate.producers import (backtrace, backward_producer, first_bad_parameter,
                                        forward_producer, timeline)
from nanbisect.pipeline.common import _guarded, _Run, after_verdict
from nanbisect.records import (CallId, Caught, Culprit, Divergence, ModuleRepro, OpCheck,
                               OpFinding, OpRecording, Remedy, RowTrace, StepOutcome,
                               module_label)
from nanbisect.reference.differential import diverging_call, isolate_window
from nanbisect.reference.side import ReferenceSide
from nanbisect.remedies import budget as remedy_budget
from nanbisect.remedies import try_remedies
from nanbisect.report.model import Report
from nanbisect.report.repro import device_of, repro_imports, write_module_repro, write_repro
from nanbisect.report.rerun import ServerFork, runner


def _evidence(run: _Run, side: "ReferenceSide | None", op_check: OpCheck | None) -> Evidence:
    """What a culprit's classification is decided from, in a single-process run."""
    mismatch = run.facts.fidelity is not None and run.facts.fidelity.mismatch
    if side is None:
        return Evidence("none", None, torch.float32, op_check, mismatch)
    return Evidence("failed" if side.failed else "finite", side.dtype, side.target_dtype,
                    op_check, mismatch)


def _repro_starter(run: _Run):
    """How this run starts the repro's one run (None without opts.run_repro): on the CPU, for a
    built-in op, a fork of this process; else a fork of the fork server this process came from,
    or the interpreter started ahead (or a new one): `nanbisect.report.rerun.runner`."""
    if not run.opts.run_repro:
        return None

    def start(script: Path, caught: Caught):
        spare = run.interp
        started = runner(run.rep.device.type, caught.op, spare)
        run.started.append(started)    # ended and reaped if nobody collects it (an interrupt)
        if started is spare or isinstance(started, ServerFork):
            run.interp = None      # one script per interpreter: used, or closed by `runner`
        started.submit(script, device_of(run.facts.target))

        def result():
            run.progress("repro", "waiting for the repro's run")
            return started.result()
        return result
    return start


def _divergence_report(run: _Run, side: ReferenceSide, div: Divergence, tmp: Path) -> Report:
    rep, phase = run.rep, div.phase
    call = None
    if phase in ("forward", "backward"):
        call = diverging_call(run.probe.read(), side.probe.read(), phase, side.target_dtype)
    finding, check, checked, uncomparable = _guarded(
        lambda: isolate_window(rep, phase, call.call if call is not None else None, side.device,
                               run.wrap),
        "isolating the target's ops on the reference")
    notes = [f"target and reference diverge first at {div.what}: "
             + div.comparison.message().replace("\n", "; ")]
    if uncomparable:
        notes.append(f"{len(uncomparable)} op(s) could not be compared (no reference kernel "
                     "or registered reference_impl): " + ", ".join(sorted({u.op for u in
                                                                          uncomparable})))
    caught = None
    if finding is not None:
        run.progress("input-catch", "catching the diverging op's inputs")
        caught = _guarded(lambda: catch_inputs(rep, finding.site, run.wrap),
                          "catching the op's inputs")
    elif call is not None:
        notes.append(f"every op inside the diverging module call passed its isolated check "
                     f"({checked} checked): the divergence comes from the call as a "
                     "whole (e.g. an op without a comparable reference)")
    else:
        notes.append("no module call or op could be isolated as the first divergence")
    done = finish(rep, phase, "mismatch", finding=finding, caught=caught, call=call,
                  op_check=check, repro_dir=tmp / "repro", target=run.facts.target,
                  start_repro=_repro_starter(run), progress=run.progress,
                  errors=run.errors)
    classification = "device" if check is not None else "unknown"
    if run.facts.fidelity is not None and run.facts.fidelity.mismatch:
        classification = "replay-mismatch"
    stage = _guard(run)
    return Report("culprit", classification, phase, "mismatch", done.culprit, run.facts,
                  notes=notes, repro="repro/repro.py" if done.repro else None,
                  timeline=stage("context", lambda: timeline(run.probe.read(), phase), []),
                  repro_result=(stage("repro", done.pending, None) if done.pending
                                else None),
                  divergence=div, op_check=check, uncomparable=uncomparable)


def _culprit_report(run: _Run, first: StepOutcome, side: ReferenceSide | None, ref,
                    tmp: Path) -> Report:
    rep, opts, target = run.rep, run.opts, run.facts.target
    model, phase, kind = rep.task.model, first.phase, first.kind or "nan"
    notes = list(run.notes)
    table = run.probe.read()
    call, parameter, traced = None, None, None
    if phase == "forward":
        call = forward_producer(table, kind)
    elif phase == "backward":
        call, parameter = backward_producer(table, kind)
    elif phase == "optimizer":
        parameter = first_bad_parameter(model, [b.name for b in first.bad])

    run.progress("op-recording", f"pass 2/3: recording the {phase} phase's ops")
    scope = call.call if phase == "forward" and call is not None else None
    ahead = _ahead(run, phase, kind)
    finding = _guarded(lambda: record_ops(rep, phase, kind, run.wrap, scope,
                                          progress=run.progress, ahead=ahead),
                       "recording the step's ops")
    caught = None
    if finding is None:
        notes.append("op-level provenance found no root op inside the recorded phase; the "
                     "culprit is the module call that produced the value")
    else:
        if finding.surfaced is not None:
            notes.append(_surfaced_note(finding, kind))
        if finding.module_call is not None:   # the table row of the op's own module call
            call = table.get(CallId(finding.module, finding.module_call)) or call
        got = ahead.caught(finding.site.op, finding.op_index) if ahead is not None else None
        if got is not None:     # caught by pass 2 on its way
            caught, traced = got
        else:
            run.progress("input-catch", "pass 3/3: catching the culprit's inputs")
            caught, traced = _catch(run, finding, kind)
        if caught is None:
            notes.append("the culprit op could not be caught again in a narrow replay (the "
                         "step is not deterministic); no repro was written")
    done = finish(rep, phase, kind, finding=finding, caught=caught, call=call,
                  parameter=parameter, micro_batch=first.micro_batch,
                  check_on=ref[0] if ref is not None else None, wrap=run.wrap,
                  repro_dir=tmp / "repro", target=target, start_repro=_repro_starter(run),
                  progress=run.progress, errors=run.errors)
    # the verdict is known: what each stage below adds is left out when it fails (`errors`)
    stage = _guard(run)
    culprit = replace(done.culprit, samples=traced.samples if traced else None)
    trace, table_rows = stage("context", lambda: (
        backtrace(table, call, phase, kind) if call is not None and phase != "optimizer"
        else [], timeline(table, phase)), ([], []))
    op_check = done.op_check
    remedies = stage("remedies", lambda: _remedies(run, culprit, finding, kind, traced), [])
    repro_result = module_repro = None
    if done.repro is not None:
        repro_result = stage("repro", done.pending, None) if done.pending else None
        if repro_result and not repro_result.reproduced and opts.inject:
            notes.append(f"the repro did not reproduce on {target}: it runs the op without "
                         f"--inject {opts.inject}, which emulated the fault here; run "
                         "repro/repro.py on the device that has the faulty kernel")
        elif (repro_result and not repro_result.reproduced
                and phase in ("forward", "backward")
                and culprit.module and culprit.module_call is not None):
            run.progress("module-repro", "the op alone did not reproduce: catching its module "
                                         "call")
            failed = len(run.errors)
            module_repro = stage("module-repro",
                                 lambda: _module_fallback(run, culprit, kind, tmp), None)
            worked = (module_repro is not None and module_repro.result is not None
                      and module_repro.result.reproduced)
            notes.append("the culprit op alone did not reproduce (it depends on state "
                         "outside its inputs); module_repro replays its module call "
                         "with the module's state: " + (
                             "it could not be made (see errors)" if len(run.errors) > failed
                             else "reproduced" if worked else "did not reproduce either"))
    surfaced_repro = (stage("surfaced-repro",
                            lambda: _surfaced_repro(run, finding, kind, tmp, notes), None)
                      if finding is not None and finding.surfaced_site is not None
                      and caught is not None else None)
    classification, why = stage("classification",
                                lambda: classify_culprit(_evidence(run, side, op_check)),
                                ("unknown", []))
    notes += why
    return Report(
        "culprit", classification, phase, kind, culprit, run.facts, backtrace=trace,
        timeline=table_rows, notes=notes,
        repro="repro/repro.py" if done.repro else None, repro_result=repro_result,
        inf_origin=finding.inf_origin if finding else None,
        context=finding.context if finding else [], op_check=op_check,
        module_repro=module_repro, surfaced_repro=surfaced_repro,
        op_recording=(OpRecording(finding.scope, phase, finding.recorded, finding.total_ops,
                                  finding.phases) if finding else None),
        uncomparable=[op_check] if op_check and op_check.status == "uncomparable" else [],
        remedies=remedies)


def _guard(run: _Run):
    """``(stage, fn, default) -> fn() or default``: `after_verdict` into this run's errors."""
    return lambda stage, fn, default: after_verdict(run.errors, stage, fn, default)


def _ahead(run: _Run, phase: str, kind: str) -> AheadCatch | None:
    """Pass 3 folded into pass 2 (`AheadCatch`) where it can be: a forward failure replayed on
    the CPU, in one process (a forward catch there ends its replay at the culprit: in lockstep
    or under torch.distributed it would not, and elsewhere the flags stay on the device)."""
    rep = run.rep
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if phase != "forward" or rep.device.type != "cpu" or rep.lockstep or distributed:
        return None
    return AheadCatch(rep, RowTracer(None, kind) if rep.task.accumulate == 1 else None)


def _catch(run: _Run, finding: OpFinding, kind: str) -> tuple[Caught | None, RowTrace | None]:
    """Pass 3: the culprit's inputs and, in the same replay (one-batch steps), the batch rows
    its bad value depends on."""
    tracer = RowTracer(finding.site, finding.born or kind) if run.rep.task.accumulate == 1 \
        else None
    caught = _guarded(lambda: catch_inputs(run.rep, finding.site, run.wrap, rows=tracer),
                      "catching the op's inputs")
    return caught, tracer.result() if tracer is not None else None


def _remedies(run: _Run, culprit: Culprit, finding: OpFinding | None, kind: str,
              trace: RowTrace | None) -> list[Remedy]:
    """The remedies tried on the culprit's step (`nanbisect.remedies`), within the run's budget,
    while the repro's run goes on in the background; the bundle's lookback gives the state remedy its earlier batch (the failing step's own
    bundle only: a step of ``--steps`` has no earlier batch of its own here)."""
    budget = remedy_budget(run.opts.remedies)
    if budget <= 0:
        return []
    bundle = run.rep.bundle
    window = None
    if bundle.manifest.get("lookback") is not None and not isinstance(bundle, BundleView):
        window = lookback.parse(bundle, f"bundle '{bundle.path}'")
    return try_remedies(run.rep, culprit, finding, budget=budget, trace=trace, window=window,
                        wrap=run.wrap, progress=run.progress)


def _surfaced_note(f: OpFinding, kind: str) -> str:
    """In words: where a failure was born, how that phase hid it, where it surfaced."""
    def at(module: str | None, call: int | None) -> str:
        return module_label(module or "") + (f", call {call}" if call is not None else "")
    s = f.surfaced
    kind = f"as {kind} " if kind != f.born else ""
    return (f"{f.born} born in {f.op} in {f.phase} ({at(f.module, f.module_call)}), {f.hidden}, "
            f"surfaced {kind}in {s.phase} at {s.op} ({at(s.module, s.module_call)}): the culprit "
            "is where it was born, culprit.surfaced where it became visible")


def _surfaced_repro(run: _Run, finding: OpFinding, kind: str, tmp: Path,
                    notes: list[str]) -> ModuleRepro | None:
    """Catch the op where a failure born earlier surfaced and write (and run once) its repro,
    ``repro/surfaced/repro.py``: it shows how the earlier phase's value turns into the
    failure (the saved rstd inf into NaN in layer norm's backward). Its outcome goes into
    ``notes``."""
    run.progress("surfaced-repro", "catching the op where the failure surfaced")
    site, s = finding.surfaced_site, finding.surfaced
    caught = _guarded(lambda: catch_inputs(run.rep, site, run.wrap),
                      "catching the op where the failure surfaced")
    if caught is None:
        return None
    tensors = [t for t in torch.utils._pytree.tree_leaves((caught.args, caught.kwargs))
               if isinstance(t, torch.Tensor)]
    culprit = Culprit(s.phase, s.module or "", s.module_call,
                      [str(t.dtype).removeprefix("torch.") for t in tensors],
                      [list(t.shape) for t in tensors], caught.source, s.op, s.op_index)
    script = write_repro(tmp / "repro" / "surfaced", caught, culprit=culprit, kind=kind,
                         target=run.facts.target, imports=repro_imports(caught.op,
                                                                        run.rep.entry),
                         role="Where a failure born earlier surfaced (its culprit: ../repro.py)")
    start = _repro_starter(run)
    res = start(script, caught)() if start is not None else None
    notes.append(f"repro/surfaced/repro.py re-runs {s.op}, where it surfaced, from its inputs in "
                 f"{s.phase}" + ("" if res is None else ": reproduced" if res.reproduced
                                 else ": did not reproduce"))
    return ModuleRepro("repro/surfaced/repro.py", res)


def _module_fallback(run: _Run, culprit: Culprit, kind: str, tmp: Path) -> ModuleRepro | None:
    """Write (and run once) a repro of the culprit's whole module call, with its state."""
    mc = _guarded(lambda: catch_module_call(run.rep, CallId(culprit.module, culprit.module_call),
                                            run.wrap, backward=culprit.phase == "backward"),
                  "catching the culprit's module call")
    if mc is None:
        return None
    script = write_module_repro(tmp / "repro", mc, culprit=culprit, kind=kind,
                                target=run.facts.target, entry=run.rep.entry)
    if not run.opts.run_repro:
        return ModuleRepro("repro/module_repro.py", None)
    started = runner(run.rep.device.type, None)
    run.started.append(started)
    return ModuleRepro("repro/module_repro.py",
                       started.submit(script, device_of(run.facts.target)).result())
