"""Provenance: from the value that failed back to the op that gave birth to it.

Pure functions over an `OpTable`. Starting at a bad value (the loss, a gradient, an updated
parameter), follow the inputs that carry the same kind of bad value back to ops whose inputs are
all free of it: those are roots, and the earliest root is the culprit. Values that were bad but
never reached the start (a NaN that ``masked_fill_`` removed inside a backward formula, one that
relu's backward zeroed) are never visited, so they are never blamed. A legitimate ``-inf`` never
makes a NaN root: for a NaN failure only NaN counts as bad. When the culprit's inputs carried inf,
`inf_origin` follows that inf back to where it was born from finite values (an overflow, a mask).

The rule of birth: the culprit is the first op whose output holds a value of the failing kind
that none of its inputs held, in whatever phase. An op that makes an infinity is the culprit only
when the failure is an infinity and no NaN came first; otherwise it is ``inf_origin``, the start
of the chain ``inf_origin`` -> culprit -> ``surfaced``.

Across phases (a table that holds forward and backward ops): a backward failure can come from a
value forward made and hid (masked by ``where``, or kept in a secondary output saved for
backward). `points_to_forward` says, from a backward-only table, whether the failure may lead
there; `surfaced_at` names the backward op where such a value became visible,
`forward_inf_origin` the forward op whose infinity a backward formula turned into a NaN (the
NaN's ``inf_origin``, not its culprit: ``log(0)`` behind a ``where``, whose backward divides 0 by
0), and `hidden_by` how forward hid it. A NaN that forward made and removed (``nan_to_num``) is
not the one a backward formula makes again from the same infinities: the culprit is where the
NaN that reached the failure was born.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from nanbisect.records import ContextRow, OpRef
from nanbisect.replay.recorder import Flags, InputRef, OpRecord, OpTable

Pred = Callable[[Flags], bool]


@dataclass(frozen=True)
class Root:
    op: OpRecord
    output: int            # which output of the op carries the bad value
    external: bool = False


def _pred(kind: str) -> Pred:
    return (lambda f: f.nan) if kind == "nan" else (lambda f: f.nan or f.inf)


def _walk(table: OpTable, starts: list[tuple[int, int]], bad: Pred
          ) -> Iterator[tuple[int, int, list[InputRef]]]:
    """Every bad value reachable backwards from ``starts`` through bad inputs, once each, as
    ``(op position, output, the bad inputs that fed it)``. Iterative (backward graphs can be
    thousands of ops deep); inputs no recorded op produced are yielded, not followed."""
    ops = table.ops
    seen: set[tuple[int, int]] = set()
    todo = [s for s in starts if bad(ops[s[0]].outputs[s[1]].flags)]
    while todo:
        p, j = todo.pop()
        if (p, j) in seen:
            continue
        seen.add((p, j))
        rec = ops[p]
        bad_inputs = [i for i in rec.inputs_for(rec.outputs[j]) if bad(i.flags)]
        yield p, j, bad_inputs
        todo.extend((i.producer, i.output) for i in bad_inputs if i.producer is not None)


def trace(table: OpTable, starts: list[tuple[int, int]], bad: Pred) -> Root | None:
    """Earliest op reachable backwards from ``starts`` whose inputs are clean and output bad.

    ``starts`` are ``(op position, output)`` pairs of values known to be bad.
    """
    best: Root | None = None
    for p, j, bad_inputs in _walk(table, starts, bad):
        if not bad_inputs and (best is None or p < best.op.pos):
            best = Root(table.ops[p], j)
    return best


def reaches_outside(table: OpTable, starts: list[tuple[int, int]], kind: str) -> bool:
    """Does the backward walk from ``starts`` meet a bad value that no recorded op produced
    (one from before the recorded window)?"""
    return any(i.producer is None for _, _, bad_inputs in _walk(table, starts, _pred(kind))
               for i in bad_inputs)


def culprit_root(table: OpTable, starts: list[tuple[int, int]], kind: str) -> Root | None:
    return trace(table, starts, _pred(kind))


def inf_origin(table: OpTable, root: Root) -> Root | None:
    """Where the inf that the culprit consumed was born from finite values, if recorded."""
    out = root.op.outputs[root.output]
    starts = [(i.producer, i.output) for i in root.op.inputs_for(out)
              if i.flags.inf and i.producer is not None]
    return trace(table, starts, lambda f: f.nan or f.inf) if starts else None


# Ops autograd runs for its own bookkeeping (saving a tensor for backward, `.detach()` of a
# leaf, views it makes of its own outputs), not the model's computation: left out of the ops a
# report lists before the culprit (NB: still counted in op_index, which every op keeps).
# `_to_copy` stays: a dtype cast is computation, and often the very step that made a value bad.
AUTOGRAD_INTERNAL = frozenset({"aten.detach.default", "aten.detach_.default",
                               "aten.alias.default"})


def context(table: OpTable, root: Root, n: int = 5) -> list[ContextRow]:
    """The ``n`` recorded ops before the culprit (autograd's own, `AUTOGRAD_INTERNAL`, left
    out), with what their outputs held."""
    before = [rec for rec in table.ops[:root.op.pos] if str(rec.op) not in AUTOGRAD_INTERNAL]
    return [ContextRow(op_index=rec.index, op=rec.op, module=rec.module,
                       module_call=rec.module_call, phase=rec.phase,
                       out_nan=any(o.flags.nan for o in rec.outputs),
                       out_inf=any(o.flags.inf for o in rec.outputs),
                       # None: a view (no new value) or only NaN (no finite magnitude)
                       out_absmax=max((o.flags.absmax for o in rec.outputs if not o.flags.nan),
                                      default=None),
                       culprit=rec is root.op)
            for rec in before[max(0, len(before) - n):] + [root.op]]


def op_ref(root: Root) -> OpRef:
    """The report's name for a root op."""
    rec = root.op
    return OpRef(rec.op, rec.index, rec.phase, rec.module, rec.module_call)


