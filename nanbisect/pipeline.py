"""`run_bundle`: bundle -> replay(target) [+ replay(reference)] -> phase -> module -> op -> report.

Passes over the step, each from the bundle's pre-step state:
  1. module statistics over the whole step (cheap: one small reduction per module call);
     decides reproduction and phase, and gives the module backtrace;
  2. op recording over the failing phase only; provenance from the failed value to its root op;
  3. a narrow replay that clones the root op's inputs (and takes the only Python stack), for the
     standalone repro, which then runs once where nanbisect cannot be imported by it: on the CPU
     in a fork of this process (torch loaded), elsewhere in a fresh interpreter started when the
     run began (its ``import torch`` overlapped the passes; `nanbisect.report.rerun`), while this
     process re-runs the culprit op on the reference.
A failure recorded in the manifest that the replay does not show is reported as
``not-reproduced``, never given an invented culprit. Each pass is announced to ``progress`` with
a stable key from `STAGES` and a text for people, so callers can show or time the passes.
"""
from __future__ import annotations

import shutil
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle import lookback
from nanbisect.bundle.format import Bundle, read_bundle
from nanbisect.errors import BadInput
from nanbisect.locate.catch import catch_inputs, catch_module_call
from nanbisect.locate.ops import record_ops
from nanbisect.locate.producers import (backtrace, backward_producer, first_bad_parameter,
                                        forward_producer, timeline)
from nanbisect.multirank.alone import check_tape
from nanbisect.multirank.launcher import parse_ranks, run_multirank
from nanbisect.records import (CallId, Caught, Culprit, Divergence, Fidelity, Losses,
                               ModuleRepro, OpCheck, OpRecording, RunFacts, StepOutcome,
                               json_number)
from nanbisect.reference import kernels as registry
from nanbisect.finish import Evidence, classify_culprit, finish
from nanbisect.reference.differential import (RandomTape, diverging_call, isolate_window,
                                              step_state)
from nanbisect.reference.side import ReferenceSide, model_dtype
from nanbisect.replay.fidelity import check as fidelity_check
from nanbisect.replay.fidelity import match_threads
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer, parse_device, stacked
from nanbisect.reference.window import replay_window
from nanbisect.report.model import Report
from nanbisect.report.repro import write_module_repro
from nanbisect.report.rerun import Fork, Interpreter, run_repro, take
from nanbisect.report.write import DEFAULT_NAME, check_out, staged, write_report
from nanbisect.task import load_inject

# What `run_bundle` tells its ``progress(key, text)`` callback, in the order it can happen.
STAGES = ("steps", "build", "module-pass", "reference", "op-recording", "isolate",
          "input-catch", "repro", "module-repro", "op-check", "report", "ranks")
Progress = Callable[[str, str], None]


@dataclass(frozen=True)
class RunOptions:
    target: str | None = None
    reference: str | None = None
    inject: str | None = None
    entry: str | None = None
    run_repro: bool = True
    ranks: str | None = None      # "R,..." (multi-rank): replay only these, each alone
    steps: int | None = None      # --steps K: replay the last K recorded steps (lookback)


def recorded_failure(observed) -> bool:
    """Does the manifest record a failure (not a spike a Guard captured while training went on)?"""
    return bool(observed) and not (isinstance(observed, dict) and observed.get("first") == "spike")


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


