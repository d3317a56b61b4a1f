"""The protocol between the multi-rank launcher and its rank workers (`Bucket`, `Crossing`,
`RankSummary`, `RankRoot`, `Plan`, `RankReference`, `RankResult`: JSON both ways), and what a
multi-rank report adds (`ReplicaDiff`, `Subset`, `RankPath`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nanbisect.records.compared import OpCheck
from nanbisect.records.culprit import ContextRow, Culprit, OpRef
from nanbisect.records.facts import StageError
from nanbisect.records.remedies import Remedy
from nanbisect.records.seen import BadValue, Stats
from nanbisect.records.codec import decode, encode


class _InOut:
    """What went into a reduction or collective and what came out, by their NaN/inf counts
    (``in_nan``, ``in_inf``, ``out_nan``, ``out_inf``)."""

    @property
    def in_bad(self) -> bool:
        return bool(self.in_nan or self.in_inf)

    @property
    def out_bad(self) -> bool:
        return bool(self.out_nan or self.out_inf)


@dataclass(frozen=True)
class Bucket(_InOut):
    """One DDP gradient bucket: NaN/inf counts going into the collective and coming out."""

    bucket: int
    params: list[str]
    in_nan: int
    in_inf: int
    out_nan: int
    out_inf: int

@dataclass(frozen=True)
class Crossing(_InOut):
    """One op on the way between ranks as one rank saw it in its first pass (`multirank.ledger`):
    a collective (any phase), or an op a DDP comm hook ran. Kept only when what it read or
    wrote held NaN/inf.

    >>> c = Crossing(3, "c10d.allreduce_.default", "forward", "mlp.fc2", 0, [0, 1], "float16",
    ...              "sum", 0, 0, 0, 4, 47264.0)
    >>> c.born, c.overflow
    (True, True)
    """

    nth: int | None               # its place among the step's collectives (None: a hook's op)
    op: str
    phase: str                    # forward | backward | grad-reduce | optimizer
    module: str                   # "" = outside any submodule (or not known in backward)
    module_call: int | None
    group: list[int] | None       # the global ranks of its process group (None: unknown;
                                  # a send or receive: [sender, receiver])
    dtype: str                    # of what it wrote
    reduce: str | None            # sum, avg, max, ... (None: no reduction)
    in_nan: int                   # NaN/inf in what this rank fed it
    in_inf: int
    out_nan: int                  # NaN/inf in what it wrote on this rank
    out_inf: int
    in_absmax: float | None = None   # the largest finite magnitude fed in (low-precision only)
    params: list[str] = field(default_factory=list)   # the parameters whose slice went bad
    bucket: int | None = None     # the DDP bucket whose comm hook ran it
    unit: str | None = None       # the FSDP unit whose reduction it is
    source: str | None = None     # "file.py:12 in func" of the code that issued it
    in_dtypes: list[str] = field(default_factory=list)         # of what it read (first 4)
    in_shapes: list[list[int]] = field(default_factory=list)
    seq: int | None = None        # its place among its process group's collectives (every
                                  # member of a group issues them in the same order)

    def same(self, other: "Crossing") -> bool:
        """Is ``other`` (another rank's) the same collective: the same op at the same place
        among the same group's collectives (without a known group: among all)?"""
        if self.p2p and other.p2p:     # a send and its receive: the n-th message src -> dst
            return self.group is not None and (self.group, self.seq) == (other.group, other.seq)
        if self.group is not None and other.group is not None:
            return (self.op, self.group, self.seq) == (other.op, other.group, other.seq)
        return (self.op, self.nth) == (other.op, other.nth)

    @property
    def born(self) -> bool:
        """Finite in, non-finite out: the value was born here (on this rank)."""
        return self.out_bad and not self.in_bad

    @property
    def collective(self) -> bool:
        return self.nth is not None

    @property
    def p2p(self) -> bool:
        """A send or a receive (its ``group`` is [sender, receiver], ``seq`` the message's
        place among that pair's)."""
        return self.op.startswith(("c10d.send", "c10d.recv"))

    @property
    def kind(self) -> str:
        return "nan" if self.out_nan else "inf"

    @property
    def overflow(self) -> bool:
        """An inf out of finite inputs in a dtype narrow enough for a sum to overflow it."""
        return self.born and not self.out_nan and self.dtype in LOW_RANGE

    def where(self) -> str:
        """"c10d.allreduce_.default in mlp.fc2 call 0, in forward" (op, module, phase)."""
        at = (f" in {self.module or 'the root module'} call {self.module_call}"
              if self.module_call is not None else
              f" in DDP bucket {self.bucket}'s comm hook" if self.bucket is not None else
              f" in FSDP unit {self.unit or '(the root)'}" if self.unit is not None else "")
        return f"{self.op}{at}, in {self.phase}"


# dtypes whose largest finite value a sum of ordinary values can pass (float16: 65504)
LOW_RANGE = ("float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


@dataclass(frozen=True)
class RankPath:
    """How one rank came to hold the failure (report.json ``ranks[i].how``): ``computed`` (an op
    of its own made it), ``received`` (a collective or hook handed it over: ``via``, fed by
    ``from_ranks``), ``born-in-collective`` (a collective made it from finite inputs on every
    rank of its group) or None (it stayed finite)."""

    how: str | None
    via: Crossing | None = None
    from_ranks: list[int] = field(default_factory=list)
    phase: str | None = None      # where it surfaced on this rank (its first pass's failing phase)

    def to_json(self) -> dict:
        """report.json ``ranks[i]``'s ``how``, ``via`` and ``from_ranks``."""
        v = self.via
        return {"how": self.how, "via": None if v is None else {
            "op": v.op, "phase": v.phase, "module": v.module, "module_call": v.module_call,
            "collective": v.collective, "dtype": v.dtype, "reduce": v.reduce,
            "params": v.params[:8], "bucket": v.bucket, "unit": v.unit, "source": v.source},
            "from_ranks": self.from_ranks}

    @staticmethod
    def from_json(d: dict) -> "RankPath":
        v = d.get("via")
        via = None if not isinstance(v, dict) else Crossing(
            0 if v.get("collective") else None, v.get("op", "?"), v.get("phase", "?"),
            v.get("module") or "", v.get("module_call"), None, v.get("dtype") or "",
            v.get("reduce"), 0, 0, 0, 0, params=list(v.get("params") or []),
            bucket=v.get("bucket"), unit=v.get("unit"), source=v.get("source"))
        return RankPath(d.get("how"), via, list(d.get("from_ranks") or []))


@dataclass(frozen=True)
class RankSummary:
    """What one rank's first pass saw; every rank gets every rank's, to decide the same plan."""

    rank: int
    phase: str | None
    loss: float | str | None
    kind: str | None
    buckets: list[Bucket] = field(default_factory=list)
    input_nonfinite: list[BadValue] = field(default_factory=list)
    crossings: list[Crossing] = field(default_factory=list)   # the first ones that held NaN/inf

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
    op_index: int | None          # None: found by the ledger of crossings, not the recording
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

    @staticmethod
    def from_json(d: dict) -> "Subset":
        return Subset(list(d["replayed"]), d["world_size"], d.get("decided", True),
                      list(d.get("next_ranks") or []), d.get("why"))

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
    remedies: list[Remedy] = field(default_factory=list)   # the culprit rank's (or why not)
    # the culprit rank's stages after its verdict that failed (repro, op check, remedies, ...)
    errors: list[StageError] = field(default_factory=list)
    path: RankPath | None = None     # how it came to hold the failure (the launcher's, from
                                     # every rank's crossings: `multirank.paths`)

    def to_json(self) -> dict:
        """The rank file's content (`nanbisect.records.codec`: derived from the fields)."""
        return encode(self)

    @staticmethod
    def from_json(d: dict) -> "RankResult":
        """The inverse of `to_json` (`nanbisect.records.codec`): the number fields the
        launcher computes on (statistics, abs-max) read back as floats from "nan"/"inf"."""
        return decode(RankResult, d)

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
                **(self.path.to_json() if self.path is not None else {}),
                **({"reference": asdict(self.reference)} if self.reference is not None else {})}

    @staticmethod
    def from_row(d: dict) -> "RankResult":
        """The inverse of `row` (report.json's ``ranks``): what the row holds, the rest unknown
        (a rank with no phase, loss or reduction flags had no summary)."""
        summary = None
        if any(d.get(k) is not None for k in ("phase", "loss", "reduction_in_bad")):
            summary = RankSummary(d["rank"], d.get("phase"), d.get("loss"), None,
                                  [Bucket(**b) for b in d.get("buckets") or []])
        stats = d.get("module_stats")
        return RankResult(
            rank=d["rank"], summary=summary,
            root=RankRoot(**d["root"]) if d.get("root") is not None else None,
            module_stats=(None if stats is None else {
                k: Stats.from_json(v) if v is not None else None for k, v in stats.items()}),
            reference=RankReference(**d["reference"]) if d.get("reference") else None,
            path=RankPath.from_json(d) if "how" in d else None)
