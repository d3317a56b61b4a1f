"""One step: the module pass on the target, the reference side, fidelity, and the verdict:
clean, input-nonfinite, not-reproduced (and why), or a culprit (`culprit`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect.bundle.format import Bundle
from nanbisect.errors import UNDECLARED_SCALER, BadInput
from nanbisect.report.prose import rebuild_note
from nanbisect.pipeline.common import (Progress, RunOptions, _guarded, _Run, captured_type,
                                       reference_kernels_note, target_wrap,
                                       recorded_failure)
from nanbisect.pipeline.compiled import (backend_of, compiler_report, opposite_note,
                                         replay_compiled)
from nanbisect.pipeline.culprit import _culprit_report, _divergence_report
from nanbisect.records import Fidelity, Losses, RunFacts, StepOutcome, json_number
from nanbisect.reference import kernels as registry
from nanbisect.reference.classify import classify_not_reproduced
from nanbisect.reference.compare import step_rtol
from nanbisect.reference.differential import RandomTape, step_state
from nanbisect.reference.side import ReferenceSide, model_dtype
from nanbisect.replay.fidelity import check as fidelity_check
from nanbisect.replay.fidelity import match_threads, tier_notes
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.report.model import Report
from nanbisect.report.rerun import Interpreter, take


def _analyse(bundle: Bundle, opts: RunOptions, progress: Progress, target: str,
             t_dev: torch.device, t_dtype: torch.dtype | None, tmp: Path,
             ref: tuple[torch.device, torch.dtype | None] | None) -> tuple[Report, Replayer]:
    """One step: replay, reference, verdict and the passes that find a culprit (``ref``: the
    reference `run_bundle` resolved from ``opts.reference``, None for none)."""
    m = bundle.manifest
    reference = str(opts.reference)
    wrap, used = target_wrap(opts, m, t_dev)
    notes = [n for n in [match_threads(bundle, t_dev)] if n]
    interp = None
    if opts.run_repro and not devices.entry(t_dev).forkable and (
            recorded_failure(m.get("observed")) or ref is not None):
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
    """`_analyse`'s passes, with the repro's interpreter (if any) already starting."""
    m = bundle.manifest
    progress("build", "building the task")
    rep = _guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry,
                                    run_top_level=opts.run_top_level), "building the task")
    notes += rep.notes
    probe = ModuleProbe(rep.task.model)
    tape = RandomTape()

    progress("module-pass", f"pass 1/3: replaying the step on {target} with module statistics")
    # the injected context first: the tape, inside it, sees what it returns
    first = _guarded(lambda: rep.run(phase=probing(probe), wrap=lambda: stacked(
        wrap(), *([tape] if ref is not None else []))),
                     "replaying the step on the target")
    notes += [n for n in [reference_kernels_note(used, target)] if n]
    observed = m.get("observed")
    original = (observed or {}).get("loss")  # a float, or "nan"/"inf" when it was not finite
    compiled = None
    if rep.compiled_spec and first.phase != "input":
        # the capture ran compiled: so does one replay, whose loss is the captured one's peer
        progress("compiled", f"replaying the step compiled ({backend_of(rep)})")
        compiled = replay_compiled(rep, wrap, notes)
    dtype = model_dtype(rep)     # its step tolerance, as --steps uses it
    fidelity = fidelity_check(bundle, rep.entry, original,
                              first.loss if compiled is None else compiled.loss,
                              same_setup=captured_type(m) == t_dev.type and t_dtype is None,
                              override=opts.entry is not None, device=t_dev,
                              rtol=(str(dtype).removeprefix("torch."), step_rtol(dtype)),
                              dtype_changed=t_dtype is not None)
    notes += _fidelity_notes(fidelity, target)
    losses = Losses(original, json_number(first.loss), None, fidelity.bit_exact)

    side = None
    if ref is not None and first.phase != "input":
        registry.load_plugins()
        progress("reference", f"replaying the step on the reference ({reference})")
        side, side_note = _reference_side(bundle, rep, first, ref, tape)
        notes += [side_note] if side_note else []
        if side is not None:
            losses = replace(losses, reference=json_number(side.outcome.loss))

    facts = RunFacts(str(bundle.path), m["entry"], target, reference, observed, losses,
                     fidelity)
    run = _Run(rep, probe, wrap, opts, facts, progress, notes, interp)
    try:
        report = _decide(run, first, side, ref, tmp, compiled)
    finally:
        for started in run.started:   # collected: nothing to do; else (an interrupt) ended
            started.close()
    # the stages after the verdict that failed (`after_verdict`): listed, the rest written
    return replace(report, errors=[*report.errors, *run.errors]), rep


def _decide(run: _Run, first: StepOutcome, side: "ReferenceSide | None", ref, tmp: Path,
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
        scale = (run.rep.bundle.manifest.get("grad_scaler") or {}).get("scale")
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
        return Report("input-nonfinite", "data", "input", first.kind, None, facts,
                      input_nonfinite=first.bad, notes=run.notes)
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


def _not_reproduced(run: _Run) -> Report:
    """The recorded failure did not come back: say why that is, as far as the evidence goes."""
    classification, why = classify_not_reproduced(
        run.facts.fidelity, run.facts.target, undeclared_scaler(run.facts.observed))
    return Report("not-reproduced", classification, None, None, None, run.facts,
                  notes=[f"the manifest records a non-finite step, but {why}", *run.notes])


def _reference_side(bundle: Bundle, rep: Replayer, first: StepOutcome, ref, tape: RandomTape
                    ) -> tuple["ReferenceSide | None", str | None]:
    """Replay on the reference; (None, why) when the reference cannot run the step."""
    target_state = step_state(rep, first)
    ref_rep = _guarded(lambda: Replayer(bundle, ref[0], ref[1], entry=rep.entry,
                                        run_top_level=rep.run_top_level),
                       "building the task on the reference")
    side = ReferenceSide(ref_rep, ref[1], target_state, model_dtype(rep))
    try:
        _guarded(lambda: side.run(tape), "replaying the step on the reference")
    except BadInput as e:
        return None, (f"the reference could not replay the step ({e}); register reference "
                      "implementations with nanbisect.reference_impl for ops it has no kernel "
                      "for; classification is unknown")
    return side, None
