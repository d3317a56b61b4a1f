"""Remedies: once the culprit is known, replay the step with a few targeted changes and say what
each did (`try_remedies`). Every entry is a replay's outcome (``finite``, ``still-failing``,
``error``) or says why it was not replayed (``skipped``); never an untried suggestion.

What is tried, in this order (an optimizer culprit's optimizer changes first):

- ``kernel`` (a culprit wrong on the target given the same inputs, with a reference): the step
  with that one op run on the reference's kernel (`kernel.OnReference`: its inputs copied there,
  its results back); finite says the target's kernel is what fails, and that the step passes
  without it;

- ``optimizer`` (optimizer culprits): the step with the optimizer's eps raised (to 1e-8, or
  100x), then with the gradients clipped to norm 1 (a tenth of the Task's ``clip_grad_norm``);
- ``precision``: along the chain the report shows, one dtype wider (float16/bfloat16 ->
  float32, float32 -> float64): the op where the culprit's inf was born (``inf_origin``) first,
  then the culprit op (`upcast.UpcastOp`; skipped when its inputs carry that inf, which the
  origin was tried for), then its module call (`upcast.upcast_module`, the module's own
  narrowing casts kept wide; the smallest module holding both the culprit and the op where its
  inf was born). "Finite" there tells a range problem of the
  dtype from a domain error (a sqrt of a negative is NaN at any precision);
- ``samples``: the step without the batch rows the bad value depends on, narrowed to a minimal
  set (`narrow.narrow`): the rows traced through the ops first (`RowTrace`,
  ``culprit.samples``), then bisection within them (the trace can name rows whose bad values
  the step masks later); without a trace, or when the step still fails without the traced
  rows, bisection of the whole batch (remove half of the candidate rows; finite: keep that
  half; else try the other half; neither half of the whole batch: not the batch's rows); each
  row identified (`batch.identify`). When the budget ends the narrowing the sentence says so
  ("narrowed to 2 rows, budget ended; row 2 alone not tried");
- ``state`` (bundles with a lookback): the same pre-step state with the batch of the step
  before: finite means the batch did it, still failing that the state was already poised.

A budget bounds the extra replays of the step (default 4, `DEFAULT_BUDGET`; a bisection counts
each of its replays); what it leaves out is listed as skipped. Every replay starts from the
pre-step state like any other; the changes are undone before this returns.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.bundle.lookback import Window
from nanbisect.bundle.manifest import Manifest
from nanbisect.bundle.state import decode
from nanbisect.records import Culprit, OpFinding, Remedy, RowTrace, module_label
from nanbisect.remedies.batch import drop_rows, identify, row_count
from nanbisect.remedies.kernel import OnReference, movable
from nanbisect.remedies.narrow import narrow, untried_text
from nanbisect.remedies.trials import DEFAULT_BUDGET, Progress, Trials, budget, rows_text
from nanbisect.remedies.upcast import UpcastOp, upcast_module, wider
from nanbisect.replay.replayer import Replayer
from nanbisect.report.prose import module_cell
from nanbisect.util import torch_internals as ti

__all__ = ["DEFAULT_BUDGET", "budget", "try_remedies", "not_tried"]

def _at(c) -> str:
    """Where the culprit op (a `Culprit`), or an op the report names (an `OpRef`: the
    ``inf_origin``), runs, in words."""
    if c.phase == "optimizer":
        parameter = getattr(c, "parameter", None)     # an OpRef names none
        return "in the optimizer step" + (f" (parameter {parameter})" if parameter else "")
    call = f" (call {c.module_call})" if c.module_call is not None else ""
    back = "backward of " if c.phase == "backward" else ""
    return f"in {back}{module_cell(c.module, c.module_call, c.phase)}{call}"


def _common(a: str, b: str) -> str:
    """The innermost module holding both dotted names ("" the model)."""
    pa, pb, out = a.split(".") if a else [], b.split(".") if b else [], []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _upcast_op(trials: Trials, change: str, site, wide, scope: str) -> Remedy:
    """Replay the step with the op at ``site`` computed in ``wide`` (`upcast.UpcastOp`)."""
    outcome, loss, detail = trials.replay(change, modes=lambda: [UpcastOp(site, wide)])
    return Remedy("precision", change, outcome, loss,
                  {"dtype": str(wide).removeprefix("torch."), "scope": scope, **detail})


def _precision(trials: Trials, c: Culprit, f: OpFinding | None) -> list[Remedy]:
    """Precision along the chain the report shows: the op where the inf was born
    (``inf_origin``) first, then the culprit op, then the module call holding both. A candidate
    is skipped only for a reason an earlier one was tried for (the culprit's inputs carry the
    inf the origin, tried first, made)."""
    out: list[Remedy] = []
    dtypes = wider(f.input_dtypes if f is not None else c.input_dtypes)
    if dtypes is None:
        if f is not None:
            out.append(Remedy("precision", f"when {c.op} {_at(c)} runs wider", "skipped", detail={
                "reason": "its inputs are already float64 (or not floating)"}))
        return out
    narrow, wide = dtypes
    wide_name = str(wide).removeprefix("torch.")
    origin = f.inf_origin if f is not None else None
    if origin is not None and f.origin_site is not None:
        change = f"when {origin.op} {_at(origin)}, where the inf was born, runs in {wide_name}"
        if trials.left <= 0:
            return [trials.spent("precision", change)]
        out.append(_upcast_op(trials, change, f.origin_site, wide, "inf_origin"))
        if out[-1].outcome == "finite":
            return out
    if f is not None:
        change = f"when {c.op} {_at(c)} runs in {wide_name}"
        if origin is not None:
            tried = " (tried above)" if f.origin_site is not None else ""
            out.append(Remedy("precision", change, "skipped", detail={
                "dtype": wide_name, "scope": "op",
                "reason": f"its inputs already carry inf (born in {origin.op}{tried}): "
                          "computing it alone wider cannot help"}))
        elif trials.left <= 0:
            return [trials.spent("precision", change)]
        else:
            out.append(_upcast_op(trials, change, f.site, wide, "op"))
            if out[-1].outcome == "finite":
                return out
    if c.phase not in ("forward", "backward") or c.module_call is None:
        return out
    name, call = c.module, c.module_call
    if origin is not None and (origin.module, origin.module_call) != (c.module, c.module_call):
        name, call = _common(origin.module or "", c.module), None
    what = f"module {module_label(name)}" + (f" (call {call})" if call is not None
                                              else " (every call)")
    change = f"when {what} runs in {wide_name}"
    if trials.left <= 0:
        return out + [trials.spent("precision", change)]

    @contextmanager
    def widened_module():
        with upcast_module(trials.rep.task.model, name, call, wide):
            yield

    outcome, loss, detail = trials.replay(change, around=widened_module)
    return out + [Remedy("precision", change, outcome, loss,
                         {"dtype": wide_name, "scope": "module", "module": name,
                          "module_call": call, **detail})]


def _batch(rep: Replayer) -> Any:
    return decode(Manifest.of(rep.bundle).batch, rep.tensors, devices.HOST)


def _samples(trials: Trials, trace: RowTrace | None) -> Remedy:
    rep = trials.rep
    if rep.task.accumulate > 1:
        return Remedy("samples", "without the rows the bad value depends on", "skipped", detail={
            "reason": f"the step's batch is {rep.task.accumulate} micro-batches; rows are "
                      "removed from one-batch steps only"})
    batch = _batch(rep)
    rows = row_count(batch)
    if rows is None or rows < 2:
        return Remedy("samples", "without the rows the bad value depends on", "skipped", detail={
            "reason": "the batch has no tensor with two or more rows"})
    if trace is not None and trace.samples is not None:
        drop = trace.reached or trace.samples
        if len(drop) >= rows:
            return Remedy("samples", f"without {rows_text(drop)}", "skipped", detail={
                "rows": drop, "found_by": "trace", "identify": identify(batch, drop, rows),
                "reason": "every row of the batch holds the bad value: none would be left"})
        return _rows(trials, batch, rows, trace, None)
    why = trace.why if trace is not None else "no op was isolated to trace them from"
    if trace is not None and trace.why and "no batch row" in trace.why:
        return Remedy("samples", "without the rows the bad value depends on", "skipped",
                      detail={"reason": trace.why})
    return _rows(trials, batch, rows, None, why)


def _rows(trials: Trials, batch: Any, rows: int, trace: RowTrace | None,
          why: str | None) -> Remedy:
    """The step without the rows to blame, narrowed to a minimal set (`narrow.narrow`): the
    traced rows first (those that carried their bad value to where the rows meet, when the
    trace followed them that far: a minimal set once the step is finite without them), else,
    or when the step still fails without them, the whole batch bisected. When the budget ends
    the narrowing, the remedy's sentence says so."""
    losses: dict[tuple[int, ...], float | None] = {}
    tried: list[dict] = []

    def attempt(drop: list[int]) -> str:
        if trials.left <= 0:
            return "budget"
        outcome, loss, detail = trials.replay(f"without {rows_text(drop)}",
                                              edit=lambda b: drop_rows(b, drop, rows))
        tried.append({"without": drop, "outcome": outcome, **detail})
        losses[tuple(drop)] = loss
        return outcome

    traced = (trace.reached or trace.samples) if trace is not None else None
    start, known = list(range(rows)), False
    if traced is not None:
        change = f"without {rows_text(traced)}"
        first = attempt(traced)
        if first == "budget":
            return trials.spent("samples", change)
        if first == "error":
            return Remedy("samples", change, "error", None, {
                "rows": traced, "found_by": "trace", "identify": identify(batch, traced, rows),
                "error": tried[-1].get("error")})
        if first == "finite" and trace.reached:
            # each row's own bad value reaches where the rows meet: none of them can stay
            extra = [r for r in trace.samples if r not in set(traced)]
            why = ([f"each of them alone carries its bad value to {trace.reached_at}"]
                   if len(traced) > 1 else [])
            if extra:
                why.append(f"row {extra[0]}" if len(extra) == 1 else
                           rows_text(extra).removeprefix("batch "))
                why[-1] += (
                    f" {'is' if len(extra) == 1 else 'are'} bad at the culprit too, but "
                    f"masked before {trace.reached_at}")
            return Remedy("samples", change, "finite", losses.get(tuple(traced)), {
                "rows": traced, "identify": identify(batch, traced, rows), "found_by": "trace",
                "traced": trace.samples, "reached_at": trace.reached_at, "complete": True,
                **({"minimal": "; ".join(why)} if why else {})})
        if first == "finite":
            start, known = traced, True
    found = narrow(attempt, start, known, failed=[traced] if traced is not None and not known
                   else [])
    detail: dict = {"found_by": _found_by(known and traced is not None, traced, found.rows,
                                          len(tried) > (traced is not None)),
                    **({"traced": traced} if traced is not None else {}),
                    **({"why_not_traced": why} if why is not None else {}),
                    **({"tried": tried} if traced is None or len(tried) > 1 else {}),
                    "complete": found.complete}
    if found.alone or found.together:
        detail["found_by"] = "group testing"
    if found.alone:
        detail["alone"] = found.alone
    if found.together:
        detail["together"] = found.together
    if found.rows is not None:
        if found.stop == "budget":
            detail["note"] = (f"narrowed to {len(found.rows)} rows, budget ended; "
                              + untried_text(found.next))
        elif found.stop == "error":
            detail["note"] = (f"narrowed to {len(found.rows)} rows; the step without "
                              f"{rows_text(found.next)} could not be replayed: "
                              f"{tried[-1].get('error')}")
        elif len(found.alone) > 1 and not found.together:
            detail["minimal"] = ("each of them alone keeps the step failing (the batch "
                                 "without every other row)")
        elif found.together:
            detail["minimal"] = "; ".join(
                f"{rows_text(g).removeprefix('batch ')} act together: the step fails with "
                "them and is finite with either half of them alone" for g in found.together)
        return Remedy("samples", f"without {rows_text(found.rows)}", "finite",
                      losses.get(tuple(found.rows)),
                      {"rows": found.rows, "identify": identify(batch, found.rows, rows),
                       **detail})
    return _unnarrowed(trials, traced, tried, found, detail)


