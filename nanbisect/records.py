"""The records that cross stages: frozen dataclasses with typed fields, in one place.

What a replay saw (`StepOutcome`, `BadValue`, `Stats`), where the failure was born (`CallId`,
`Culprit`, `OpSite`, `OpFinding`, `OpRef`, `ContextRow`), what a narrow replay caught for the
repro (`Caught`, `ModuleCaught`) and what running it said (`ReproResult`), what the reference
said (`Comparison`, `OpCheck`, `Divergence`), the facts every report shares (`Losses`,
`RunFacts`), and the protocol between the multi-rank launcher and its rank workers (`Bucket`,
`RankSummary`, `RankRoot`, `Plan`, `RankResult`). Records that become JSON say how, in
``to_json``; those that come back from JSON (the rank workers' results) have ``from_json``.

Guarantees: importing this module imports no torch; nothing here computes on tensors (records
that hold tensors only carry them).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


def json_number(x: float | None) -> float | str | None:
    """A float as JSON: itself when finite, else ``"nan"``, ``"inf"`` or ``"-inf"``.

    >>> json_number(float("inf")), json_number(0.5), json_number(None)
    ('inf', 0.5, None)
    """
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))


class Word(str, Enum):
    """A word of the report contract: a ``str`` (JSON, comparisons and f-strings see its
    value), drawn from a closed set (a misspelt one fails where it is made)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__     # NB: Enum hashes the name; a dict keyed by the value must
                                # find a member (``{"culprit": 1}[Verdict.CULPRIT]``)


class Verdict(Word):
    """report.json ``verdict``.

    >>> Verdict("culprit") == "culprit", f"{Verdict.NOT_REPRODUCED}"
    (True, 'not-reproduced')
    """

    CULPRIT = "culprit"
    CLEAN = "clean"
    NOT_REPRODUCED = "not-reproduced"
    INPUT_NONFINITE = "input-nonfinite"


class Classification(Word):
    """report.json ``classification`` (what each means: DESIGN.md; each must be earned)."""

    DEVICE = "device"                    # the op, same inputs and dtype, wrong on the target
    NUMERICS = "numerics"                # the arithmetic at that dtype fails on any device
    DATA = "data"                        # the batch or a loaded state held it already
    TRANSIENT = "transient"              # faithful replay, the failure does not come back
    COMMUNICATION = "communication"      # finite into a collective, non-finite out of it
    CODE_CHANGED = "code-changed"        # the user's code differs from the capture's
    REPLAY_MISMATCH = "replay-mismatch"  # the replay does not compute the captured step
    COMPILER = "compiler"                # fails compiled, not eager, from the same state
    UNKNOWN = "unknown"                  # not enough evidence


# ------------------------------------------------------------------------------------------
# what a replay saw


ROOT = "<root>"   # how reports name the top-level module (JSON: "")


def module_label(name: str | None) -> str:
    """A module's dotted name as the reports print it: ``ROOT`` for the top-level module, that
    is, code outside any submodule (the model's own forward, the loss function); JSON keeps
    ``""`` (DESIGN.md)."""
    return name or ROOT


class CallId(NamedTuple):
    """The k-th call of a module in the step: the one identity every stage uses for it.

    >>> CallId("blocks.1.mlp.act", 2)
    CallId(module='blocks.1.mlp.act', call=2)
    """

    module: str     # dotted name as in named_modules(); "" = the root module
    call: int       # which call of that module in this step, from 0


@dataclass(frozen=True)
class Stats:
    """NaN/inf counts and magnitudes of the tensors at one side of a module call."""

    nan: int
    posinf: int
    neginf: int
    absmax: float           # largest finite magnitude
    abssum: float = 0.0     # sum of finite magnitudes

    @property
    def inf(self) -> int:
        return self.posinf + self.neginf

    def bad(self, kind: str) -> bool:
        """For a NaN failure only NaN is bad (-inf is legitimate); for an inf one, both."""
        return self.nan > 0 if kind == "nan" else (self.nan + self.inf) > 0


@dataclass(frozen=True)
class BadValue:
    """A named tensor (batch leaf, parameter, gradient, ...) holding non-finite values."""

    where: str      # "batch" | "parameter" | "buffer" | "optimizer" | "grad" | "loss"
    name: str
    nan: int
    posinf: int
    neginf: int

    @property
    def kind(self) -> str:
        return "nan" if self.nan else "inf"