def _nonfinite(f: Flags) -> bool:
    return f.nan or f.inf


def points_to_forward(table: OpTable, starts: list[tuple[int, int]], root: Root | None,
                      kind: str) -> bool:
    """From a table of the backward phase alone: may the failure come from a value forward made?

    Yes when no root op was found, when the walk from ``starts`` meets a bad value no recorded
    op produced (forward made it), when the root's inf came from outside, and when the root ran
    in a built-in backward formula from finite values (or from an inf born in that same
    formula): the derivative at a point where the forward op itself was not finite (``log`` at
    0 behind a ``where``)."""
    if root is None or reaches_outside(table, starts, kind):
        return True
    ins = root.op.inputs_for(root.op.outputs[root.output])
    infs = [(i.producer, i.output) for i in ins if i.flags.inf and i.producer is not None]
    if any(i.flags.inf and i.producer is None for i in ins) or (
            infs and reaches_outside(table, infs, "inf")):
        return True
    if root.op.formula:
        origin = inf_origin(table, root)
        return not infs or (origin is not None and origin.op.node == root.op.node)
    return False


def surfaced_at(table: OpTable, starts: list[tuple[int, int]], kind: str,
                root: Root) -> Root | None:
    """The earliest op on the failure's path, in a later phase than ``root``, that read a bad
    value made in ``root``'s phase: where a failure born there became visible."""
    bad, ops = _pred(kind), table.ops
    best: Root | None = None
    for p, j, bad_inputs in _walk(table, starts, bad):
        if ops[p].phase != root.op.phase and any(
                i.producer is not None and ops[i.producer].phase == root.op.phase
                for i in bad_inputs) and (best is None or p < best.op.pos):
            best = Root(ops[p], j)
    return best


def forward_op_of(table: OpTable, op: OpRecord) -> OpRecord | None:
    """The forward op that created the autograd node a backward op of a built-in formula ran
    in (recorded with ``OpRecorder(nodes=True)``)."""
    if op.phase != "backward" or not op.formula or op.node is None:
        return None
    return next((o for o in table.ops if o.phase == "forward" and o.node == op.node), None)


def forward_inf_origin(table: OpTable, root: Root) -> Root | None:
    """For a backward root made inside a built-in formula from finite inputs: where the
    infinity of the forward op that formula differentiates was born (``log(0)`` behind a
    ``where``: its backward divides 0 by 0). None when that op's outputs were finite."""
    fwd = forward_op_of(table, root.op)
    if fwd is None:
        return None
    outs = [(fwd.pos, j) for j, o in enumerate(fwd.outputs) if o.flags.inf]
    return trace(table, outs, _nonfinite) if outs else None


def hidden_by(table: OpTable, root: Root) -> str:
    """In words, how the phase of ``root`` hid the non-finite values it made: the first op of
    that phase that read them and gave a finite result (``where``, ``masked_fill``, a multiply
    by 0), else that nothing there read them (a secondary output kept for backward)."""
    ops, phase = table.ops, root.op.phase
    consumers: dict[tuple[int, int], list[OpRecord]] = {}
    for op in ops[root.op.pos + 1:]:
        if op.phase == phase and op.outputs:    # a view or detach makes no new value
            for i in op.inputs:
                if i.producer is not None:
                    consumers.setdefault((i.producer, i.output), []).append(op)
    bad = [(root.op.pos, j) for j, o in enumerate(root.op.outputs) if _nonfinite(o.flags)]
    todo, seen, read, masker = list(bad), set(bad), False, None
    while todo:
        value = todo.pop()
        for op in consumers.get(value, []):
            read = True
            for j, out in enumerate(op.outputs):
                if not any((i.producer, i.output) == value for i in op.inputs_for(out)):
                    continue
                if not _nonfinite(out.flags):
                    masker = op if masker is None or op.pos < masker.pos else masker
                elif (op.pos, j) not in seen:
                    seen.add((op.pos, j))
                    todo.append((op.pos, j))
    if masker is not None:
        return f"masked there by {masker.op}"
    n = len(root.op.outputs)
    which = (f"in output {root.output} of {n}" if n > 1 else "in its output")
    return (f"kept {which}, which nothing in {phase} read (saved for backward)" if not read
            else f"{which}, which {phase} passed on without it reaching the loss")