def _unnarrowed(trials: Trials, traced: list[int] | None, tried: list[dict], found,
                detail: dict) -> Remedy:
    """The samples remedy when no removal of rows made the step finite (``found``: the
    narrowing's end), with the note that says why."""
    change = (f"without {rows_text(traced)}" if traced is not None and len(tried) == 1
              else "without batch rows found by bisecting the batch")
    if not tried:
        return trials.spent("samples", change)
    if found.stop == "error":
        return Remedy("samples", change, "error", None, {"rows": None, **detail,
                                                           "error": tried[-1].get("error")})
    notes = ["the step still fails without the traced rows"] if traced is not None else []
    if found.alone:
        notes.append(f"{rows_text(found.alone)} each keep the step failing alone")
    if found.stop == "unverified":
        notes.append("the step still fails without all the rows found: the failure does not "
                     "come from these rows alone")
    elif traced is not None and len(tried) == 1:
        notes.append("the budget ended before the batch was bisected")
    else:
        notes.append("the budget ended the search before any removal made it finite")
    detail["note"] = "; ".join(notes)
    return Remedy("samples", change, "still-failing", None, {"rows": None, **detail})


def _found_by(traced_finite: bool, traced: list[int] | None, rows: list[int] | None,
              bisected: bool) -> str:
    """How the rows were found: "trace", "trace, narrowed by bisection" (a part of the traced
    rows is enough), "bisection" (the whole batch)."""
    if traced_finite:
        return "trace" if rows == traced else "trace, narrowed by bisection"
    return "bisection" if traced is None or bisected else "trace"


