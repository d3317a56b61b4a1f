"""One step, through the chain of passes (`nanbisect.chain`, one process: `Serving.NONE`): pass
1 on the target, the reference side, fidelity, and the verdict: clean, input-nonfinite,
not-reproduced (and why), a compiled capture's (`compiled`), or a culprit's report: the op
recording and input catch, the finisher (culprit, repro started in the background, op check),
the module-call repro when the op alone does not reproduce, and the classification from the
evidence; or, without NaN, the isolated first divergence from the reference.

What differs here from a rank's replay (`nanbisect.multirank`): this process launches itself,
serves no collectives, and writes a `Report`; user code that fails is a one-line `BadInput`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect.bundle.format import Bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.chain import Chain, Located, Serving
from nanbisect.errors import UNDECLARED_SCALER, BadInput
from nanbisect.locate.producers import backtrace, timeline
from nanbisect.report.prose import at_module, headline, rebuild_note
from nanbisect.pipeline.common import (CULPRIT, Progress, RunOptions, StepRun, after_verdict,
                                       guarded, reference_kernels_note, target_wrap,
                                       recorded_failure)
from nanbisect.pipeline.compiler_verdict import (backend_of, compiler_report, opposite_note,
                                         replay_compiled)
from nanbisect.records import (CallId, Caught, Culprit, Divergence, Fidelity, Losses,
                               ModuleRepro, OpFinding, OpRecording, RunFacts, StepOutcome,
                               before_the_step, json_number, module_label)
from nanbisect.reference.classify import classify_not_reproduced
from nanbisect.reference.compare import step_rtol
from nanbisect.reference.side import ReferenceSide, model_dtype
from nanbisect.remedies import budget as remedy_budget
from nanbisect.replay.fidelity import check as fidelity_check
from nanbisect.replay.fidelity import match_threads, tier_notes
from nanbisect.replay.replayer import Replayer
from nanbisect.report.model import Report
from nanbisect.report.repro import device_of, repro_imports, write_module_repro, write_repro
from nanbisect.report.rerun import Interpreter, ServerFork, runner, take
from nanbisect.util.tensors import nan_inf_counts
from nanbisect.util.torch_internals import tree_leaves


def analyse(bundle: Bundle, opts: RunOptions, progress: Progress, target: str,
            t_dev: torch.device, t_dtype: torch.dtype | None, tmp: Path,
            ref: tuple[torch.device, torch.dtype | None] | None) -> tuple[Report, Replayer]:
    """One step: replay, reference, verdict and the passes that find a culprit (the one step of
    `run_bundle`, and the step a ``--steps`` window chose: `nanbisect.pipeline.steps`; ``ref``:
    the reference `run_bundle` resolved from ``opts.reference``, None for none)."""
    view = Manifest.of(bundle)
    reference = str(opts.reference)
    wrap, used = target_wrap(opts, bundle.manifest, t_dev)
    notes = [n for n in [match_threads(bundle, t_dev)] if n]
    interp = None
    if opts.run_repro and not devices.entry(t_dev).forkable and (
            recorded_failure(view.observed) or ref is not None):
        # the repro's interpreter imports torch while the passes below find what it will run
        # (where the device seam lets it, the repro of a built-in op runs in a fork of this
        # process instead: `rerun.Fork.usable`)
        interp = take()
    try:
        return _analyse_step(bundle, opts, progress, target, t_dev, t_dtype, tmp, reference,
                             ref, wrap, notes, interp, used)
    finally:
        if interp is not None:
            interp.close()


def _analyse_step(bundle: Bundle, opts: RunOptions, progress: Progress, target: str,
                  t_dev: torch.device, t_dtype: torch.dtype | None, tmp: Path, reference: str,
                  ref, wrap, notes: list[str], interp: Interpreter | None,
                  used: set[str] = frozenset()) -> tuple[Report, Replayer]:
    """`analyse`'s passes, with the repro's interpreter (if any) already starting."""
    view = Manifest.of(bundle)
    progress("build", "building the task")
    rep = guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry,
                                   run_top_level=opts.run_top_level), "building the task")
    notes += rep.notes
    chain = Chain(rep, Serving.NONE, wrap, progress=progress, guard=guarded)
    first, table = chain.first_pass(target, reference=ref is not None)
    notes += [n for n in [reference_kernels_note(used, target)] if n]
    observed = view.observed
    original = (observed or {}).get("loss")  # a float, or "nan"/"inf" when it was not finite
    compiled = None
    if rep.compiled_spec and first.phase != "input":
        # the capture ran compiled: so does one replay, whose loss is the captured one's peer
        progress("compiled", f"replaying the step compiled ({backend_of(rep)})")
        compiled = replay_compiled(rep, wrap, notes)
    dtype = model_dtype(rep)     # its step tolerance, as --steps uses it
    fidelity = fidelity_check(bundle, rep.entry, original,
                              first.loss if compiled is None else compiled.loss,
                              same_setup=view.captured_type == t_dev.type and t_dtype is None,
                              override=opts.entry is not None, device=t_dev,
                              rtol=(str(dtype).removeprefix("torch."), step_rtol(dtype)),
                              dtype_changed=t_dtype is not None)
    notes += _fidelity_notes(fidelity, target)
    losses = Losses(original, json_number(first.loss), None, fidelity.bit_exact)

    side = None
    if ref is not None and first.phase != "input":
        side, side_note = _reference_side(chain, bundle, first, ref, reference)
        notes += [side_note] if side_note else []
        if side is not None:
            losses = replace(losses, reference=json_number(side.outcome.loss))

    facts = RunFacts(str(bundle.path), view.entry, target, reference, observed, losses,
                     fidelity)
    run = StepRun(chain, opts, facts, table, notes, interp)
    # the verdict is the run's: what fails after it goes into its errors; its repro starts here
    chain.errors, chain.start_repro = run.errors, _repro_starter(run)
    try:
        report = _decide(run, first, side, ref, tmp, compiled)
    finally:
        for started in run.started:   # collected: nothing to do; else (an interrupt) ended
            started.close()
    # the stages after the verdict that failed (`after_verdict`): listed, the rest written
    return replace(report, errors=[*report.errors, *run.errors]), rep


def _decide(run: StepRun, first: StepOutcome, side: "ReferenceSide | None", ref, tmp: Path,
            compiled: StepOutcome | None = None) -> Report:
    """The verdict, and for a culprit the passes that find it (``compiled``: the step replayed
    compiled, for a compiled capture)."""
    facts = run.facts
    failed = recorded_failure(facts.observed)
    divergence = None
    if first.phase is None and not failed and side is not None:
        divergence = side.divergence()
    if divergence is not None:
        run.progress("isolate", "isolating the target's ops on the reference")
        return _divergence_report(run, side, divergence, tmp)
    fid = facts.fidelity
    if undeclared_scaler(facts.observed):
        run.notes.append(UNDECLARED_SCALER)
    note = rebuild_note(facts.observed)
    if note:
        run.notes.append(note)
    if first.phase is None and first.scaler_skipped:
        scale = (Manifest.of(run.rep.bundle).grad_scaler or {}).get("scale")
        run.notes.append(f"the GradScaler skipped this step: its gradients were not finite at "
                         f"scale {scale}; that is normal unless it keeps happening "
                         "(Guard(max_scaler_skips=N) bundles a stalled scaler)")
    if first.phase is None:
        if failed and compiled is not None and compiled.phase is not None:
            return compiler_report(run, compiled, tmp)
        if failed and run.rep.compiled_spec and compiled is None:
            return Report("not-reproduced", "unknown", None, None, None, facts, notes=[
                "the manifest records a non-finite step of a compiled model; the eager replay "
                "is finite and the compiled one could not run here, so a compiler-made failure "
                "cannot be told from a transient", *run.notes])
        if failed:
            return _not_reproduced(run)
        if facts.observed and side is None:
            run.notes.append("the bundle is a loss spike the Guard captured while training went "
                             "on; replay it with --reference cpu (or cpu:float64) to find where "
                             "the target parts from a reference")
        return Report("clean", "replay-mismatch" if fid and fid.mismatch else None, None, None,
                      None, facts, notes=run.notes)
    if first.phase == "input":
        classification, note = before_the_step(first.bad)
        return Report("input-nonfinite", classification, "input", first.kind, None, facts,
                      input_nonfinite=first.bad, notes=run.notes + ([note] if note else []))
    if compiled is not None and compiled.phase is None:
        run.notes.append(opposite_note(backend_of(run.rep)))
    return _culprit_report(run, first, side, ref, tmp)


def undeclared_scaler(observed) -> bool:
    """Did the Guard bundle a stall of steps skipped with no GradScaler on the Task?"""
    return isinstance(observed, dict) and observed.get("undeclared_scaler") is True


def _fidelity_notes(f: Fidelity, target: str) -> list[str]:
    notes = []
    if f.code_changed:
        notes.append("the code differs from the capture's: " + ", ".join(f.code_changed)
                     + "; the replay runs today's code")
    if f.code_missing:
        notes.append("source files the capture ran are not here, so the code cannot be "
                     "compared: " + ", ".join(f.code_missing[:5])
                     + (f" and {len(f.code_missing) - 5} more" if len(f.code_missing) > 5 else ""))
    if f.environment_changed:
        notes.append("the environment differs from the capture's: "
                     + "; ".join(f.environment_changed))
    return notes + tier_notes(f, target)


def _not_reproduced(run: StepRun) -> Report:
    """The recorded failure did not come back: say why that is, as far as the evidence goes."""
    classification, why = classify_not_reproduced(
        run.facts.fidelity, run.facts.target, undeclared_scaler(run.facts.observed))
    return Report("not-reproduced", classification, None, None, None, run.facts,
                  notes=[f"the manifest records a non-finite step, but {why}", *run.notes])


def _reference_side(chain: Chain, bundle: Bundle, first: StepOutcome, ref, reference: str
                    ) -> tuple["ReferenceSide | None", str | None]:
    """Replay on the reference; (None, why) when the reference cannot run the step."""
    rep = chain.rep
    side = chain.reference_side(lambda: Replayer(bundle, ref[0], ref[1], entry=rep.entry,
                                                 run_top_level=rep.run_top_level),
                                reference, first=first)
    try:
        chain.reference(side, first)
    except BadInput as e:
        return None, (f"the reference could not replay the step ({e}); register reference "
                      "implementations with nanbisect.reference_impl for ops it has no kernel "
                      "for; classification is unknown")
    return side, None


def _repro_starter(run: StepRun):
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


def _divergence_report(run: StepRun, side: ReferenceSide, div: Divergence, tmp: Path) -> Report:
    phase, chain = div.phase, run.chain
    call, finding, check, checked, uncomparable = chain.isolate(
        phase, run.table, side.probe.read(), side.device, side.target_dtype)
    notes = [f"target and reference diverge first at {div.what}: "
             + div.comparison.message().replace("\n", "; ")]
    if uncomparable:
        notes.append(f"{len(uncomparable)} op(s) could not be compared (no reference kernel "
                     "or registered reference_impl): " + ", ".join(sorted({u.op for u in
                                                                          uncomparable})))
    caught = chain.catch_diverging(finding.site) if finding is not None else None
    if finding is None and call is not None:
        notes.append(f"every op inside the diverging module call passed its isolated check "
                     f"({checked} checked): the divergence comes from the call as a "
                     "whole (e.g. an op without a comparable reference)")
    elif finding is None:
        notes.append("no module call or op could be isolated as the first divergence")
    done = chain.finish_divergence(phase, finding, caught, call, check, tmp / "repro",
                                   run.facts.target)
    if done.culprit is not None:
        _announce(run, Report("culprit", "unknown", phase, "mismatch", done.culprit, run.facts))
    classification = "device" if check is not None else "unknown"
    if run.facts.fidelity is not None and run.facts.fidelity.mismatch:
        classification = "replay-mismatch"
    stage = _guard(run)
    return Report("culprit", classification, phase, "mismatch", done.culprit, run.facts,
                  notes=notes, repro="repro/repro.py" if done.repro else None,
                  timeline=stage("context", lambda: timeline(run.table, phase), []),
                  repro_result=(stage("repro", done.pending, None) if done.pending
                                else None),
                  divergence=div, op_check=check, uncomparable=uncomparable)


def _culprit_report(run: StepRun, first: StepOutcome, side: ReferenceSide | None, ref,
                    tmp: Path) -> Report:
    chain, table = run.chain, run.table
    loc = chain.locate(first, table)
    phase, kind, finding, call = loc.phase, loc.kind, loc.finding, loc.call
    notes = list(run.notes) + _finding_notes(loc)
    done, culprit = chain.finish(loc, tmp / "repro", run.facts.target,
                                 check_on=ref[0] if ref is not None else None)
    if finding is not None and loc.caught is not None and handed_bad(loc.caught, kind):
        culprit = _outside_dispatcher(culprit, finding, kind)
    _announce(run, Report("culprit", "unknown", phase, kind, culprit, run.facts))
    # the verdict is known: what each stage below adds is left out when it fails (`errors`)
    stage = _guard(run)
    trace, table_rows = stage("context", lambda: (
        backtrace(table, call, phase, kind) if call is not None and phase != "optimizer"
        else [], timeline(table, phase)), ([], []))
    op_check = done.op_check
    wrong_here = op_check is not None and op_check.status == "mismatch" and ref is not None
    remedies = stage("remedies", lambda: chain.remedies(
        culprit, finding, loc.traced, remedy_budget(run.opts.remedies),
        kernel_on=ref if wrong_here else None), [])
    repro_result = stage("repro", done.pending, None) if done.pending else None
    module_repro = None
    if done.repro is not None and repro_result and not repro_result.reproduced:
        module_repro = _unreproduced(run, chain, culprit, kind, tmp, notes)
    surfaced_repro = (stage("surfaced-repro",
                            lambda: _surfaced_repro(run, chain, finding, kind, tmp, notes), None)
                      if finding is not None and finding.surfaced_site is not None
                      and loc.caught is not None else None)
    mismatch = run.facts.fidelity is not None and run.facts.fidelity.mismatch
    classification, why = stage("classification",
                                lambda: chain.classify(side, op_check, mismatch),
                                ("unknown", []))
    return Report(
        "culprit", classification, phase, kind, culprit, run.facts, backtrace=trace,
        timeline=table_rows, notes=notes + why,
        repro="repro/repro.py" if done.repro else None, repro_result=repro_result,
        inf_origin=finding.inf_origin if finding else None,
        context=finding.context if finding else [], op_check=op_check,
        module_repro=module_repro, surfaced_repro=surfaced_repro,
        op_recording=(OpRecording(finding.scope, phase, finding.recorded, finding.total_ops,
                                  finding.phases) if finding else None),
        uncomparable=[op_check] if op_check and op_check.status == "uncomparable" else [],
        remedies=remedies)


def _announce(run: StepRun, known: Report) -> None:
    """Tell the progress callback the culprit (`CULPRIT`) as soon as it is known: the headline
    and the source line, before the remedies, the repro's wait and the report (the CLI prints
    it at once: a run stopped after it still said what it found)."""
    c = known.culprit
    text = headline(known) + (f"; source {c.source}" if c is not None and c.source else "")
    run.progress(CULPRIT, text)


def handed_bad(caught: Caught, kind: str) -> bool:
    """Did the op caught as the root read ``kind`` after all? The recording flagged its inputs
    clean where they were made; holding it now, they were written since by work the
    dispatcher did not see."""
    nan, inf = nan_inf_counts([t for t in tree_leaves((caught.args, caught.kwargs))
                               if isinstance(t, torch.Tensor)])
    return bool(nan or (kind != "nan" and inf))


OUTSIDE_DISPATCHER = "inside work that does not pass through the dispatcher"


def _outside_dispatcher(culprit: Culprit, finding: OpFinding, kind: str) -> Culprit:
    """The culprit when no aten op made the value: the module call it went bad in, no op, and
    the op that first read it named as handed it (never blamed)."""
    where = at_module(finding.module, finding.module_call, finding.phase)
    said = (f"no aten op made this {kind}: it went bad {OUTSIDE_DISPATCHER} (a C++, pybind or "
            f"Triton kernel called directly, a write through .numpy() or a data pointer) "
            f"in {finding.phase} at {where}; {finding.op} (op #{finding.op_index}), the first "
            "op that read it, was handed it")
    return replace(culprit, op=None, op_index=None, source=None, likely_cause=said)


def _finding_notes(loc: Located) -> list[str]:
    """What the report says about passes 2 and 3."""
    if loc.finding is None:
        return ["op-level provenance found no root op inside the recorded phase; the culprit is "
                "the module call that produced the value"]
    notes = [_surfaced_note(loc.finding, loc.kind)] if loc.finding.surfaced is not None else []
    if loc.caught is None:
        notes.append("the culprit op could not be caught again in a narrow replay (the step is "
                     "not deterministic); no repro was written")
    return notes


def _unreproduced(run: StepRun, chain: Chain, culprit: Culprit, kind: str, tmp: Path,
                  notes: list[str]) -> ModuleRepro | None:
    """The op alone did not reproduce: why (an injected kernel), or its module call's repro."""
    target = run.facts.target
    if run.opts.inject:
        notes.append(f"the repro did not reproduce on {target}: it runs the op without "
                     f"--inject {run.opts.inject}, which emulated the fault here; run "
                     "repro/repro.py on the device that has the faulty kernel")
        return None
    if culprit.phase not in ("forward", "backward") or not culprit.module \
            or culprit.module_call is None:
        return None
    run.progress("module-repro", "the op alone did not reproduce: catching its module call")
    failed = len(run.errors)
    module_repro = _guard(run)("module-repro",
                               lambda: _module_fallback(run, chain, culprit, kind, tmp), None)
    worked = (module_repro is not None and module_repro.result is not None
              and module_repro.result.reproduced)
    notes.append("the culprit op alone did not reproduce (it depends on state outside its "
                 "inputs); module_repro replays its module call with the module's state: " + (
                     "it could not be made (see errors)" if len(run.errors) > failed
                     else "reproduced" if worked else "did not reproduce either"))
    return module_repro