@dataclass(frozen=True)
class StepOutcome:
    """What one replay of the step showed."""

    loss: float | None
    phase: str | None                 # first phase with non-finite values; None = clean
    bad: list[BadValue] = field(default_factory=list)
    # detached: it names the loss value (and its storage, for provenance) without keeping the
    # step's autograd graph, and every activation it holds, alive after the run
    loss_tensor: "torch.Tensor | None" = field(default=None, repr=False, compare=False)
    micro_batch: int | None = None    # the micro-batch where it failed (or stopped)
    scaler_skipped: bool = False      # the GradScaler skipped the update (not a failure)

    @property
    def kind(self) -> str | None:
        return None if not self.bad else ("nan" if any(b.nan for b in self.bad) else "inf")


# ------------------------------------------------------------------------------------------
# where the failure was born


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

    def to_json(self) -> dict:
        out = asdict(self)
        if out["step"] is None:
            del out["step"]
        return out


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

    def to_json(self) -> dict:
        return {"scope": ({"module": self.scope.module, "module_call": self.scope.call}
                          if self.scope else None),
                "phase": self.phase, "recorded_ops": self.recorded_ops,
                "step_ops": self.step_ops}


# ------------------------------------------------------------------------------------------
# the repro


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


# ------------------------------------------------------------------------------------------
# target against reference


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one target tensor with its reference."""

    ok: bool
    numel: int
    mismatched: int
    worst_abs: float
    worst_index: tuple[int, ...] | None
    worst_target: float | None
    worst_expected: float | None
    max_rel: float
    cosine: float
    share_off: float          # share of elements with relative error beyond the dtype's threshold
    nonfinite_new: int = 0    # non-finite in the target where the expected value is finite
    reason: str = ""

    def message(self) -> str:
        """assert_close-style text, e.g. 'Mismatched elements: 3 / 4096 (0.1%) ...'."""
        if self.ok:
            return "within tolerance"
        pct = 100.0 * self.mismatched / max(self.numel, 1)
        lines = [f"Mismatched elements: {self.mismatched} / {self.numel} ({pct:.3g}%)"]
        if self.worst_index is not None:
            lines.append(f"Greatest absolute difference: {self.worst_abs:.4g} at index "
                         f"{self.worst_index} (target {self.worst_target:.6g}, expected "
                         f"{self.worst_expected:.6g})")
        lines.append(f"Greatest relative difference: {self.max_rel:.4g}; cosine similarity "
                     f"{self.cosine:.6f}; share off by more than the dtype's threshold "
                     f"{100 * self.share_off:.3g}%")
        if self.nonfinite_new:
            lines.append(f"Non-finite in target where expected is finite: {self.nonfinite_new}")
        if self.reason:
            lines.append(self.reason)
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("worst_abs", "max_rel", "cosine", "worst_target", "worst_expected"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = repr(d[k])
        d["worst_index"] = list(d["worst_index"]) if d["worst_index"] is not None else None
        d["message"] = self.message()
        return d

    @staticmethod
    def from_json(d: dict) -> "Comparison":
        """The inverse of `to_json` (between our own processes)."""
        kw = {f.name: d[f.name] for f in fields(Comparison) if f.name in d}
        for k in ("worst_abs", "max_rel", "cosine", "worst_target", "worst_expected"):
            if isinstance(kw.get(k), str):
                kw[k] = float(kw[k])
        if kw.get("worst_index") is not None:
            kw["worst_index"] = tuple(kw["worst_index"])
        return Comparison(**kw)


@dataclass(frozen=True)
class OpCheck:
    """The verdict on one op, judged in isolation on the reference from the target's inputs."""

    op: str
    op_index: int
    status: str                  # "ok" | "mismatch" | "uncomparable" | "skipped"
    how: str | None = None       # "kernel" | "registered": what ran on the reference
    comparisons: list[Comparison] = field(default_factory=list)
    detail: str = ""

    def to_json(self) -> dict:
        return {"op": self.op, "op_index": self.op_index, "status": self.status,
                "how": self.how, "detail": self.detail,
                "comparisons": [c.to_json() for c in self.comparisons]}

    @staticmethod
    def from_json(d: dict) -> "OpCheck":
        return OpCheck(d["op"], d["op_index"], d["status"], d.get("how"),
                       [Comparison.from_json(c) for c in d.get("comparisons", [])],
                       d.get("detail", ""))


@dataclass(frozen=True)
class Divergence:
    """Where target and reference first disagree after a whole step without NaN."""

    phase: str                 # forward (loss) | backward (a gradient) | optimizer (a parameter)
    what: str                  # "loss", "grad:<name>", "param:<name>"
    comparison: Comparison

    def to_json(self) -> dict:
        return {"what": self.what, **self.comparison.to_json()}


