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

import torch

from nanbisect.records import Culprit, Node, OpFinding, Stats, TimelineRow, TraceRow
from nanbisect.replay.probe import CallStats, ProbeTable


def _bad(s: Stats | None, kind: str) -> bool:
    return s is not None and s.bad(kind)


def _innermost(table: ProbeTable, cands: list[CallStats]) -> list[CallStats]:
    enclosing = {a.call for c in cands for a in table.ancestors(c)}
    return [c for c in cands if c.call not in enclosing]


def forward_producer(table: ProbeTable, kind: str) -> CallStats | None:
    """The innermost, earliest-finishing call that turned clean inputs into bad outputs.

    >>> from nanbisect.records import CallId
    >>> ok, nan = Stats(0, 0, 0, 1.0), Stats(3, 0, 0, 1.0)
    >>> outer = CallStats(CallId("", 0), None, [], [], 1, None, ok, nan, None, None)
    >>> inner = CallStats(CallId("act", 0), CallId("", 0), [], [], 0, None, ok, nan, None, None)
    >>> forward_producer(ProbeTable([outer, inner], []), "nan").call
    CallId(module='act', call=0)
    """
    cands = [c for c in table.calls if not c.inputs.bad(kind) and _bad(c.output, kind)
             and all(_bad(a.output, kind) for a in table.ancestors(c))]
    return min(_innermost(table, cands), key=lambda c: c.end, default=None)


def backward_producer(table: ProbeTable, kind: str) -> tuple[CallStats | None, str | None]:
    """The innermost call whose incoming gradient is clean and whose outgoing one is bad.

    Returns the call and, when the bad value surfaced only in a parameter gradient, that
    parameter's name.
    """
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
            events.append((c.grad_in_order if c.grad_in_order is not None else 1 << 30, None))
        if c.call.module in bad_params:
            events.append(bad_params[c.call.module])
        if events:
            cands.append(c)
            order[c.call] = min(events)
    cands = _innermost(table, cands)
    if not cands:
        return None, None
    best = min(cands, key=lambda c: order[c.call])
    return best, order[best.call][1]


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


def first_bad_parameter(model: torch.nn.Module, params: list[str]) -> str:
    """The first of ``params`` in model order (the parameter an optimizer culprit names)."""
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    return min(params, key=lambda n: order.get(n, 1 << 30))


def backtrace(table: ProbeTable, culprit: CallStats, phase: str, kind: str,
              before: int = 6, after: int = 3) -> list[TraceRow]:
    """The calls around the culprit in execution order, like a debugger's backtrace."""
    seq = table.in_order(phase)
    if phase == "forward":
        pairs = [(c, c.inputs, c.output) for c in seq]
    else:
        pairs = [(c, c.grad_out or Stats(0, 0, 0, 0.0), c.grad_in) for c in seq]
    pos = next((i for i, (c, _, _) in enumerate(pairs) if c.call == culprit.call), None)
    if pos is None:
        return []
    enclosing = {a.call for a in table.ancestors(culprit)}
    rows = []
    for i, (c, b, a) in enumerate(pairs[max(0, pos - before): pos + after + 1]):
        role = ("culprit" if c.call == culprit.call else "encloses culprit"
                if c.call in enclosing else "propagator" if b.bad(kind) and _bad(a, kind)
                else "producer" if _bad(a, kind) else "clean")
        rows.append(TraceRow(i + max(0, pos - before), c.call.module, c.call.call, role, b, a))
    return rows


def timeline(table: ProbeTable, phase: str) -> list[TimelineRow]:
    """Every module call in execution order with the NaN/inf counts and abs-max of its output
    (forward) or outgoing gradient (backward), and whether what came into it was bad already,
    for the report's plot."""
    side = (lambda c: c.output) if phase == "forward" else (lambda c: c.grad_in)
    incoming = (lambda c: c.inputs) if phase == "forward" else (lambda c: c.grad_out)
    return [TimelineRow(c.call.module, c.call.call, s.nan, s.inf, s.absmax,
                        came_in_bad=bool(i is not None and (i.nan or i.inf)))
            for c in table.in_order(phase) for s, i in [(side(c), incoming(c))] if s is not None]


def make_culprit(model: torch.nn.Module, phase: str, *, finding: OpFinding | None = None,
                 call: CallStats | None = None, parameter: str | None = None,
                 source: str | None = None, rank: int = 0,
                 micro_batch: int | None = None, node: Node | None = None) -> Culprit:
    """The culprit, built once from what the passes found, most precise first: the root op
    (``finding``: its module call, dtypes and shapes), else the producing module call, else
    the parameter an optimizer step made non-finite, else only the phase. ``source`` is the
    user line the narrow pass caught; without it, a module call's ``forward``. ``node``: the
    autograd node a backward culprit op ran in, as the narrow pass caught it (else as the
    op recording saw it: ``finding.node``, without a source line).

    >>> make_culprit(torch.nn.Linear(2, 2), "optimizer", parameter="weight").input_shapes
    [[2, 2]]
    """
    if finding is not None:
        if source is None and finding.module and phase != "optimizer":
            source = source_of(model, finding.module)
        return Culprit.of_finding(finding, source=source, rank=rank, parameter=parameter,
                                  in_optimizer=phase == "optimizer", node=node)
    if call is not None:
        return Culprit.of_call(phase, call.call, call.input_dtypes, call.input_shapes,
                               source=source or source_of(model, call.call.module), rank=rank,
                               parameter=parameter, micro_batch=micro_batch)
    if parameter is not None:
        p = model.get_parameter(parameter)
        return Culprit.of_parameter(phase, parameter, dtype=str(p.dtype).removeprefix("torch."),
                                    shape=list(p.shape), source=source, rank=rank,
                                    micro_batch=micro_batch)
    return Culprit.phase_only(phase, rank=rank, source=source, micro_batch=micro_batch)
