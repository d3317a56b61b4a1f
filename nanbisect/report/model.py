"""The result of a run: `Report`, made of the records the stages produced, and its JSON form
(``nanbisect.report/1``).

Guarantees: the JSON carries every field of the user contract (``culprit`` is null unless the
verdict is ``culprit``); ``to_json`` may hold non-finite floats, which the one record encoder
(`nanbisect.util.recordjson`) writes as "nan", "inf", "-inf". Exit codes: 0 clean, 1 culprit or
input-nonfinite, 3 not reproduced (4, an internal error, has no report: `nanbisect.cli`).
Renderers read the `Report` itself, never its JSON: text in `report.prose`, the page in
`report.page`; the directory is written by `report.write`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from nanbisect.records import (BadValue, Classification, CompilerFinding, ContextRow, Culprit,
                               Divergence, Fidelity, Finding, HistoryEntry, Losses, ModuleRepro,
                               OpCheck, OpRecording, OpRef, RankResult, ReplicaDiff, Remedy,
                               ReproResult, RunFacts, StageError, StepsWindow, Subset,
                               TimelineRow, TraceRow, Verdict)

SCHEMA = "nanbisect.report/1"
EXIT = {"clean": 0, "culprit": 1, "input-nonfinite": 1, "not-reproduced": 3}


@dataclass(frozen=True)
class Report:
    """What a run found.

    >>> from nanbisect.records import Losses
    >>> facts = RunFacts("b", "t.py:task", "cpu", "none", None, Losses(1.5, 1.5))
    >>> Report("clean", None, None, None, None, facts).to_json()["replay"]["target_loss"]
    1.5
    """

    verdict: Verdict                      # a plain string is made one (and checked)
    classification: Classification | None
    # the culprit's phase, where it was born (a culprit report: the culprit's own, whatever a
    # caller gave; `failed_phase`: where the failure showed); else the first phase with a
    # non-finite value
    phase: str | None
    kind: str | None             # "nan" | "inf" | "mismatch"
    culprit: Culprit | None
    facts: RunFacts
    input_nonfinite: list[BadValue] = field(default_factory=list)
    backtrace: list[TraceRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repro: str | None = None
    repro_result: ReproResult | None = None   # what running repro.py once said
    inf_origin: OpRef | None = None           # where the inf the culprit consumed was born
    context: list[ContextRow] = field(default_factory=list)  # recorded ops up to the culprit
    divergence: Divergence | None = None      # where target and reference first disagree
    op_check: OpCheck | None = None           # the culprit op judged alone on the reference
    uncomparable: list[OpCheck] = field(default_factory=list)  # ops with no reference
    ranks: list[RankResult] = field(default_factory=list)  # multi-rank: what each rank saw
    timeline: list[TimelineRow] = field(default_factory=list)  # every module call, in order
    module_repro: ModuleRepro | None = None   # fallback repro of the culprit's module call
    # a culprit that surfaced in a later phase: the repro of the op where it surfaced
    surfaced_repro: ModuleRepro | None = None
    op_recording: OpRecording | None = None   # what the op-recording pass covered
    # multi-rank: tensors the data-parallel replicas hold differently
    replicas_out_of_sync: list[ReplicaDiff] = field(default_factory=list)
    subset: Subset | None = None              # --ranks: what a replay of some ranks decided
    # the bundle's last steps (Guard(history=N)), oldest first, and what they point out
    history: list[HistoryEntry] | None = None
    history_findings: list[Finding] = field(default_factory=list)
    steps: StepsWindow | None = None          # --steps K: the window and where it parts
    # seconds per pass of this run, in order ({"read": .., "build": .., "module-pass": .., ...}:
    # the keys of nanbisect.pipeline.STAGES plus "read"); up to the report's writing, which is
    # not in it. Single-process runs only.
    timings: dict[str, float] | None = None
    # changes tried by replaying the culprit's step, and what came of each (nanbisect.remedies)
    remedies: list[Remedy] = field(default_factory=list)
    # a compiled capture whose failure comes back compiled and not eagerly: where torch's
    # compiler bisector says the compiled step parts from the eager one (nanbisect.compiler)
    compiler: CompilerFinding | None = None
    # stages after the verdict that raised: what they would have added is missing, the rest is
    # written, the exit code stays the verdict's (`nanbisect.records.after_verdict`)
    errors: list[StageError] = field(default_factory=list)

    def with_replicas(self, replicas: dict | None) -> "Report":
        """This report plus the finding of a bundle whose data-parallel replicas differ (its top
        manifest's ``replicas``, as `nanbisect.bundle.format` checked it): a note and
        ``replicas_out_of_sync``; unchanged when they are in sync.

        >>> from nanbisect.records import Losses
        >>> r = Report("clean", None, None, None, None,
        ...            RunFacts("b", "t.py:task", "cpu", "none", None, Losses(1.5, 1.5)))
        >>> r.with_replicas({"out_of_sync": [{"tensor": "model:fc.weight", "ranks": [[0], [1]],
        ...                  "max_abs_diff": 0.25}], "out_of_sync_count": 1}).notes[0][:38]
        'replicas out of sync on rank 1 (vs 0):'
        """
        rows = [ReplicaDiff.from_json(r) for r in (replicas or {}).get("out_of_sync") or []]
        if not rows:
            return self
        count = (replicas or {}).get("out_of_sync_count") or len(rows)
        off = sorted({r for row in rows for ranks in row.ranks[1:] for r in ranks}
                     | {r for row in rows for r in row.missing})
        base = sorted({r for row in rows for r in (row.ranks[0] if row.ranks else [])}
                      - set(off))

        from nanbisect.bundle.describe import out_of_sync_text
        from nanbisect.util.text import ranges, ranks_text

        def one(row: ReplicaDiff) -> str:      # (bundle content: bounded, as inspect shows it)
            return out_of_sync_text(row.to_json())

        note = (f"replicas out of sync on {ranks_text(off)} (vs {ranges(base)}): the "
                "data-parallel replicas "
                "differ (a bug of the job: unsynchronised init, a rank skipping a step, "
                f"non-deterministic update): {count} tensor(s): "
                + ", ".join(map(one, rows[:3])) + (f" and {count - 3} more" if count > 3 else ""))
        return replace(self, notes=[*self.notes, note], replicas_out_of_sync=rows)

    @staticmethod
    def from_json(d: dict) -> "Report":
        """The report of a report.json (as `to_json` wrote it, read back with `json.load`):
        ``to_json(from_json(d))`` equals ``d`` (its "nan"/"inf" strings too, through the one
        record encoder). What the JSON leaves out is what `Fidelity.from_json` and
        `RankResult.from_row` say; a key an older report lacks reads as its default.

        >>> from nanbisect.records import Losses
        >>> r = Report("clean", None, None, None, None,
        ...            RunFacts("b", "t.py:task", "cpu", "none", None, Losses(1.5, 1.5)))
        >>> Report.from_json(r.to_json()) == r
        True
        """
        return Report(d["verdict"], d.get("classification"), d.get("phase"), d.get("kind"),
                      _opt(Culprit.from_json, d.get("culprit")), _facts(d), **_parts(d))

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        if self.classification is not None:
            object.__setattr__(self, "classification", Classification(self.classification))
        c = self.culprit
        if self.verdict == Verdict("culprit") and c is not None and c.phase \
                and c.phase != self.phase:
            # born in one phase and seen in a later one: the report's phase is the birth's,
            # `culprit.surfaced` keeps where it showed (`failed_phase`)
            object.__setattr__(self, "phase", c.phase)

    @property
    def failed_phase(self) -> str | None:
        """The phase whose failure the run traced (its module calls, its timeline): where the
        culprit's value surfaced when that is later than its birth, else `phase`."""
        c = self.culprit
        return c.surfaced.phase if c is not None and c.surfaced is not None else self.phase

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def to_json(self) -> dict:
        f = self.facts
        opt = lambda r: r.to_json() if r is not None else None  # noqa: E731
        return {
            "schema": SCHEMA, "verdict": self.verdict, "classification": self.classification,
            "phase": self.phase, "kind": self.kind,
            "culprit": opt(self.culprit) if self.verdict == "culprit" else None,
            "replay": {**f.losses.to_json(),
                       **(f.fidelity.to_json() if f.fidelity is not None else {})},
            "bundle": f.bundle, "entry": f.entry,
            "target": f.target, "reference": f.reference, "observed": f.observed,
            "input_nonfinite": [asdict(b) for b in self.input_nonfinite],
            "backtrace": [asdict(r) for r in self.backtrace],
            "notes": list(self.notes), "repro": self.repro,
            "repro_result": opt(self.repro_result), "inf_origin": opt(self.inf_origin),
            "context": [c.to_json() for c in self.context],
            "divergence": opt(self.divergence), "op_check": opt(self.op_check),
            "uncomparable": [u.to_json() for u in self.uncomparable],
            "ranks": [r.row() for r in self.ranks],
            "timeline": [asdict(t) for t in self.timeline],
            "module_repro": opt(self.module_repro), "op_recording": opt(self.op_recording),
            "replicas_out_of_sync": [r.to_json() for r in self.replicas_out_of_sync],
            **({"subset": self.subset.to_json()} if self.subset is not None else {}),
            **({"surfaced_repro": self.surfaced_repro.to_json()}
               if self.surfaced_repro is not None else {}),
            **({"history": [e.to_json() for e in self.history],
                "history_findings": [f.to_json() for f in self.history_findings]}
               if self.history is not None else {}),
            **({"steps": self.steps.to_json()} if self.steps is not None else {}),
            **({"timings": dict(self.timings)} if self.timings is not None else {}),
            "remedies": [r.to_json() for r in self.remedies],
            **({"compiler": self.compiler.to_json()} if self.compiler is not None else {}),
            "errors": [e.to_json() for e in self.errors],
        }


def _opt(decode, v):
    return None if v is None else decode(v)


def _facts(d: dict) -> RunFacts:
    replay = d.get("replay") or {}
    return RunFacts(d.get("bundle"), d.get("entry"), d.get("target"), d.get("reference"),
                    d.get("observed"), Losses.from_json(replay), Fidelity.from_json(replay))


def _lists(d: dict) -> dict:
    """`Report`'s list fields from their report.json keys."""
    def each(key, decode):
        return [decode(x) for x in d.get(key) or []]
    return {"input_nonfinite": each("input_nonfinite", lambda b: BadValue(**b)),
            "backtrace": each("backtrace", TraceRow.from_json),
            "notes": list(d.get("notes") or []), "context": each("context", ContextRow.from_json),
            "uncomparable": each("uncomparable", OpCheck.from_json),
            "ranks": each("ranks", RankResult.from_row),
            "timeline": each("timeline", TimelineRow.from_json),
            "replicas_out_of_sync": each("replicas_out_of_sync", ReplicaDiff.from_json),
            "history_findings": each("history_findings", Finding.from_json),
            "remedies": each("remedies", Remedy.from_json),
            "errors": each("errors", StageError.from_json)}


def _parts(d: dict) -> dict:
    """`Report`'s fields after ``facts`` from their report.json keys."""
    history = d.get("history")
    return {**_lists(d), "repro": d.get("repro"),
            "repro_result": _opt(ReproResult.from_json, d.get("repro_result")),
            "inf_origin": _opt(OpRef.from_json, d.get("inf_origin")),
            "divergence": _opt(Divergence.from_json, d.get("divergence")),
            "op_check": _opt(OpCheck.from_json, d.get("op_check")),
            "module_repro": _opt(ModuleRepro.from_json, d.get("module_repro")),
            "surfaced_repro": _opt(ModuleRepro.from_json, d.get("surfaced_repro")),
            "op_recording": _opt(OpRecording.from_json, d.get("op_recording")),
            "subset": _opt(Subset.from_json, d.get("subset")),
            "history": None if history is None else [HistoryEntry.from_json(e) for e in history],
            "steps": _opt(StepsWindow.from_json, d.get("steps")),
            "timings": None if d.get("timings") is None else dict(d["timings"]),
            "compiler": _opt(CompilerFinding.from_json, d.get("compiler"))}
