"""`run_bundle`: bundle -> replay(target) [+ replay(reference)] -> phase -> module -> report.

Guarantees: the first replay runs without hooks and decides the phase; only when it fails does a
second replay run with module hooks over the failing phase. A failure recorded in the manifest that
the replay does not show is reported as ``not-reproduced``, never given an invented culprit.
"""
from __future__ import annotations

import math
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

from .bisect import (Culprit, backtrace, backward_producer, culprit_from_call,
                     forward_producer, optimizer_culprit)
from .bundle import read_bundle
from .errors import BadInput
from .probe import ModuleProbe
from .replay import Replayer, StepOutcome, parse_device
from .report import Report
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


def run_bundle(path: str | Path, opts: RunOptions = RunOptions()) -> Report:
    """Replay a bundle and bisect its failure down to a module call.

    >>> run_bundle("fixtures/bundles/forward_nan_behind_mask").culprit.module
    'blocks.1.mlp.act'
    """
    bundle = read_bundle(path)
    m = bundle.manifest
    target = opts.target or _default_target(m)
    t_dev, t_dtype = parse_device(target)
    reference = opts.reference or ("cpu" if t_dev.type != "cpu" else "none")
    ref = None if reference == "none" else parse_device(reference)
    wrap = load_inject(opts.inject) if opts.inject else nullcontext

    rep = _guarded(lambda: Replayer(bundle, t_dev, t_dtype, entry=opts.entry), "building the task")
    first: StepOutcome = _guarded(lambda: rep.run(wrap=wrap), "replaying the step on the target")
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
            return Report("not-reproduced", "transient", None, None, None, notes=[
                "the manifest records a non-finite step, but the replay from the same state, "
                "RNG and batch was finite: suspect a transient (hardware, race, unsynchronised "
                "communication) or state the bundle does not hold"], **common)
        return Report("clean", None, None, None, None, **common)
    if first.phase == "input":
        return Report("input-nonfinite", "data", "input", first.kind, None,
                      input_nonfinite=first.bad, **common)

    classification = ("unknown" if ref_outcome is None else
                      "numerics" if ref_outcome.phase is not None else "device")
    kind = first.kind or "nan"
    model = rep.task.model
    if first.phase == "optimizer":
        culprit = optimizer_culprit(model, [b.name for b in first.bad])
        return Report("culprit", classification, "optimizer", kind, culprit, **common)

    probe = ModuleProbe(model)
    second = _guarded(lambda: rep.run(forward=lambda: probe, backward=lambda: probe, wrap=wrap)
                      if first.phase == "backward" else rep.run(forward=lambda: probe, wrap=wrap),
                      "replaying the step with module hooks")
    notes = []
    if second.phase != first.phase:
        notes.append(f"the hooked replay failed in {second.phase}, the plain one in "
                     f"{first.phase}: the step is not deterministic")
    table = probe.read()
    param = None
    if first.phase == "forward":
        call = forward_producer(table, kind)
    else:
        call, param = backward_producer(table, kind)
    if call is None:
        culprit = Culprit(first.phase, "", None, [], [], None)
        notes.append("no module call produced the value: it was born outside every submodule "
                     "(in loss_fn or in code around the model)")
        trace = []
    else:
        culprit = culprit_from_call(model, call, first.phase, param)
        trace = backtrace(table, call, first.phase, kind)
    return Report("culprit", classification, first.phase, kind, culprit, backtrace=trace,
                  notes=notes, **common)
