"""Where the failure was born (`Culprit`, `OpSite`, `OpRef`, `ContextRow`, `OpFinding`,
`OpRecording`, the backtrace and timeline rows) and what a narrow replay caught for the repro
(`Caught`, `ModuleCaught`) and what running it said (`ReproResult`, `ModuleRepro`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from nanbisect.records.seen import CallId, Stats


@dataclass(frozen=True)
class Node:
    """The autograd node a backward op ran in, as ``detect_anomaly`` names it
    (``SqrtBackward0``), with the forward op that created it and that op's user source line.
    ``forward_op`` is None where no one op made the node (a custom ``autograd.Function``'s)."""

    name: str
    forward_op: str | None = None
    forward_source: str | None = None


@dataclass(frozen=True)
class Culprit:
    """What the report names: the op (or the module call, or the parameter update) at fault."""

    phase: str
    module: str
    module_call: int | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    source: str | None
    op: str | None = None
    op_index: int | None = None
    rank: int = 0
    parameter: str | None = None      # the parameter whose gradient or update went bad
    micro_batch: int | None = None    # which micro-batch of the step (Task.accumulate)
    step: int | None = None           # --steps: the step bisected (the first that parts)
    # where the failure became visible when that is not where it was born (a NaN made in
    # forward, hidden there, surfacing in backward); None: born where it surfaced
    surfaced: "OpRef | None" = None
    # the batch rows (dim 0 of the batch's tensors) the first bad value depends on, traced
    # through the ops; None when they cannot be traced (or were not: a divergence, no batch)
    samples: list[int] | None = None
    # a backward culprit's autograd node (None in other phases, or when it ran in none)
    node: Node | None = None
    # a plain sentence for a recognised pattern (`nanbisect.locate.cause`), None otherwise
    likely_cause: str | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        if out["step"] is None:
            del out["step"]
        return out

    @staticmethod
    def from_json(d: dict) -> "Culprit":
        s, n = d.get("surfaced"), d.get("node")
        return Culprit(**{**d, "surfaced": OpRef(**s) if s is not None else None,
                          "node": Node(**n) if isinstance(n, dict) else None})

@dataclass(frozen=True)
class TraceRow:
    """One line of the backtrace table in report.md."""

    order: int
    module: str
    call: int
    role: str            # "clean" | "culprit" | "encloses culprit" | "producer" | "propagator"
    before: Stats        # inputs (forward) or gradient arriving from the outputs (backward)
    after: Stats | None  # output (forward) or gradient leaving towards the inputs (backward)

@dataclass(frozen=True)
class TimelineRow:
    """One module call on the report's plot: its output (forward) or outgoing gradient."""

    module: str
    call: int
    nan: int
    inf: int
    absmax: float

@dataclass(frozen=True)
class OpSite:
    """Where a narrow pass looks for an op again: the ``occurrence``-th call of ``op`` in
    ``phase`` (NB: not the step-wide op index, which per-iteration wrapper state can shift)."""

    op: str
    phase: str
    occurrence: int

@dataclass(frozen=True)
class OpRef:
    """An op of the step, as the report names it (e.g. where an inf was born)."""

    op: str
    op_index: int
    phase: str
    module: str | None
    module_call: int | None

    def to_json(self) -> dict:
        return asdict(self)

@dataclass(frozen=True)
class ContextRow:
    """One recorded op up to and including the culprit, with what its outputs held."""

    op_index: int
    op: str
    module: str | None
    module_call: int | None
    phase: str
    out_nan: bool
    out_inf: bool
    out_absmax: float | None      # None: a view (no new value) or only NaN
    culprit: bool

    def to_json(self) -> dict:
        return asdict(self)

@dataclass(frozen=True)
class OpFinding:
    """The root op of the failure, as the op-recording pass found it."""

    site: OpSite
    op_index: int
    module: str                   # "" = outside any submodule
    module_call: int | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    parameter: str | None = None
    context: list[ContextRow] = field(default_factory=list)
    inf_origin: OpRef | None = None
    total_ops: int = 0
    recorded: int = 0             # ops recorded (all of the phase, or only the scoped call's)
    scope: CallId | None = None   # the module call recording started at
    micro_batch: int = 0          # the micro-batch the op ran in (Task.accumulate)
    # born in an earlier phase than it surfaced: where it surfaced, what the op made ("nan" or
    # "inf": what its repro looks for), and in words how that phase hid it
    surfaced: OpRef | None = None
    born: str | None = None
    hidden: str | None = None
    phases: tuple[str, ...] = ()  # the phases recorded, when more than the failing one
    # where to catch the surfaced op again, when it alone shows the failure (its inputs are
    # free of it) and a repro of it helps
    surfaced_site: OpSite | None = None
    # where to find the ``inf_origin`` op again (the precision remedy tries it first)
    origin_site: OpSite | None = None
    # a backward root's autograd node as the recording saw it (the forward op when forward was
    # recorded too; no source line: the narrow catch adds it)
    node: Node | None = None

    @property
    def op(self) -> str:
        return self.site.op

    @property
    def phase(self) -> str:
        return self.site.phase

@dataclass(frozen=True)
class OpRecording:
    """What the op-recording pass covered."""

    scope: CallId | None      # None: the whole phase was recorded
    phase: str
    recorded_ops: int
    step_ops: int
    phases: tuple[str, ...] = ()   # the phases recorded, when more than ``phase`` (cross-phase)

    def to_json(self) -> dict:
        return {"scope": ({"module": self.scope.module, "module_call": self.scope.call}
                          if self.scope else None),
                "phase": self.phase, "recorded_ops": self.recorded_ops,
                "step_ops": self.step_ops, **({"phases": list(self.phases)} if self.phases
                                              else {})}

@dataclass(frozen=True)
class Caught:
    """The culprit op's arguments (tensors cloned), the RNG state and the user source line at
    the moment it ran."""

    op: str
    args: list
    kwargs: dict
    mutated: list[int]
    rng: dict[str, "torch.Tensor"]
    source: str | None
    node: Node | None = None          # the autograd node it ran in (a backward op)

@dataclass(frozen=True)
class ModuleCaught:
    """A module call's inputs, the module's own state and the RNG state at its start; for a
    backward culprit also the gradient that arrived at each of its outputs (None: no gradient,
    or not a floating tensor), in the order of the output's tensors (lists, tuples, dict values).
    """

    call: CallId
    args: list
    kwargs: dict
    state: dict[str, "torch.Tensor"]
    rng: dict[str, "torch.Tensor"]
    grad_out: list | None = None

@dataclass(frozen=True)
class ReproResult:
    """What running a repro script once in a fresh interpreter said."""

    reproduced: bool
    exit_code: int | None         # None: it timed out
    output: str                   # the last lines it printed
    ran: bool = True

    def to_json(self) -> dict:
        return {"ran": self.ran, "reproduced": self.reproduced, "exit_code": self.exit_code,
                "output": self.output}

@dataclass(frozen=True)
class ModuleRepro:
    """The fallback repro of the culprit's whole module call."""

    script: str
    result: ReproResult | None

    def to_json(self) -> dict:
        return {"script": self.script,
                "result": self.result.to_json() if self.result is not None else None}
