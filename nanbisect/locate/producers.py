"""Decide, from a probed replay, which module call *produced* the failure.

Pure functions over `ProbeTable` records: no hooks, no tensors. A producer is a call whose inputs
(forward) or incoming gradients (backward) are free of the failure's kind of value while its
outputs (forward) or outgoing gradients (backward) carry it. A call whose inputs are already bad is
a propagator. Among producers the innermost one wins (a parent whose child produced the value is
not blamed), then the earliest. In forward, a producer must also pass its bad values up: every
enclosing call's output must be bad too, so a value masked away inside a parent (``-inf`` filled
into attention scores and absorbed by softmax) is never blamed. For a NaN failure only NaN counts
as bad, so legitimate ``-inf`` never makes a producer; for an inf-only failure NaN and inf count.
Not guaranteed: provenance finer than module calls (that is the op-level pass).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

from nanbisect.replay.probe import CallStats, ProbeTable, Stats


@dataclass(frozen=True)
class Culprit:
    """The producing module call (or parameter update) of the failure."""

    phase: str
    module: str
    module_call: int | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    source: str | None
    op: str | None = None
    op_index: int | None = None
    rank: int = 0
    parameter: str | None = None


@dataclass(frozen=True)
class TraceRow:
    """One line of the backtrace table in report.md."""

    order: int
    module: str
    call: int
    role: str            # "clean" | "culprit" | "encloses culprit" | "producer" | "propagator"
    before: Stats        # inputs (forward) or gradient arriving from the outputs (backward)
    after: Stats | None  # output (forward) or gradient leaving towards the inputs (backward)


def _bad(s: Stats | None, kind: str) -> bool:
    return s is not None and s.bad(kind)


def _ancestors(c: CallStats, by_index: dict[int, CallStats]):
    p = c.call.parent
    while p is not None:
        yield by_index[p]
        p = by_index[p].call.parent


def _innermost(cands: list[CallStats], by_index: dict[int, CallStats]) -> list[CallStats]:
    enclosing = {a.call.index for c in cands for a in _ancestors(c, by_index)}
    return [c for c in cands if c.call.index not in enclosing]


def forward_producer(table: ProbeTable, kind: str) -> CallStats | None:
    """The innermost, earliest-finishing call that turned clean inputs into bad outputs."""
    by_index = {c.call.index: c for c in table.calls}
    cands = [c for c in table.calls if not c.inputs.bad(kind) and _bad(c.output, kind)
             and all(_bad(a.output, kind) for a in _ancestors(c, by_index))]
    cands = _innermost(cands, by_index)
    return min(cands, key=lambda c: c.call.end, default=None)


def backward_producer(table: ProbeTable, kind: str) -> tuple[CallStats | None, str | None]:
    """The innermost call whose incoming gradient is clean and whose outgoing one is bad.

    Returns the call and, when the bad value surfaced only in a parameter gradient, that
    parameter's name.
    """
    by_index = {c.call.index: c for c in table.calls}
    bad_params: dict[str, tuple[int, str]] = {}
    for pg in table.params:
        if pg.stats.bad(kind) and pg.module not in bad_params:
            bad_params[pg.module] = (pg.order, pg.name)
    cands, order = [], {}
    for c in table.calls:
        if _bad(c.grad_out, kind):
            continue
        events = []
        if _bad(c.grad_in, kind):
            events.append((c.call.grad_events.get("grad_in", 1 << 30), None))
        if c.call.module in bad_params:
            events.append(bad_params[c.call.module])
        if events:
            cands.append(c)
            order[c.call.index] = min(events)
    cands = _innermost(cands, by_index)
    if not cands:
        return None, None
    best = min(cands, key=lambda c: order[c.call.index])
    return best, order[best.call.index][1]


def source_of(model: torch.nn.Module, module_name: str) -> str | None:
    """'file.py:line' of the forward method of the named module's class."""
    try:
        fn = type(model.get_submodule(module_name)).forward
        path = inspect.getsourcefile(fn)
        line = inspect.getsourcelines(fn)[1]
    except (AttributeError, TypeError, OSError):
        return None
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{line}"


def culprit_from_call(model: torch.nn.Module, c: CallStats, phase: str,
                      parameter: str | None = None) -> Culprit:
    return Culprit(phase=phase, module=c.call.module, module_call=c.call.call,
                   input_dtypes=c.call.input_dtypes, input_shapes=c.call.input_shapes,
                   source=source_of(model, c.call.module), parameter=parameter)


def optimizer_culprit(model: torch.nn.Module, params: list[str]) -> Culprit:
    """The first parameter (in model order) the optimizer step made non-finite."""
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    name = min(params, key=lambda n: order.get(n, 1 << 30))
    p = model.get_parameter(name)
    module = name.rpartition(".")[0]
    return Culprit(phase="optimizer", module=module, module_call=None,
                   input_dtypes=[str(p.dtype).removeprefix("torch.")],
                   input_shapes=[list(p.shape)], source=None, parameter=name)


def backtrace(table: ProbeTable, culprit: CallStats, phase: str, kind: str,
              before: int = 6, after: int = 3) -> list[TraceRow]:
    """The calls around the culprit in execution order, like a debugger's backtrace."""
    if phase == "forward":
        seq = sorted(table.calls, key=lambda c: c.call.end)
        pairs = [(c, c.inputs, c.output) for c in seq]
    else:
        seq = sorted((c for c in table.calls if "grad_in" in c.call.grad_events),
                     key=lambda c: c.call.grad_events["grad_in"])
        pairs = [(c, c.grad_out or Stats(0, 0, 0, 0.0), c.grad_in) for c in seq]
    pos = next((i for i, (c, _, _) in enumerate(pairs) if c is culprit), None)
    if pos is None:
        return []
    by_index = {c.call.index: c for c in table.calls}
    enclosing = {a.call.index for a in _ancestors(culprit, by_index)}
    rows = []
    for i, (c, b, a) in enumerate(pairs[max(0, pos - before): pos + after + 1]):
        role = ("culprit" if c is culprit else "encloses culprit" if c.call.index in enclosing
                else "propagator" if b.bad(kind) and _bad(a, kind)
                else "producer" if _bad(a, kind) else "clean")
        rows.append(TraceRow(i + max(0, pos - before), c.call.module, c.call.call, role, b, a))
    return rows


def timeline(table: ProbeTable, phase: str) -> list[dict]:
    """Every module call in execution order with the NaN/inf counts and abs-max of its output
    (forward) or outgoing gradient (backward), for the report's plot."""
    if phase == "forward":
        rows = [(c, c.output) for c in sorted(table.calls, key=lambda c: c.call.end)]
    elif phase == "backward":
        rows = [(c, c.grad_in) for c in sorted(
            (c for c in table.calls if "grad_in" in c.call.grad_events),
            key=lambda c: c.call.grad_events["grad_in"])]
    else:
        return []
    return [{"module": c.call.module, "call": c.call.call, "nan": s.nan, "inf": s.inf,
             "absmax": s.absmax} for c, s in rows if s is not None]
