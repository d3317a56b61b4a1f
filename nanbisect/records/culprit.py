"""Where the failure was born (`Culprit`, `OpSite`, `OpRef`, `ContextRow`, `OpFinding`,
`OpRecording`, the backtrace and timeline rows) and what a narrow replay caught for the repro
(`Caught`, `ModuleCaught`) and what running it said (`ReproResult`, `ModuleRepro`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from nanbisect.records.seen import CallId, Stats
from nanbisect.util.recordjson import number


def known(cls: type, d: dict) -> dict:
    """The items of ``d`` that are fields of the dataclass ``cls`` (a newer writer's extra keys
    left out)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def opt(decode: Any, v: Any) -> Any:
    """``decode(v)``, None for None."""
    return None if v is None else decode(v)


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
    # the code site: the module-qualified name of the function of the line that made the value
    # (the node's forward line for a backward node, else ``source``): what a signature names,
    # since it survives edits that move the line (`nanbisect.util.frames.function_at`)
    function: str | None = None

    # -- constructors: one per way a stage knows its culprit -------------------------------
    @classmethod
    def phase_only(cls, phase: str, *, rank: int | None = 0, source: str | None = None,
                   micro_batch: int | None = None) -> "Culprit":
        """Only the phase is known (no op, module call or parameter was isolated).

        >>> Culprit.phase_only("backward", rank=None).module, Culprit.phase_only("x").input_dtypes
        ('', [])
        """
        return cls(phase, "", None, [], [], source, rank=rank, micro_batch=micro_batch)

    @classmethod
    def of_call(cls, phase: str, call: CallId, input_dtypes: list[str] | None = None,
                input_shapes: list[list[int]] | None = None, *, source: str | None = None,
                op: str | None = None, op_index: int | None = None, rank: int | None = 0,
                parameter: str | None = None, micro_batch: int | None = None) -> "Culprit":
        """A module call (``CallId("", 0)``'s module: the root), with what its inputs were,
        and the op in it when one is known.

        >>> Culprit.of_call("forward", CallId("act", 0), ["float32"], [[2]], op="aten.exp").op
        'aten.exp'
        """
        return cls(phase, call.module, call.call, list(input_dtypes or []),
                   list(input_shapes or []), source, op=op, op_index=op_index, rank=rank,
                   parameter=parameter, micro_batch=micro_batch)

    @classmethod
    def of_tensors(cls, phase: str, call: CallId, tensors: list, *, source: str | None = None,
                   op: str | None = None, op_index: int | None = None,
                   micro_batch: int | None = None) -> "Culprit":
        """A module call (and op) whose inputs are ``tensors`` (what a narrow pass caught):
        their dtypes (without ``torch.``) and shapes."""
        return cls.of_call(phase, call, [str(t.dtype).removeprefix("torch.") for t in tensors],
                           [list(t.shape) for t in tensors], source=source, op=op,
                           op_index=op_index, micro_batch=micro_batch)

    @classmethod
    def of_parameter(cls, phase: str, parameter: str, *, dtype: str | None = None,
                     shape: list[int] | None = None, source: str | None = None,
                     rank: int | None = 0, micro_batch: int | None = None) -> "Culprit":
        """A parameter whose gradient or update went bad (its module: the name's prefix).

        >>> c = Culprit.of_parameter("optimizer", "fc.weight", dtype="float32", shape=[2, 2])
        >>> c.module, c.input_dtypes, c.module_call
        ('fc', ['float32'], None)
        """
        return cls(phase, parameter.rpartition(".")[0], None, [dtype] if dtype else [],
                   [list(shape)] if shape is not None else [], source, rank=rank,
                   parameter=parameter, micro_batch=micro_batch)

    @classmethod
    def of_root(cls, phase: str, root: Any, rank: int | None) -> "Culprit":
        """What a rank's op recording traced (a `RankRoot`; None: nothing traced, the phase
        only)."""
        if root is None:
            return cls.phase_only(phase, rank=rank)
        return cls(phase, root.module or "", root.module_call, root.input_dtypes,
                   root.input_shapes, None, op=root.op, op_index=root.op_index, rank=rank)

    @classmethod
    def of_finding(cls, finding: "OpFinding", *, source: str | None = None, rank: int | None = 0,
                   parameter: str | None = None, in_optimizer: bool = False,
                   node: Node | None = None) -> "Culprit":
        """The root op the op-recording pass found (`OpFinding`): its module call, inputs,
        where it surfaced; ``node`` (else the finding's) for a backward op; no micro-batch for
        an optimizer step's."""
        return cls(finding.phase, finding.module, finding.module_call, finding.input_dtypes,
                   finding.input_shapes, source, op=finding.op, op_index=finding.op_index,
                   rank=rank, parameter=finding.parameter or parameter,
                   micro_batch=None if in_optimizer else finding.micro_batch,
                   surfaced=finding.surfaced,
                   node=(node or finding.node) if finding.phase == "backward" else None)

    def in_phase(self, phase: str) -> "Culprit":
        """This culprit, named in another phase (a compiled module call's forward repro)."""
        return replace(self, phase=phase)

    def to_json(self) -> dict:
        out = asdict(self)
        if out["step"] is None:
            del out["step"]
        return out

    @staticmethod
    def from_json(d: dict) -> "Culprit":
        """The inverse of `to_json`; a field an older writer left out reads as not known."""
        s, n = d.get("surfaced"), d.get("node")
        return Culprit(**{"phase": d.get("phase"), "module": d.get("module"),
                          "module_call": d.get("module_call"),
                          "input_dtypes": d.get("input_dtypes"),
                          "input_shapes": d.get("input_shapes"), "source": d.get("source"),
                          **known(Culprit, d),
                          "surfaced": OpRef.from_json(s) if isinstance(s, dict) else None,
                          "node": Node(**known(Node, n)) if isinstance(n, dict) else None})

