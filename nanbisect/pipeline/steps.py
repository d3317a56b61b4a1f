"""``run --steps K``: the recorded window replayed on target and reference, the first step
that parts found, and that step bisected alone (else the failing step); and, for a failing step
whose pre-state already held non-finite buffers, the window replayed on the target to the step
that made them, which is bisected instead (`trace_back`).
"""
from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import torch

from nanbisect import history as hist
from nanbisect.bundle import lookback
from nanbisect.bundle.format import Bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.errors import BadInput
from nanbisect.pipeline.common import (Progress, RunOptions, captured_type, guarded,
                                       reference_kernels_note, target_wrap)
from nanbisect.pipeline.analysis import analyse
from nanbisect.records import before_the_step, fidelity_tier
from nanbisect.reference import kernels as registry
from nanbisect.reference.window import made_in, replay_window
from nanbisect.replay.fidelity import match_threads
from nanbisect.replay.replayer import Replayer
from nanbisect.report.model import Report


def run_steps(bundle: Bundle, window: "lookback.Window", history: "hist.History | None",
              opts: RunOptions, progress: Progress, target: str, t_dev: torch.device,
              t_dtype: torch.dtype | None, ref: tuple[torch.device, torch.dtype | None] | None,
              tmp: Path) -> tuple[Report, Replayer | None]:
    """--steps K: the window on both sides, then the first step that parts bisected alone.
    ``opts.reference`` is the run's (filled in by `run_bundle`), ``ref`` it resolved (None:
    no reference, which a window cannot do without)."""
    k = opts.steps
    reference = opts.reference
    if ref is None:
        raise BadInput(f"--steps {k} compares the target's steps with a reference's; pass "
                       "--reference cpu (or cpu:float64)")
    wrap, used = target_wrap(opts, bundle.manifest, t_dev)
    note = match_threads(bundle, t_dev)
    losses = {e["step"]: e.get("loss") for e in (history.entries if history else [])}
    progress("steps", f"replaying the last {k} recorded steps on {target} and {reference}")
    registry.load_plugins()
    res = guarded(lambda: replay_window(bundle, window, k, (t_dev, t_dtype), ref, wrap,
                                        opts.entry, losses,
                                        lambda text: progress("steps", text),
                                        run_top_level=opts.run_top_level),
                  "replaying the recorded steps")
    failing = window.steps[-1]["step"]
    notes = [n for n in [note, reference_kernels_note(used, target)] if n] + res.notes
    rows = {r.step: r for r in res.rows}
    before = rows.get(failing - 1)
    steps = res.record(before.max_rel_diff if before else None)
    report, rep, analysed = _bisect_step(bundle, res, failing, notes, opts, progress, target,
                                         t_dev, t_dtype, ref, tmp)
    if res.first_divergent_step is None:
        notes.append(f"the {len(res.rows)} replayed step(s) stay within tolerance of the "
                     "reference: nothing parts before the failing step")
    elif analysed != failing:
        drift = steps.failing_prestate_max_rel_diff
        notes.append(f"target and reference part first at step {analysed}, "
                     f"{failing - analysed} step(s) before the failing step {failing}; the culprit "
                     f"is that step's first diverging op" + (
                         f"; by the failing step the parameters had drifted by a relative "
                         f"{drift:.3g}" if isinstance(drift, float) else ""))
    culprit = report.culprit
    if culprit is not None:
        culprit = replace(culprit, step=analysed)
    facts = replace(report.facts, observed=Manifest.of(bundle).observed)
    classification = _reached(bundle, res.reached, report, t_dev, t_dtype, notes)
    return replace(report, culprit=culprit, facts=facts, steps=steps,
                   classification=classification, notes=[*notes, *report.notes]), rep


def _bisect_step(bundle: Bundle, res, failing: int, notes: list[str], opts: RunOptions,
                 progress: Progress, target: str, t_dev: torch.device,
                 t_dtype: torch.dtype | None, ref: tuple[torch.device, torch.dtype | None],
                 tmp: Path) -> tuple[Report, Replayer | None, int]:
    """The first step that parts from the reference bisected alone; the failing step when none
    does, or when that step alone stays within tolerance (rounding that compounds)."""
    if res.step_view is not None:
        s = res.first_divergent_step
        progress("steps", f"bisecting step {s}, the first that parts from the reference")
        report, rep = analyse(res.step_view, opts, progress, target, t_dev, t_dtype, tmp, ref)
        if report.verdict != "clean":
            return report, rep, s
        notes.append(f"step {s} is the first whose state parts from the reference's over "
                     "the window, but replayed alone from one state on both sides it stays "
                     "within tolerance: the difference built up over the steps before it "
                     "(rounding that compounds); the failing step is bisected instead")
        for child in tmp.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    report, rep = analyse(bundle, opts, progress, target, t_dev, t_dtype, tmp, ref)
    return report, rep, failing


