"""The result of a run: `Report`, its JSON form (``nanbisect.report/1``), markdown and terminal text.

Guarantees: the JSON carries every field of the user contract (``culprit`` is null unless the
verdict is ``culprit``); the report directory is written atomically (built beside its final place,
then renamed). Exit codes: 0 clean, 1 culprit or input-nonfinite, 3 not reproduced.
"""
from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .bisect import Culprit, TraceRow
from .replay import BadValue

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
            "notes": self.notes, "repro": self.repro,
        }


def _fmt_stats(s) -> str:
    if s is None:
        return "-"
    return f"{s.nan:>6} | {s.posinf + s.neginf:>6} | {s.absmax:.3g}"


def headline(r: Report) -> str:
    """One line a person reads first."""
    if r.verdict == "culprit" and r.culprit:
        c = r.culprit
        where = f"'{c.module or '<outside any submodule>'}'"
        if c.module_call is not None:
            where += f" (call {c.module_call})"
        if c.parameter:
            where += f", parameter {c.parameter}"
        return f"{r.kind or 'non-finite'} born in {c.phase} at module {where}"
    if r.verdict == "input-nonfinite":
        b = r.input_nonfinite[0]
        return (f"non-finite values before the step ran: {b.where} '{b.name}' "
                f"(nan={b.nan}, +inf={b.posinf}, -inf={b.neginf})")
    if r.verdict == "not-reproduced":
        return "the recorded failure did not reproduce on replay (transient or hardware?)"
    return "the step replays clean: no non-finite loss, gradient or parameter"


def to_markdown(r: Report) -> str:
    lines = [f"# nanbisect report: {r.verdict}", "", f"**{headline(r)}**", "",
             f"- bundle: `{r.bundle}`", f"- entry: `{r.entry}`",
             f"- target: `{r.target}`, reference: `{r.reference}`",
             f"- classification: {r.classification or '-'}", f"- first bad phase: {r.phase or '-'}"]
    rp = r.replay
    lines.append(f"- loss: original {rp.get('original_loss')}, target {rp.get('target_loss')}, "
                 f"reference {rp.get('reference_loss')}")
    if r.culprit and r.verdict == "culprit":
        c = r.culprit
        lines += ["", "## Culprit", "", "| field | value |", "|---|---|"]
        for k, v in asdict(c).items():
            lines.append(f"| {k} | `{v}` |")
    if r.input_nonfinite:
        lines += ["", "## Non-finite values at step start", "",
                  "| where | name | nan | +inf | -inf |", "|---|---|---|---|---|"]
        lines += [f"| {b.where} | `{b.name}` | {b.nan} | {b.posinf} | {b.neginf} |"
                  for b in r.input_nonfinite[:20]]
    if r.backtrace:
        side = "inputs" if r.phase == "forward" else "grad arriving"
        out = "output" if r.phase == "forward" else "grad leaving"
        lines += ["", f"## Module calls around the culprit ({r.phase} order)", "",
                  f"| # | module | call | role | {side} nan | {side} inf | {side} absmax | "
                  f"{out} nan | {out} inf | {out} absmax |", "|---|---|---|---|---|---|---|---|---|---|"]
        for t in r.backtrace:
            mark = "**" if t.role == "culprit" else ""
            lines.append(f"| {t.order} | {mark}`{t.module or '<root>'}`{mark} | {t.call} | "
                         f"{t.role} | {_fmt_stats(t.before)} | {_fmt_stats(t.after)} |")
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r.notes]
    return "\n".join(lines) + "\n"


def terminal(r: Report, out: Path) -> str:
    """The short summary the CLI prints."""
    lines = [f"nanbisect: {r.verdict} - {headline(r)}"]
    if r.culprit and r.verdict == "culprit":
        c = r.culprit
        lines.append(f"  phase={c.phase} module={c.module or '<root>'} call={c.module_call} "
                     f"dtypes={c.input_dtypes} shapes={c.input_shapes}")
        if c.source:
            lines.append(f"  source: {c.source}")
    lines.append(f"  classification: {r.classification or '-'}; report: {out / 'report.md'}")
    return "\n".join(lines)


def write_report(r: Report, out: Path) -> Path:
    """Write report.json and report.md into ``out`` atomically (replacing an older report)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "report.json").write_text(json.dumps(r.to_json(), indent=1, allow_nan=False))
        (tmp / "report.md").write_text(to_markdown(r))
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