class _Clock:
    """The progress callback's wrapper that times the passes: each from its announcement to the
    next; "read" is what came before the first (reading and checking the bundle)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.marks: list[tuple[str, float]] = [("read", time.perf_counter())]

    def __call__(self, key: str, text: str) -> None:
        self.marks.append((key, time.perf_counter()))
        self.progress(key, text)

    def seconds(self) -> dict[str, float]:
        now, out = time.perf_counter(), {}
        for (key, t), nxt in zip(self.marks, [m[1] for m in self.marks[1:]] + [now]):
            out[key] = round(out.get(key, 0.0) + nxt - t, 4)
        return out


@dataclass
class _Run:
    """What every pass of one run needs (private to this module)."""

    rep: Replayer
    probe: ModuleProbe
    wrap: Callable[[], ContextManager]
    opts: RunOptions
    facts: RunFacts
    progress: Progress
    notes: list[str] = field(default_factory=list)
    interp: Interpreter | None = None   # started ahead for the repro's run (opts.run_repro)


def run_bundle(path: str | Path, opts: RunOptions = RunOptions(), out: Path | None = None,
               progress: Progress = lambda key, text: None) -> Report:
    """Replay a bundle, bisect its failure down to an op, write the report directory.

    ``out`` defaults to ``BUNDLE/nanbisect-report``; it is replaced atomically, and only when it
    is absent, empty or an earlier report (anything else is refused before the replay starts:
    `nanbisect.report.write.check_out`).

    >>> import tempfile
    >>> report = run_bundle("fixtures/bundles/forward_nan_behind_mask",
    ...                     RunOptions(run_repro=False), Path(tempfile.mkdtemp()) / "r")
    >>> report.culprit.op, report.culprit.module, report.culprit.module_call
    ('aten.sqrt.default', 'blocks.1.mlp.act', 2)
    """
    clock = _Clock(progress)
    # --ranks: verify only the parts replayed (a 1,000-rank bundle is not hashed whole for one)
    bundle = read_bundle(path, verify=opts.ranks is None)
    m = bundle.manifest
    out = check_out(out if out is not None else bundle.path / DEFAULT_NAME, bundle.path)
    target = opts.target or _default_target(m)
    t_dev, t_dtype = parse_device(target)
    if opts.ranks is not None and not bundle.multi_rank:
        raise BadInput(f"--ranks {opts.ranks}: bundle '{bundle.path}' has one rank; drop --ranks")
    if opts.steps is not None and bundle.multi_rank:
        raise BadInput(f"--steps {opts.steps}: bundle '{bundle.path}' is multi-rank; replaying "
                       "several steps is for single-process bundles yet: drop --steps")
    if bundle.multi_rank:
        subset = parse_ranks(opts.ranks, bundle.world_size) if opts.ranks is not None else None
        if subset is not None:
            check_tape(bundle, subset)     # verifies each replayed part, and what it references
        reference = opts.reference or devices.default_reference(t_dev)
        if reference != "none":
            parse_device(reference)   # a bad --reference fails here, before any rank starts
        if opts.inject:
            load_inject(opts.inject)  # a bad --inject fails here, before any rank starts
        progress("ranks", (f"replaying {bundle.world_size} ranks" if subset is None else
                           f"replaying rank(s) {subset} of {bundle.world_size} alone")
                 + f" on {target}" + (f" and on {reference}" if reference != "none" else ""))
        return run_multirank(bundle, target, opts.inject, out, opts.run_repro, entry=opts.entry,
                             reference=None if reference == "none" else reference,
                             ranks=subset)
    threads = torch.get_num_threads()
    try:
        return _run_bundle(bundle, opts, out, clock, target, t_dev, t_dtype)
    finally:
        torch.set_num_threads(threads)     # the capture's count was this run's only


def _run_bundle(bundle: Bundle, opts: RunOptions, out: Path, progress: _Clock, target: str,
                t_dev: torch.device, t_dtype: torch.dtype | None) -> Report:
    where = f"bundle '{bundle.path}'"
    history = hist.parse(bundle.manifest, bundle.tensors(hist.ROLE), where)
    window = None
    if opts.steps is not None:
        window = lookback.parse(bundle, where)
        if window is None:
            raise BadInput(f"--steps {opts.steps}: {where} records only its failing step; capture "
                           "with Guard(..., lookback=K) to replay the steps before it, or drop "
                           "--steps")
    with staged(out, bundle.path) as tmp:
        if window is not None:
            report, rep = _run_steps(bundle, window, history, opts, progress, target, t_dev,
                                     t_dtype, tmp)
        else:
            report, rep = _analyse(bundle, opts, progress, target, t_dev, t_dtype, tmp)
        if history is not None:
            model = opt = None
            if rep is not None and rep.bundle is bundle:   # the failing step's pre-state
                rep.restore()
                model, opt = rep.task.model, rep.task.optimizer
            report = replace(report, history=history.to_json(),
                             history_findings=hist.findings(history, model, opt))
        report = replace(report, timings=progress.seconds())
        progress("report", "writing the report")
        write_report(report, tmp)
    return report


def _run_steps(bundle: Bundle, window: "lookback.Window", history: "hist.History | None",
               opts: RunOptions, progress: Progress, target: str, t_dev: torch.device,
               t_dtype: torch.dtype | None, tmp: Path) -> tuple[Report, Replayer | None]:
    """--steps K: the window on both sides, then the first step that parts bisected alone."""
    k = opts.steps
    reference = opts.reference or devices.default_reference(t_dev)
    if reference == "none":
        raise BadInput(f"--steps {k} compares the target's steps with a reference's; pass "
                       "--reference cpu (or cpu:float64)")
    ref = parse_device(reference)
    wrap = load_inject(opts.inject) if opts.inject else nullcontext
    note = match_threads(bundle, t_dev)
    losses = {e["step"]: e.get("loss") for e in (history.entries if history else [])}
    progress("steps", f"replaying the last {k} recorded steps on {target} and {reference}")
    registry.load_plugins()
    res = _guarded(lambda: replay_window(bundle, window, k, (t_dev, t_dtype), ref, wrap,
                                         opts.entry, losses,
                                         lambda text: progress("steps", text)),
                   "replaying the recorded steps")
    failing = window.steps[-1]["step"]
    notes = ([note] if note else []) + res.notes
    rows = {r.step: r for r in res.rows}
    steps_json = res.to_json()
    before = rows.get(failing - 1)
    steps_json["failing_prestate_max_rel_diff"] = before.max_rel_diff if before else None
    report = rep = None
    analysed = failing
    if res.step_view is not None:
        s = res.first_divergent_step
        progress("steps", f"bisecting step {s}, the first that parts from the reference")
        report, rep = _analyse(res.step_view, opts, progress, target, t_dev, t_dtype, tmp)
        if report.verdict == "clean":
            notes.append(f"step {s} is the first whose state parts from the reference's over "
                         "the window, but replayed alone from one state on both sides it stays "
                         "within tolerance: the difference built up over the steps before it "
                         "(rounding that compounds); the failing step is bisected instead")
            for child in tmp.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            report = None
        else:
            analysed = s
    if report is None:
        report, rep = _analyse(bundle, opts, progress, target, t_dev, t_dtype, tmp)
    if res.first_divergent_step is None:
        notes.append(f"the {len(res.rows)} replayed step(s) stay within tolerance of the "
                     "reference: nothing parts before the failing step")
    elif analysed != failing:
        drift = steps_json["failing_prestate_max_rel_diff"]
        notes.append(f"target and reference part first at step {analysed}, "
                     f"{failing - analysed} step(s) before the failing step {failing}; the culprit "
                     f"is that step's first diverging op" + (
                         f"; by the failing step the parameters had drifted by a relative "
                         f"{drift:.3g}" if isinstance(drift, float) else ""))
    culprit = report.culprit
    if culprit is not None:
        culprit = replace(culprit, step=analysed)
    facts = replace(report.facts, observed=bundle.manifest.get("observed"))
    classification = report.classification
    captured = str((bundle.manifest.get("devices") or {}).get("captured_on", "cpu"))
    reached = res.reached
    if reached is not None and (not reached["bit_exact"] or reached["first_step_off_history"]
                                is not None) and t_dtype is None and \
            torch.device(captured).type == t_dev.type:
        # on the capture device the window must reach the recorded state: it did not, so the
        # replayed steps are not the run's and no verdict about the device follows from them
        classification = "replay-mismatch"
    return replace(report, culprit=culprit, facts=facts, steps=steps_json,
                   classification=classification, notes=[*notes, *report.notes]), rep


def _analyse(bundle: Bundle, opts: RunOptions, progress: Progress, target: str,
             t_dev: torch.device, t_dtype: torch.dtype | None, tmp: Path
             ) -> tuple[Report, Replayer]:
    """One step: replay, reference, verdict and the passes that find a culprit."""
    m = bundle.manifest
    reference = opts.reference or devices.default_reference(t_dev)
    ref = None if reference == "none" else parse_device(reference)
    wrap = load_inject(opts.inject) if opts.inject else nullcontext
    notes = [n for n in [match_threads(bundle, t_dev)] if n]
    interp = None
    if opts.run_repro and t_dev.type != "cpu" and (recorded_failure(m.get("observed"))
                                                   or ref is not None):
        # the repro's interpreter imports torch while the passes below find what it will run
        # (on the CPU the repro of a built-in op runs in a fork of this process instead)
        interp = take()
    try:
        return _analyse_step(bundle, opts, progress, target, t_dev, t_dtype, tmp, reference,
                             ref, wrap, notes, interp)
    finally:
        if interp is not None:
            interp.close()


def _analyse_step(bundle: Bundle, opts: RunOptions, progress: Progress, target: str,
                  t_dev: torch.device, t_dtype: torch.dtype | None, tmp: Path, reference: str,
                  ref, wrap, notes: list[str], interp: Interpreter | None
                  ) -> tuple[Report, Replayer]:
    """`_analyse`'s passes, with the repro's interpreter (if any) already starting."""
    m = bundle.manifest
    progress("build", "building the task")
    rep = _guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry), "building the task")
    notes += rep.notes
    probe = ModuleProbe(rep.task.model)
    tape = RandomTape()

    progress("module-pass", f"pass 1/3: replaying the step on {target} with module statistics")
    # the injected context first: the tape, inside it, sees what it returns
    first = _guarded(lambda: rep.run(phase=probing(probe), wrap=lambda: stacked(
        wrap(), *([tape] if ref is not None else []))),
                     "replaying the step on the target")
    observed = m.get("observed")
    original = (observed or {}).get("loss")  # a float, or "nan"/"inf" when it was not finite
    captured = torch.device(str((m.get("devices") or {}).get("captured_on", "cpu")))
    fidelity = fidelity_check(bundle, rep.entry, original, first.loss,
                              same_setup=captured.type == t_dev.type and t_dtype is None,
                              override=opts.entry is not None)
    notes += _fidelity_notes(fidelity)
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
    return _decide(run, first, side, ref, tmp), rep


def _decide(run: _Run, first: StepOutcome, side: "ReferenceSide | None", ref, tmp: Path) -> Report:
    """The verdict, and for a culprit the passes that find it."""
    facts = run.facts
    failed = recorded_failure(facts.observed)
    divergence = None
    if first.phase is None and not failed and side is not None:
        divergence = side.divergence()
    if divergence is not None:
        run.progress("isolate", "isolating the target's ops on the reference")
        return _divergence_report(run, side, divergence, tmp)
    fid = facts.fidelity
    if first.phase is None and first.scaler_skipped:
        scale = (run.rep.bundle.manifest.get("grad_scaler") or {}).get("scale")
        run.notes.append(f"the GradScaler skipped this step: its gradients were not finite at "
                         f"scale {scale}; that is normal unless it keeps happening "
                         "(Guard(max_scaler_skips=N) bundles a stalled scaler)")
    if first.phase is None:
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
    return _culprit_report(run, first, side, ref, tmp)


def _fidelity_notes(f: Fidelity) -> list[str]:
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
    if f.mismatch:
        notes.append("the replay does not compute the captured step: on the capture device and "
                     "dtype its loss differs from the captured one (bit_exact false); likely "
                     f"causes: {f.causes()}")
    return notes


def _not_reproduced(run: _Run) -> Report:
    """The recorded failure did not come back: say why that is, as far as the evidence goes."""
    f, facts = run.facts.fidelity, run.facts
    if f is not None and f.code_changed:
        classification, why = "code-changed", (
            "the replay ran different code from the capture's (listed above): the edit, not the "
            "hardware, is the first suspect; replay with the captured code to tell")
    elif f is not None and f.mismatch:
        classification, why = "replay-mismatch", (
            "the replay does not compute the captured step, so it cannot tell whether the "
            "failure would come back; make the Task describe the loop")
    elif f is not None and f.faithful is None and not f.same_setup:
        classification, why = "unknown", (
            f"the replay ran on {facts.target}, not on the capture device: a fault of that "
            "device or its kernels would not show here; replay on the capture device")
    elif f is not None and f.code_missing:
        classification, why = "unknown", (
            "source files of the capture are missing here (listed above), so the replay may not "
            "run the captured code; replay where the training code is")
    elif f is not None and f.environment_changed:
        classification, why = "unknown", (
            "the replay ran with other versions than the capture (listed above): a change in "
            "them is as likely a cause as a transient; replay with the captured versions")
    else:
        classification, why = "transient", (
            "the replay ran the captured code from the same state, RNG and batch"
            + (", with the captured loss bit for bit," if f is not None and f.faithful else "")
            + " and was finite: suspect a transient (hardware, race, unsynchronised "
            "communication)")
    return Report("not-reproduced", classification, None, None, None, facts,
                  notes=[f"the manifest records a non-finite step, but {why}", *run.notes])


def _evidence(run: _Run, side: "ReferenceSide | None", op_check: OpCheck | None) -> Evidence:
    """What a culprit's classification is decided from, in a single-process run."""
    mismatch = run.facts.fidelity is not None and run.facts.fidelity.mismatch
    if side is None:
        return Evidence("none", None, torch.float32, op_check, mismatch)
    return Evidence("failed" if side.failed else "finite", side.dtype, side.target_dtype,
                    op_check, mismatch)