# ------------------------------------------------------------------------------------------
# the facts every report of a run shares


@dataclass(frozen=True)
class Losses:
    """The step's loss as captured and as replayed on each side (JSON numbers or "nan"/"inf")."""

    original: float | str | None
    target: float | str | None
    reference: float | str | None = None
    bit_exact: bool | None = None    # None: not decidable (no finite original, or no loss)

    def to_json(self) -> dict:
        d = {"original_loss": self.original, "target_loss": self.target,
             "reference_loss": self.reference}
        if self.bit_exact is not None:
            d["bit_exact"] = self.bit_exact
        return d


@dataclass(frozen=True)
class Fidelity:
    """Whether the replay computes the captured step (see `nanbisect.replay.fidelity`)."""

    code_changed: list[str]          # user source files that differ from the capture's
    environment_changed: list[str]   # versions/settings that differ, e.g. "torch 2.4 at ..."
    same_setup: bool                 # replayed on the capture device at the capture dtype
    bit_exact: bool | None           # the loss equals the captured one (None: not decidable)
    code_missing: list[str] = field(default_factory=list)   # recorded files not found now

    @property
    def mismatch(self) -> bool:
        """The replay does not compute the captured step: same device and dtype, other loss."""
        return self.same_setup and self.bit_exact is False

    def causes(self) -> str:
        """The likely reasons for a mismatch, most likely first."""
        out = []
        if self.code_changed:
            out.append("the code changed since the capture: " + ", ".join(self.code_changed[:5])
                       + (f" and {len(self.code_changed) - 5} more"
                          if len(self.code_changed) > 5 else ""))
        if self.environment_changed:
            out.append("the environment changed: " + "; ".join(self.environment_changed))
        out += ["the training loop does something the Task does not describe (its own loss "
                "scaling, an extra forward, a hook, clipping or accumulation not given to Task)",
                "autocast (or another mode) entered outside loss_fn, so the replay runs at "
                "another precision",
                "state outside the model, optimizer and RNG (a global, a data-dependent "
                "schedule)"]
        return "; ".join(out)

    @property
    def faithful(self) -> bool | None:
        """True: same code and a bit-exact loss; False: other code or another loss; None: the
        loss cannot tell (not finite at capture, or replayed elsewhere) and the code is the same."""
        if self.code_changed or self.mismatch:
            return False
        return True if self.bit_exact and not self.code_missing else None

    def to_json(self) -> dict:
        return {"faithful": self.faithful, "code_changed": list(self.code_changed),
                "code_missing": list(self.code_missing),
                "environment_changed": list(self.environment_changed)}


@dataclass(frozen=True)
class RunFacts:
    """What every report of one run states, whatever the verdict."""

    bundle: str
    entry: str
    target: str
    reference: str
    observed: Any                    # the manifest's `observed` (one rank's, or rank -> its)
    losses: Losses
    fidelity: Fidelity | None = None


# ------------------------------------------------------------------------------------------
# the multi-rank launcher <-> rank worker protocol


@dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket: NaN/inf counts going into the collective and coming out."""

    bucket: int
    params: list[str]
    in_nan: int
    in_inf: int
    out_nan: int
    out_inf: int

    @property
    def in_bad(self) -> bool:
        return bool(self.in_nan or self.in_inf)

    @property
    def out_bad(self) -> bool:
        return bool(self.out_nan or self.out_inf)


@dataclass(frozen=True)
class RankSummary:
    """What one rank's first pass saw; every rank gets every rank's, to decide the same plan."""

    rank: int
    phase: str | None
    loss: float | str | None
    kind: str | None
    buckets: list[Bucket] = field(default_factory=list)
    input_nonfinite: list[BadValue] = field(default_factory=list)

    @property
    def reduce_in_bad(self) -> bool:
        return any(b.in_bad for b in self.buckets)

    @property
    def reduce_out_bad(self) -> bool:
        return any(b.out_bad for b in self.buckets)


@dataclass(frozen=True)
class RankRoot:
    """What one rank's op recording traced its failure to."""

    op: str
    op_index: int
    module: str
    module_call: int | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    collective: bool              # the root is a collective's output: the rank received it


@dataclass(frozen=True)
class Plan:
    """The decision every rank takes alike: which phase to bisect on which rank."""

    phase: str | None             # input | forward | backward | grad-reduce | optimizer | None
    rank: int | None
    through_collective: bool = False   # every failing rank traced it to a collective


