"""The op recorder's table: what each recorded op read and wrote, and what each value held.

`OpTable` is what `nanbisect.replay.recorder.OpRecorder.read` returns: one `OpRecord` per recorded
op, in order, its inputs (`InputRef`: the op that made the value, or None for a value made outside
the recorded window) and outputs (`OutputRef`), each with the `Flags` read from the device.
Frozen records only: nothing here holds a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flags:
    """What one value held."""

    nan: bool
    posinf: bool
    neginf: bool
    absmax: float

    @property
    def inf(self) -> bool:
        return self.posinf or self.neginf

    def bad(self, kind: str) -> bool:
        return self.nan if kind == "nan" else (self.nan or self.inf)


CLEAN = Flags(False, False, False, 0.0)


@dataclass(frozen=True)
class InputRef:
    producer: int | None   # position in OpTable.ops of the op that made this value, None = outside
    output: int            # which output of that op
    flags: Flags
    elem: int | None       # list position (foreach ops)
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OutputRef:
    flags: Flags
    elem: int | None


@dataclass(frozen=True)
class OpRecord:
    pos: int                         # position among recorded ops
    index: int                       # position in the step's op sequence (all phases)
    op: str                          # str() of the overload, e.g. "aten.sqrt.default"
    phase: str
    module: str | None               # dotted module name; None when unknown
    module_call: int | None
    inputs: tuple[InputRef, ...]
    outputs: tuple[OutputRef, ...]
    occurrence: int = 0              # calls of the same op before it in its phase (all of them,
                                     # recorded or outside the scope)
    micro: int = 0                   # the micro-batch it ran in (Task.accumulate)
    # the autograd node (its sequence number): for a backward op the node whose backward ran it;
    # for a forward op (recorded with nodes=True) the node it created; None: none or unknown
    node: int | None = None
    formula: bool = False            # a backward op of a built-in formula (not a custom Function)
    node_name: str | None = None     # a backward op's node, as detect_anomaly names it

    def inputs_for(self, out: OutputRef) -> list[InputRef]:
        """The inputs that fed one output (the matching list element for foreach ops)."""
        if out.elem is None:
            return list(self.inputs)
        return [i for i in self.inputs if i.elem is None or i.elem == out.elem]


@dataclass(frozen=True)
class OpTable:
    ops: list[OpRecord]
    total_ops: int

    def leaves(self) -> list[tuple[int, int]]:
        """Values no recorded op consumed: what left the recorded window (or was dropped)."""
        used = {(i.producer, i.output) for op in self.ops for i in op.inputs
                if i.producer is not None}
        return [(op.pos, j) for op in self.ops for j in range(len(op.outputs))
                if (op.pos, j) not in used]