def _reference_side(bundle: Bundle, rep: Replayer, first: StepOutcome, ref, tape: RandomTape
                    ) -> tuple["ReferenceSide | None", str | None]:
    """Replay on the reference; (None, why) when the reference cannot run the step."""
    target_state = step_state(rep, first)
    ref_rep = _guarded(lambda: Replayer(bundle, ref[0], ref[1], entry=rep.entry),
                       "building the task on the reference")
    side = ReferenceSide(ref_rep, ref[1], target_state, model_dtype(rep))
    try:
        _guarded(lambda: side.run(tape), "replaying the step on the reference")
    except BadInput as e:
        return None, (f"the reference could not replay the step ({e}); register reference "
                      "implementations with nanbisect.reference_impl for ops it has no kernel "
                      "for; classification is unknown")
    return side, None


def _repro_starter(run: _Run):
    """How this run starts the repro's one run (None without opts.run_repro): on the CPU, for a
    built-in op, a fork of this process; else the interpreter started ahead (or a new one)."""
    if not run.opts.run_repro:
        return None

    def start(script: Path, caught: Caught):
        if Fork.usable(run.rep.device.type, caught.op):
            runner = Fork()
        else:
            runner, run.interp = run.interp or Interpreter(), None  # one script per interpreter
        runner.submit(script, run.facts.target)

        def result():
            run.progress("repro", "waiting for the repro's run")
            return runner.result()
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
                  start_repro=_repro_starter(run), progress=run.progress)
    classification = "device" if check is not None else "unknown"
    if run.facts.fidelity is not None and run.facts.fidelity.mismatch:
        classification = "replay-mismatch"
    return Report("culprit", classification, phase, "mismatch", done.culprit, run.facts,
                  notes=notes, repro="repro/repro.py" if done.repro else None,
                  timeline=timeline(run.probe.read(), phase),
                  repro_result=done.pending() if done.pending else None,
                  divergence=div, op_check=check, uncomparable=uncomparable)


