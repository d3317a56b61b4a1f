"""The result of a run: `Report` and its JSON form (``nanbisect.report/1``).

Guarantees: the JSON carries every field of the user contract (``culprit`` is null unless the
verdict is ``culprit``). Exit codes: 0 clean, 1 culprit or input-nonfinite, 3 not reproduced.
Text renderings are in `report.text`, the page in `report.page`, the directory in `report.write`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from nanbisect.locate.producers import Culprit, TraceRow
from nanbisect.replay.replayer import BadValue

SCHEMA = "nanbisect.report/1"
EXIT = {"clean": 0, "culprit": 1, "input-nonfinite": 1, "not-reproduced": 3}


@dataclass(frozen=True)
class Report:
    verdict: str                 # culprit | clean | not-reproduced | input-nonfinite
    classification: str | None   # device | numerics | data | transient | communication | unknown
    phase: str | None            # first phase with a non-finite value
    kind: str | None             # "nan" | "inf"
    culprit: Culprit | None
    replay: dict
    bundle: str
    entry: str
    target: str
    reference: str
    observed: dict | None = None
    input_nonfinite: list[BadValue] = field(default_factory=list)
    backtrace: list[TraceRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repro: str | None = None
    repro_result: dict | None = None   # what running repro.py once said
    inf_origin: dict | None = None     # where the inf the culprit consumed was born
    context: list[dict] = field(default_factory=list)  # recorded ops just before the culprit
    divergence: dict | None = None     # where target and reference first disagree (no NaN)
    op_check: dict | None = None       # the culprit op judged in isolation on the reference
    uncomparable: list[dict] = field(default_factory=list)  # ops with no reference to compare
    ranks: list[dict] = field(default_factory=list)  # multi-rank: what each rank saw
    timeline: list[dict] = field(default_factory=list)  # every module call, execution order
    module_repro: dict | None = None   # fallback repro of the culprit's module call, when used
    op_recording: dict | None = None   # what the op-recording pass covered (scope, op counts)

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]

    def to_json(self) -> dict:
        culprit = None
        if self.culprit is not None and self.verdict == "culprit":
            culprit = asdict(self.culprit)
        return {
            "schema": SCHEMA, "verdict": self.verdict, "classification": self.classification,
            "phase": self.phase, "kind": self.kind, "culprit": culprit, "replay": self.replay,
            "bundle": self.bundle, "entry": self.entry, "target": self.target,
            "reference": self.reference, "observed": self.observed,
            "input_nonfinite": [asdict(b) for b in self.input_nonfinite],
            "backtrace": [asdict(r) for r in self.backtrace],
            "notes": self.notes, "repro": self.repro, "repro_result": self.repro_result,
            "inf_origin": self.inf_origin, "context": self.context,
            "divergence": self.divergence, "op_check": self.op_check,
            "uncomparable": self.uncomparable, "ranks": self.ranks,
            "timeline": self.timeline, "module_repro": self.module_repro,
            "op_recording": self.op_recording,
        }