def _state(trials: Trials, window: Window) -> Remedy | None:
    if len(window.steps) < 2:
        return None
    prev = window.steps[-2]
    change = f"with the batch of step {prev['step']} in place of its own (the same state)"
    if trials.left <= 0:
        return trials.spent("state", change)
    rep = trials.rep
    tensors = {k: v for k, v in window.step_tensors(len(window.steps) - 2).items()}

    def other(batch: Any) -> Any:
        b = decode(prev["batch"], tensors, rep.device)
        if rep.dtype is not None:
            b = ti.tree_map(
                lambda t: t.to(rep.dtype) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t, b)
        return b

    outcome, loss, detail = trials.replay(change, edit=other)
    meaning = {"finite": "the batch did it",
               "still-failing": "the state was already poised"}.get(outcome)
    return Remedy("state", change, outcome, loss, {"step": prev["step"], **detail,
                                                   **({"meaning": meaning} if meaning else {})})


def _optimizer(trials: Trials) -> list[Remedy]:
    rep, out = trials.rep, []
    groups = rep.task.optimizer.param_groups if rep.task.optimizer is not None else []
    eps = [g["eps"] for g in groups if isinstance(g.get("eps"), (int, float))]
    if eps:
        new = max(1e-8, 100 * max(eps))
        change = f"with the optimizer's eps raised from {max(eps):g} to {new:g}"
        if trials.left <= 0:
            out.append(trials.spent("optimizer", change))
        else:
            def raise_eps():
                for g in rep.task.optimizer.param_groups:
                    if isinstance(g.get("eps"), (int, float)):
                        g["eps"] = max(g["eps"], new)
            outcome, loss, detail = trials.replay(change, on_optimizer=raise_eps)
            out.append(Remedy("optimizer", change, outcome, loss, {"eps": new, **detail}))
    norm = 1.0 if rep.task.clip_grad_norm is None else rep.task.clip_grad_norm / 10
    change = f"with the gradients clipped to norm {norm:g} before the update"
    if trials.left <= 0:
        return out + [trials.spent("optimizer", change)]
    outcome, loss, detail = trials.replay(change, clip=norm)
    return out + [Remedy("optimizer", change, outcome, loss, {"clip_grad_norm": norm, **detail})]