def _reached(bundle: Bundle, reached: dict | None, report: Report, t_dev: torch.device,
             t_dtype: torch.dtype | None, notes: list[str]):
    """The report's classification once the window's fidelity is known: a window that does not
    reach the recorded pre-state on the capture device is a replay mismatch."""
    fid = report.facts.fidelity
    tier = None if reached is None else fidelity_tier(
        reached["bit_exact"] and reached["first_step_off_history"] is None,
        reached.get("max_rel_diff"), fid.tolerance if fid else None,
        fid is not None and fid.elsewhere)
    if tier == "mismatch" and t_dtype is None and captured_type(bundle.manifest) == t_dev.type:
        # on the capture device the window must reach the recorded state (bit for bit on the
        # capture machine, within tolerance elsewhere): it did not, so the replayed steps are
        # not the run's and no verdict about the device follows from them
        return "replay-mismatch"
    if tier == "within-tolerance":
        notes.append(f"the window reaches the recorded pre-state of the failing step within "
                     f"tolerance (max relative difference {reached.get('max_rel_diff')}), not "
                     "bit for bit, on another machine than the capture's (see the replay's "
                     "note): not a mismatch")
    return report.classification


def trace_back(bundle: Bundle, report: Report, rep: Replayer | None, opts: RunOptions,
               progress: Progress, target: str, t_dev: torch.device,
               t_dtype: torch.dtype | None, ref: tuple[torch.device, torch.dtype | None] | None,
               tmp: Path) -> tuple[Report, Replayer | None]:
    """``report`` (the failing step's) when its pre-state held non-finite values other than
    buffers, or none; when only the model's buffers held them, the step of the bundle's lookback
    that made them bisected alone, its culprit the report's (``culprit.step``), or ``report``
    with a note saying how far back the window looked."""
    if report.verdict != "input-nonfinite" or before_the_step(report.input_nonfinite)[1] is None:
        return report, rep
    where = f"bundle '{bundle.path}'"
    window = lookback.parse(bundle, where)
    if window is None or len(window.steps) < 2:
        return replace(report, notes=[*report.notes, (
            "the bundle keeps no step before the failing one (Guard(..., lookback=K) keeps K): "
            "the step that made them cannot be traced back")]), rep
    failing = window.steps[-1]["step"]
    wrap, _ = target_wrap(opts, bundle.manifest, t_dev)
    progress("steps", f"tracing the buffers back over the {len(window.steps) - 1} recorded "
                      f"step(s) before step {failing}")
    found = guarded(lambda: made_in(bundle, window, (t_dev, t_dtype), wrap, opts.entry,
                                    lambda text: progress("steps", text),
                                    run_top_level=opts.run_top_level),
                    "replaying the recorded steps")
    if found is None:
        return replace(report, notes=[*report.notes, (
            f"the {len(window.steps) - 1} recorded step(s) before the failing one, replayed from "
            f"the snapshot of step {window.steps[0]['step']}, made none of them: they were made "
            "before the bundle's lookback")]), rep
    step, view = found
    for child in tmp.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    progress("steps", f"bisecting step {step}, which made them")
    earlier, rep = analyse(view, opts, progress, target, t_dev, t_dtype, tmp, ref)
    names = ", ".join(b.name for b in report.input_nonfinite[:5])
    culprit = replace(earlier.culprit, step=step) if earlier.culprit is not None else None
    facts = replace(earlier.facts, observed=Manifest.of(bundle).observed)
    return replace(earlier, culprit=culprit, facts=facts, notes=[
        f"step {failing}'s pre-state held non-finite buffers ({names}); traced back through the "
        f"bundle's lookback to step {step}, whose replay made them: the culprit is that step's",
        *earlier.notes]), rep