def _guard(run: StepRun):
    """``(stage, fn, default) -> fn() or default``: `after_verdict` into this run's errors."""
    return lambda stage, fn, default: after_verdict(run.errors, stage, fn, default)


def _surfaced_note(f: OpFinding, kind: str) -> str:
    """In words: where a failure was born, how that phase hid it, where it surfaced."""
    def at(module: str | None, call: int | None) -> str:
        return module_label(module or "") + (f", call {call}" if call is not None else "")
    s = f.surfaced
    kind = f"as {kind} " if kind != f.born else ""
    return (f"{f.born} born in {f.op} in {f.phase} ({at(f.module, f.module_call)}), {f.hidden}, "
            f"surfaced {kind}in {s.phase} at {s.op} ({at(s.module, s.module_call)}): the culprit "
            "is where it was born, culprit.surfaced where it became visible")


def _surfaced_repro(run: StepRun, chain: Chain, finding: OpFinding, kind: str, tmp: Path,
                    notes: list[str]) -> ModuleRepro | None:
    """Catch the op where a failure born earlier surfaced and write (and run once) its repro,
    ``repro/surfaced/repro.py``: it shows how the earlier phase's value turns into the
    failure (the saved rstd inf into NaN in layer norm's backward). Its outcome goes into
    ``notes``."""
    s = finding.surfaced
    caught = chain.catch_surfaced(finding)
    if caught is None:
        return None
    tensors = [t for t in tree_leaves((caught.args, caught.kwargs))
               if isinstance(t, torch.Tensor)]
    culprit = Culprit.of_tensors(s.phase, CallId(s.module or "", s.module_call), tensors,
                                 source=caught.source, op=s.op, op_index=s.op_index)
    script = write_repro(tmp / "repro" / "surfaced", caught, culprit=culprit, kind=kind,
                         target=run.facts.target, imports=repro_imports(caught.op,
                                                                        run.rep.entry),
                         role="Where a failure born earlier surfaced (its culprit: ../repro.py)")
    start = chain.start_repro
    res = start(script, caught)() if start is not None else None
    notes.append(f"repro/surfaced/repro.py re-runs {s.op}, where it surfaced, from its inputs in "
                 f"{s.phase}" + ("" if res is None else ": reproduced" if res.reproduced
                                 else ": did not reproduce"))
    return ModuleRepro("repro/surfaced/repro.py", res)


def _module_fallback(run: StepRun, chain: Chain, culprit: Culprit, kind: str, tmp: Path
                     ) -> ModuleRepro | None:
    """Write (and run once) a repro of the culprit's whole module call, with its state."""
    mc = chain.catch_module_call(culprit)
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
