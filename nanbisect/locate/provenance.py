"""Provenance: from the value that failed back to the op that gave birth to it.

Pure functions over an `OpTable`. Starting at a bad value (the loss, a gradient, an updated
parameter), follow the inputs that carry the same kind of bad value back to ops whose inputs are
all free of it: those are roots, and the earliest root is the culprit. Values that were bad but
never reached the start (a NaN that ``masked_fill_`` removed inside a backward formula, one that
relu's backward zeroed) are never visited, so they are never blamed. A legitimate ``-inf`` never
makes a NaN root: for a NaN failure only NaN counts as bad. When the culprit's inputs carried inf,
`inf_origin` follows that inf back to where it was born from finite values (an overflow, a mask).
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


def context(table: OpTable, root: Root, n: int = 5) -> list[ContextRow]:
    """The ``n`` recorded ops before the culprit, with what their outputs held."""
    return [ContextRow(op_index=rec.index, op=rec.op, module=rec.module,
                       module_call=rec.module_call, phase=rec.phase,
                       out_nan=any(o.flags.nan for o in rec.outputs),
                       out_inf=any(o.flags.inf for o in rec.outputs),
                       # None: a view (no new value) or only NaN (no finite magnitude)
                       out_absmax=max((o.flags.absmax for o in rec.outputs if not o.flags.nan),
                                      default=None),
                       culprit=rec is root.op)
            for rec in table.ops[max(0, root.op.pos - n): root.op.pos + 1]]


def op_ref(root: Root) -> OpRef:
    """The report's name for a root op."""
    rec = root.op
    return OpRef(rec.op, rec.index, rec.phase, rec.module, rec.module_call)