@dataclass(frozen=True)
class TraceRow:
    """One line of the backtrace table in report.md."""

    order: int
    module: str
    call: int
    role: str            # "clean" | "culprit" | "encloses culprit" | "producer" | "propagator"
    before: Stats        # inputs (forward) or gradient arriving from the outputs (backward)
    after: Stats | None  # output (forward) or gradient leaving towards the inputs (backward)

    @staticmethod
    def from_json(d: dict) -> "TraceRow":
        return TraceRow(**{**d, "before": Stats.from_json(d["before"]),
                           "after": opt(Stats.from_json, d.get("after"))})

@dataclass(frozen=True)
class TimelineRow:
    """One module call on the report's plot: its output (forward) or outgoing gradient."""

    module: str
    call: int
    nan: int
    inf: int
    absmax: float
    # what came into the call (its inputs in forward, its outputs' gradient in backward) held
    # NaN/inf already: whatever it shows was passed through, not born in it
    came_in_bad: bool = False

    @staticmethod
    def from_json(d: dict) -> "TimelineRow":
        return TimelineRow(**{**d, "absmax": number(d.get("absmax"))})

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

    @staticmethod
    def from_json(d: dict) -> "OpRef":
        return OpRef(**known(OpRef, d))

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

    @staticmethod
    def from_json(d: dict) -> "ContextRow":
        return ContextRow(**{**d, "out_absmax": number(d.get("out_absmax"))})

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

    @staticmethod
    def from_json(d: dict) -> "OpRecording":
        s = d.get("scope")
        return OpRecording(CallId(s["module"], s["module_call"]) if s else None, d["phase"],
                           d["recorded_ops"], d["step_ops"], tuple(d.get("phases") or ()))

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

    @staticmethod
    def from_json(d: dict) -> "ReproResult":
        return ReproResult(d["reproduced"], d.get("exit_code"), d.get("output", ""),
                           d.get("ran", True))

@dataclass(frozen=True)
class ModuleRepro:
    """The fallback repro of the culprit's whole module call."""

    script: str
    result: ReproResult | None

    def to_json(self) -> dict:
        return {"script": self.script,
                "result": self.result.to_json() if self.result is not None else None}

    @staticmethod
    def from_json(d: dict) -> "ModuleRepro":
        return ModuleRepro(d["script"], opt(ReproResult.from_json, d.get("result")))