def _culprit_report(run: _Run, first: StepOutcome, side: ReferenceSide | None, ref,
                    tmp: Path) -> Report:
    rep, opts, target = run.rep, run.opts, run.facts.target
    model, phase, kind = rep.task.model, first.phase, first.kind or "nan"
    notes = list(run.notes)
    table = run.probe.read()
    call, parameter = None, None
    if phase == "forward":
        call = forward_producer(table, kind)
    elif phase == "backward":
        call, parameter = backward_producer(table, kind)
    elif phase == "optimizer":
        parameter = first_bad_parameter(model, [b.name for b in first.bad])

    run.progress("op-recording", f"pass 2/3: recording the {phase} phase's ops")
    scope = call.call if phase == "forward" and call is not None else None
    finding = _guarded(lambda: record_ops(rep, phase, kind, run.wrap, scope),
                       "recording the step's ops")
    caught = None
    if finding is None:
        notes.append("op-level provenance found no root op inside the recorded phase; the "
                     "culprit is the module call that produced the value")
    else:
        if finding.module_call is not None:   # the table row of the op's own module call
            call = table.get(CallId(finding.module, finding.module_call)) or call
        run.progress("input-catch", "pass 3/3: catching the culprit's inputs")
        caught = _guarded(lambda: catch_inputs(rep, finding.site, run.wrap),
                          "catching the op's inputs")
        if caught is None:
            notes.append("the culprit op could not be caught again in a narrow replay (the "
                         "step is not deterministic); no repro was written")
    trace = backtrace(table, call, phase, kind) if call is not None and phase != "optimizer" \
        else []
    done = finish(rep, phase, kind, finding=finding, caught=caught, call=call,
                  parameter=parameter, micro_batch=first.micro_batch,
                  check_on=ref[0] if ref is not None else None, wrap=run.wrap,
                  repro_dir=tmp / "repro", target=target, start_repro=_repro_starter(run),
                  progress=run.progress)
    culprit, op_check = done.culprit, done.op_check
    repro_result = module_repro = None
    if done.repro is not None:
        repro_result = done.pending() if done.pending else None
        if repro_result and not repro_result.reproduced and opts.inject:
            notes.append(f"the repro did not reproduce on {target}: it runs the op without "
                         f"--inject {opts.inject}, which emulated the fault here; run "
                         "repro/repro.py on the device that has the faulty kernel")
        elif (repro_result and not repro_result.reproduced
                and phase in ("forward", "backward")
                and culprit.module and culprit.module_call is not None):
            run.progress("module-repro", "the op alone did not reproduce: catching its module "
                                         "call")
            module_repro = _module_fallback(run, culprit, kind, tmp)
            worked = (module_repro is not None and module_repro.result is not None
                      and module_repro.result.reproduced)
            notes.append("the culprit op alone did not reproduce (it depends on state "
                         "outside its inputs); module_repro replays its module call "
                         "with the module's state: " + ("reproduced" if worked else
                                                        "did not reproduce either"))
    classification, why = classify_culprit(_evidence(run, side, op_check))
    notes += why
    return Report(
        "culprit", classification, phase, kind, culprit, run.facts, backtrace=trace,
        timeline=timeline(table, phase), notes=notes,
        repro="repro/repro.py" if done.repro else None, repro_result=repro_result,
        inf_origin=finding.inf_origin if finding else None,
        context=finding.context if finding else [], op_check=op_check,
        module_repro=module_repro,
        op_recording=(OpRecording(finding.scope, finding.phase, finding.recorded,
                                  finding.total_ops) if finding else None),
        uncomparable=[op_check] if op_check and op_check.status == "uncomparable" else [])


def _module_fallback(run: _Run, culprit: Culprit, kind: str, tmp: Path) -> ModuleRepro | None:
    """Write (and run once) a repro of the culprit's whole module call, with its state."""
    mc = _guarded(lambda: catch_module_call(run.rep, CallId(culprit.module, culprit.module_call),
                                            run.wrap, backward=culprit.phase == "backward"),
                  "catching the culprit's module call")
    if mc is None:
        return None
    script = write_module_repro(tmp / "repro", mc, culprit=culprit, kind=kind,
                                target=run.facts.target, entry=run.rep.entry)
    return ModuleRepro("repro/module_repro.py",
                       run_repro(script, run.facts.target) if run.opts.run_repro else None)