def _kernel(trials: Trials, c: Culprit, f: OpFinding, on: tuple) -> Remedy:
    """The step with the culprit op on the reference's kernel (`kernel.OnReference`)."""
    device, dtype = on
    where = str(device) + (f" in {str(dtype).removeprefix('torch.')}" if dtype else "")
    change = f"when {c.op} {_at(c)} runs on the reference's kernel ({where})"
    why = movable(c.op)
    if why is not None:
        return Remedy("kernel", change, "skipped", detail={"device": where, "reason": why})
    if trials.left <= 0:
        return trials.spent("kernel", change)
    outcome, loss, detail = trials.replay(change, modes=lambda: [OnReference(f.site, device,
                                                                             dtype)])
    return Remedy("kernel", change, outcome, loss, {"device": where, **detail})


def try_remedies(rep: Replayer, culprit: Culprit, finding: OpFinding | None, *,
                 budget: int = DEFAULT_BUDGET, trace: RowTrace | None = None,
                 window: Window | None = None, wrap: Callable[[], ContextManager] = nullcontext,
                 judge: str = "optimizer", progress: Progress = lambda key, text: None,
                 kernel_on: tuple | None = None) -> list[Remedy]:
    """Replay the step with each remedy that applies to ``culprit`` (at most ``budget`` extra
    replays, each under ``wrap``, each run to the end of phase ``judge``: the whole step by
    default); what came of each, in the order tried. ``kernel_on``: the reference (device,
    dtype) when the culprit op is wrong on the target given the same inputs (its op check's
    ``mismatch``): the ``kernel`` remedy runs it there.

    >>> from nanbisect.bundle.format import read_bundle
    >>> from nanbisect.locate.ops import record_ops
    >>> from nanbisect.locate.producers import make_culprit
    >>> rep = Replayer(read_bundle("fixtures/bundles/optimizer_adam_eps0"), torch.device("cpu"))
    >>> f = record_ops(rep, "optimizer", "nan")
    >>> c = make_culprit(rep.task.model, "optimizer", finding=f)
    >>> [(r.kind, r.outcome) for r in try_remedies(rep, c, f, budget=2)][:2]
    [('optimizer', 'finite'), ('optimizer', 'still-failing')]
    """
    trials = Trials(rep, wrap, budget, judge, progress)
    out: list[Remedy] = []
    if culprit.phase == "optimizer":
        out += _optimizer(trials)
    if kernel_on is not None and finding is not None:
        out.append(_kernel(trials, culprit, finding, kernel_on))
    out += _precision(trials, culprit, finding)
    out.append(_samples(trials, trace))
    if window is not None:
        state = _state(trials, window)
        out += [state] if state is not None else []
    return out


def not_tried(culprit: Culprit, reason: str, window: bool = False) -> list[Remedy]:
    """The remedies that would apply to ``culprit``, each skipped for ``reason`` (a rank
    replayed in lockstep cannot replay the step again alone)."""
    kinds = (["optimizer"] if culprit.phase == "optimizer" else []) + ["precision", "samples"] \
        + (["state"] if window else [])
    change = {"optimizer": "with the optimizer's eps raised or its gradients clipped",
              "precision": "with the culprit op or its module call computed wider",
              "samples": "without the rows the bad value depends on",
              "state": "with the batch of the step before (the same state)"}
    return [Remedy(k, change[k], "skipped", detail={"reason": reason}) for k in kinds]