@dataclass(frozen=True)
class RankReference:
    """One rank's step on the reference (multi-rank ``--reference``): how it ended, and where
    this rank's target step first parted from it (None: within tolerance, or no comparison)."""

    phase: str | None             # the reference's own failing phase (None: finite)
    loss: float | str | None
    divergence: str | None = None  # "loss", "grad:NAME", "param:NAME"
    max_rel: float | str | None = None


@dataclass(frozen=True)
class HistoryEntry:
    """One step of a bundle's history (``Guard(history=N)``; report.json ``history``): what is
    not known is None and left out of the JSON.

    >>> HistoryEntry(12, loss=float("nan"), skipped=False).to_json()
    {'step': 12, 'loss': 'nan', 'skipped': False}
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    skipped: bool | None = None

    def to_json(self) -> dict:
        out: dict = {"step": self.step}
        for k in ("loss", "grad_norm", "lr"):
            if getattr(self, k) is not None:
                out[k] = json_number(getattr(self, k))
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out


@dataclass(frozen=True)
class Finding:
    """What a bundle's history points out (report.json ``history_findings``): its ``kind``
    (``lr-jump``, ``loss-jump``, ``grad-norm-jump``, ``param-extreme``, ``moment-extreme``), the
    numbers that earn it and a sentence for people."""

    kind: str
    text: str
    step: int | None = None
    parameter: str | None = None
    state: str | None = None          # an optimizer state's name (moment-extreme)
    value: float | None = None
    baseline: float | None = None
    ratio: float | None = None
    z: float | None = None            # robust z score (the jumps)
    since_step: int | None = None     # param-extreme: above x2 of its baseline since then

    KEYS = {"lr-jump": ("kind", "step", "value", "baseline", "ratio", "text"),
            "loss-jump": ("kind", "step", "value", "baseline", "ratio", "z", "text"),
            "grad-norm-jump": ("kind", "step", "value", "baseline", "ratio", "z", "text"),
            "param-extreme": ("kind", "parameter", "value", "baseline", "ratio", "since_step",
                              "text"),
            "moment-extreme": ("kind", "parameter", "state", "value", "baseline", "ratio",
                               "text")}

    def to_json(self) -> dict:
        keys = self.KEYS.get(self.kind) or [f.name for f in fields(self)
                                            if getattr(self, f.name) is not None]
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class StepRow:
    """One step of a ``--steps`` window, replayed on both sides."""

    step: int
    target_loss: float | str | None
    reference_loss: float | str | None
    original_loss: float | str | None     # the guarded run's, from the bundle's history
    max_rel_diff: float | None
    parted: bool
    why: str | None = None                # what parted: "param:<name>", "target failed", ...

    def to_json(self) -> dict:
        return {"step": self.step, "target_loss": self.target_loss,
                "reference_loss": self.reference_loss, "original_loss": self.original_loss,
                "max_rel_diff": self.max_rel_diff, "parted": self.parted,
                **({"why": self.why} if self.why else {})}


@dataclass(frozen=True)
class StepsWindow:
    """report.json ``steps`` (``run --steps K``): the replayed window and where it parts.

    >>> StepsWindow([StepRow(7, 1.0, 1.0, 1.0, 0.0, False)], None, 0, None).to_json()["replayed"]
    [{'step': 7, 'target_loss': 1.0, 'reference_loss': 1.0, 'original_loss': 1.0, \
'max_rel_diff': 0.0, 'parted': False}]
    """

    replayed: list[StepRow]
    first_divergent_step: int | None
    advanced: int                  # steps replayed on the target alone before the window
    # the target's pre-state of the failing step against the recorded one: bit_exact,
    # max_rel_diff, parameters, first_step_off_history (and stopped_at when it never got there)
    reached_recorded: dict[str, Any] | None
    failing_prestate_max_rel_diff: float | None = None   # how far the failing step's pre-state
                                                         # had drifted from the reference's

    def to_json(self) -> dict:
        return {"replayed": [r.to_json() for r in self.replayed],
                "first_divergent_step": self.first_divergent_step,
                "advanced": self.advanced, "reached_recorded": self.reached_recorded,
                "failing_prestate_max_rel_diff": self.failing_prestate_max_rel_diff}


@dataclass(frozen=True)
class ReplicaDiff:
    """A tensor the data-parallel replicas of a multi-rank bundle hold differently (report.json
    ``replicas_out_of_sync``, from the top manifest's ``replicas.out_of_sync``).

    >>> ReplicaDiff.from_json({"tensor": "model:w", "ranks": [[0], [1]], "max_abs_diff": 0.5})
    ReplicaDiff(tensor='model:w', ranks=[[0], [1]], max_abs_diff=0.5, missing=[])
    """

    tensor: str                       # "model:fc.weight"
    ranks: list[list[int]]            # ranks grouped by identical bytes, the first group first
    max_abs_diff: float | str | None  # between the first copy and the others; None: not measured
    missing: list[int] = field(default_factory=list)   # ranks that lack the tensor

    @staticmethod
    def from_json(d: dict) -> "ReplicaDiff":
        return ReplicaDiff(d["tensor"], [list(g) for g in d["ranks"]], d.get("max_abs_diff"),
                           list(d.get("missing") or []))

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "ranks": self.ranks,
                **({"missing": self.missing} if self.missing else {}),
                "max_abs_diff": self.max_abs_diff}


@dataclass(frozen=True)
class Subset:
    """What a replay of some ranks alone (``--ranks``, collectives served as recorded) could and
    could not decide (report.json ``subset``).

    >>> Subset([1], 4).to_json()
    {'replayed': [1], 'world_size': 4, 'decided': True, 'next_ranks': [], 'why': None}
    """

    replayed: list[int]
    world_size: int
    decided: bool = True          # False: the job's answer needs ranks not replayed
    next_ranks: list[int] = field(default_factory=list)   # the ranks to replay next
    why: str | None = None        # why it is not decided

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RankResult:
    """What one rank worker hands the launcher (as JSON in ``PARTIAL/rank{r}.json``)."""

    rank: int
    plan: Plan | None = None
    summary: RankSummary | None = None
    root: RankRoot | None = None
    module_stats: dict[str, Stats | None] | None = None   # the culprit's module call here
    culprit: Culprit | None = None                       # on the culprit rank
    context: list[ContextRow] = field(default_factory=list)
    inf_origin: OpRef | None = None
    repro: str | None = None                             # path of the repro it wrote
    error: str | None = None                             # one line: why this rank failed
    reference: RankReference | None = None               # with --reference
    op_check: OpCheck | None = None                      # the culprit op on the reference
    classification: str | None = None                    # the culprit rank's, from its evidence
    classification_notes: list[str] = field(default_factory=list)   # why, when the evidence
                                                                     # needs words
    received_from: list[int] | None = None   # replayed alone: ranks that fed it the failure
    recorded_input_bad: bool = False   # alone: its own input to that collective held NaN/inf
                                       # at capture (and is finite in this replay)
    served_inputs_differ: list[int] = field(default_factory=list)   # tape entries whose input
                                                                    # was not the capture's

    def to_json(self) -> dict:
        d = asdict(self)
        d["op_check"] = self.op_check.to_json() if self.op_check is not None else None
        return d

    @staticmethod
    def from_json(d: dict) -> "RankResult":
        def opt(cls, v):
            return None if v is None else cls(**v)

        s = d.get("summary")
        summary = None if s is None else RankSummary(
            **{**s, "buckets": [Bucket(**b) for b in s.get("buckets", [])],
               "input_nonfinite": [BadValue(**b) for b in s.get("input_nonfinite", [])]})
        stats = d.get("module_stats")
        return RankResult(
            rank=d["rank"], plan=opt(Plan, d.get("plan")), summary=summary,
            root=opt(RankRoot, d.get("root")),
            module_stats=None if stats is None else {k: opt(Stats, v) for k, v in stats.items()},
            culprit=opt(Culprit, d.get("culprit")),
            context=[ContextRow(**c) for c in d.get("context", [])],
            inf_origin=opt(OpRef, d.get("inf_origin")), repro=d.get("repro"),
            error=d.get("error"), reference=opt(RankReference, d.get("reference")),
            op_check=(OpCheck.from_json(d["op_check"]) if d.get("op_check") is not None
                      else None),
            classification=d.get("classification"),
            classification_notes=list(d.get("classification_notes") or []),
            received_from=d.get("received_from"),
            recorded_input_bad=bool(d.get("recorded_input_bad", False)),
            served_inputs_differ=d.get("served_inputs_differ", []))

    def row(self) -> dict:
        """This rank's row in report.json's ``ranks``."""
        s = self.summary
        return {"rank": self.rank, "phase": s.phase if s else None,
                "loss": s.loss if s else None,
                "reduction_in_bad": s.reduce_in_bad if s else None,
                "reduction_out_bad": s.reduce_out_bad if s else None,
                "buckets": [asdict(b) for b in s.buckets] if s else [],
                "module_stats": ({k: asdict(v) if v is not None else None
                                  for k, v in self.module_stats.items()}
                                 if self.module_stats is not None else None),
                "root": asdict(self.root) if self.root is not None else None,
                **({"reference": asdict(self.reference)} if self.reference is not None else {})}
