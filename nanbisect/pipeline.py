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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

from .bisect import (Culprit, backtrace, backward_producer, culprit_from_call, forward_producer,
                     optimizer_culprit)
from .bundle import read_bundle
from .errors import BadInput
from .narrow import catch_inputs, record_ops, repro_imports
from .probe import ModuleProbe
from .replay import Replayer, StepOutcome, parse_device
from .report import Report, staged, write_report
from .repro import run_repro, write_repro
from .task import import_target, split_entry


def _num(x: float | None):
    """Losses as JSON: floats when finite, "nan"/"inf"/"-inf" otherwise."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))


def load_inject(spec: str) -> Callable[[], ContextManager]:
    """``FILE.py:FUNC`` -> FUNC, a factory of the context manager wrapped around target runs."""
    target, func = split_entry(spec)
    fn = getattr(import_target(target), func, None)
    if not callable(fn):
        raise BadInput(f"--inject '{spec}': '{func}' is not a function in {target}; name a "
                       "function that returns a context manager")
    return fn


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


def run_bundle(path: str | Path, opts: RunOptions = RunOptions(), out: Path | None = None
               ) -> Report:
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
    reference = opts.reference or ("cpu" if t_dev.type != "cpu" else "none")
    ref = None if reference == "none" else parse_device(reference)
    wrap = load_inject(opts.inject) if opts.inject else nullcontext

    rep = _guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry), "building the task")
    probe = ModuleProbe(rep.task.model)
    first = _guarded(lambda: rep.run(
        phase=lambda n: probe if n in ("forward", "backward") else nullcontext(), wrap=wrap),
        "replaying the step on the target")
    observed = m.get("observed")
    original = (observed or {}).get("loss")  # a float, or "nan"/"inf" when it was not finite
    replay = {"original_loss": original, "target_loss": _num(first.loss), "reference_loss": None}
    if isinstance(original, float) and first.loss is not None:
        replay["bit_exact"] = first.loss == original

    ref_outcome = None
    if ref is not None and first.phase not in (None, "input"):
        ref_rep = _guarded(lambda: Replayer(bundle, ref[0], ref[1], entry=rep.entry),
                           "building the task on the reference")
        ref_outcome = _guarded(ref_rep.run, "replaying the step on the reference")
        replay["reference_loss"] = _num(ref_outcome.loss)

    common = dict(replay=replay, bundle=str(bundle.path), entry=m["entry"], target=target,
                  reference=reference, observed=observed)
    if first.phase is None:
        if observed:
            report = Report("not-reproduced", "transient", None, None, None, notes=[
                "the manifest records a non-finite step, but the replay from the same state, "
                "RNG and batch was finite: suspect a transient (hardware, race, unsynchronised "
                "communication) or state the bundle does not hold"], **common)
        else:
            report = Report("clean", None, None, None, None, **common)
    elif first.phase == "input":
        report = Report("input-nonfinite", "data", "input", first.kind, None,
                        input_nonfinite=first.bad, **common)
    else:
        classification = ("unknown" if ref_outcome is None else
                          "numerics" if ref_outcome.phase is not None else "device")
        return _culprit_report(rep, probe, first, classification, wrap, out, opts, common)
    with staged(out) as tmp:
        write_report(report, tmp)
    return report


def _culprit_report(rep: Replayer, probe: ModuleProbe, first: StepOutcome, classification: str,
                    wrap, out: Path, opts: RunOptions, common: dict) -> Report:
    model, phase, kind = rep.task.model, first.phase, first.kind or "nan"
    notes: list[str] = []
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

    finding = _guarded(lambda: record_ops(rep, phase, kind, wrap), "recording the step's ops")
    caught = None
    if finding is None:
        notes.append("op-level provenance found no root op inside the recorded phase; the "
                     "culprit is the module call that produced the value")
    else:
        caught = _guarded(lambda: catch_inputs(rep, finding, wrap), "catching the op's inputs")
        culprit = Culprit(phase=finding.phase, module=finding.module,
                          module_call=finding.module_call, input_dtypes=finding.input_dtypes,
                          input_shapes=finding.input_shapes,
                          source=caught.source if caught else culprit.source, op=finding.op,
                          op_index=finding.op_index, parameter=finding.parameter)
        if (call is None or (call.call.module, call.call.call) != (finding.module,
                                                                   finding.module_call)):
            match = [c for c in table.calls
                     if (c.call.module, c.call.call) == (finding.module, finding.module_call)]
            call = match[0] if match else call
    trace = backtrace(table, call, phase, kind) if call is not None and phase != "optimizer" \
        else []
    with staged(out) as tmp:
        repro, repro_result = None, None
        if caught is not None:
            script = write_repro(tmp / "repro", caught, culprit=culprit.__dict__, kind=kind,
                                 target=common["target"],
                                 imports=repro_imports(caught.op, rep.entry))
            repro = "repro/repro.py"
            if opts.run_repro:
                repro_result = run_repro(script, common["target"])
        elif finding is not None:
            notes.append("the culprit op could not be caught again in a narrow replay (the step "
                         "is not deterministic); no repro was written")
        report = Report("culprit", classification, phase, kind, culprit, backtrace=trace,
                        notes=notes, repro=repro, repro_result=repro_result,
                        inf_origin=finding.inf_origin if finding else None,
                        context=finding.context if finding else [], **common)
        write_report(report, tmp)
    return report
