"""A culprit's report: the op-recording and input-catch passes, the finisher (`nanbisect.finish`:
culprit, repro started in the background, op check), the module-call repro when the op alone
does not reproduce, and the classification from the evidence; or, without NaN, the isolated
first divergence from the reference.
"""
from __future__ import annotations

from pathlib import Path

import torch

from nanbisect.chain import Chain, Located, Serving
from nanbisect.finish import Evidence, classify_culprit
from nanbisect.locate.producers import backtrace, timeline
from nanbisect.pipeline.common import _guarded, _Run, after_verdict
from nanbisect.records import (CallId, Caught, Culprit, Divergence, ModuleRepro, OpCheck, OpFinding,
                               OpRecording, StepOutcome, module_label)
from nanbisect.reference.side import ReferenceSide
from nanbisect.remedies import budget as remedy_budget
from nanbisect.report.model import Report
from nanbisect.report.repro import device_of, repro_imports, write_module_repro, write_repro
from nanbisect.report.rerun import ServerFork, runner
from nanbisect.util.torch_internals import tree_leaves


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


def _chain(run: _Run) -> Chain:
    """The pass chain of this run: one process, the run's injection around every replay, user
    code failing as a one-line `BadInput`."""
    return Chain(run.rep, Serving.NONE, run.wrap, progress=run.progress, guard=_guarded,
                 errors=run.errors, start_repro=_repro_starter(run))


def _divergence_report(run: _Run, side: ReferenceSide, div: Divergence, tmp: Path) -> Report:
    phase, chain = div.phase, _chain(run)
    call, finding, check, checked, uncomparable = chain.isolate(
        phase, run.probe.read(), side.probe.read(), side.device, side.target_dtype)
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
    chain, table = _chain(run), run.probe.read()
    loc = chain.locate(first, table)
    phase, kind, finding, call = loc.phase, loc.kind, loc.finding, loc.call
    notes = list(run.notes) + _finding_notes(loc)
    done, culprit = chain.finish(loc, tmp / "repro", run.facts.target,
                                 check_on=ref[0] if ref is not None else None)
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
    classification, why = stage("classification",
                                lambda: classify_culprit(_evidence(run, side, op_check)),
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


def _unreproduced(run: _Run, chain: Chain, culprit: Culprit, kind: str, tmp: Path,
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


def _guard(run: _Run):
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


def _surfaced_repro(run: _Run, chain: Chain, finding: OpFinding, kind: str, tmp: Path,
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


def _module_fallback(run: _Run, chain: Chain, culprit: Culprit, kind: str, tmp: Path
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
