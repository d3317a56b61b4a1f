"""The result of a run: `Report`, its JSON form (``nanbisect.report/1``), markdown and terminal text.

Guarantees: report.json, report.md and a self-contained report.html (`html`) are written
together; the JSON carries every field of the user contract (``culprit`` is null unless the
verdict is ``culprit``); the report directory is written atomically (built beside its final place,
then renamed). Exit codes: 0 clean, 1 culprit or input-nonfinite, 3 not reproduced.
"""
from __future__ import annotations

import json
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

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


def _fmt_stats(s) -> str:
    if s is None:
        return "-"
    return f"{s.nan:>6} | {s.posinf + s.neginf:>6} | {s.absmax:.3g}"


def headline(r: Report) -> str:
    """One line a person reads first."""
    if r.verdict == "culprit" and r.culprit and r.kind == "mismatch":
        c = r.culprit
        where = f"'{c.module or '<outside any submodule>'}'"
        if c.module_call is not None:
            where += f" (call {c.module_call})"
        return (f"target diverges from the reference first in {c.op or 'a module call'} in "
                f"{c.phase} at module {where}")
    if r.verdict == "culprit" and r.culprit:
        c = r.culprit
        where = f"'{c.module or '<outside any submodule>'}'"
        if c.module_call is not None:
            where += f" (call {c.module_call})"
        if c.parameter:
            where += f", parameter {c.parameter}"
        op = f" in {c.op}" if c.op else ""
        return f"{r.kind or 'non-finite'} born{op} in {c.phase} at module {where}"
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
    if r.inf_origin:
        o = r.inf_origin
        lines += ["", f"The culprit's inputs carried inf, born from finite values in `{o['op']}` "
                  f"(op #{o['op_index']}, {o['phase']}, module `{o['module']}` call "
                  f"{o['module_call']})."]
    if r.ranks:
        lines += ["", "## Ranks", "", "| rank | first bad phase | loss | into reduction bad | "
                  "out of reduction bad | culprit module call on this rank (in nan / out nan) | "
                  "failure traced to (op, module call) |",
                  "|---|---|---|---|---|---|---|"]
        for k in r.ranks:
            ms = k.get("module_stats") or {}
            cell = "-"
            if ms:
                io = (ms.get("inputs"), ms.get("output"))
                cell = " / ".join(str(x["nan"]) if x else "-" for x in io)
            root = k.get("root")
            traced = (f"`{root['op']}` in `{root['module'] or '<root>'}` call "
                      f"{root['module_call']}" + (" (a collective: received)"
                                                  if root["collective"] else " (computed here)")
                      if root else "-")
            lines.append(f"| {k['rank']} | {k['phase'] or '-'} | {k['loss']} | "
                         f"{k['reduction_in_bad']} | {k['reduction_out_bad']} | {cell} | "
                         f"{traced} |")
    if r.op_check:
        lines += ["", f"## The culprit op in isolation on `{r.reference}`", "",
                  f"Same inputs on both sides; status **{r.op_check['status']}** "
                  f"({r.op_check['how'] or '-'} on the reference)."]
        for c in r.op_check["comparisons"]:
            if not c["ok"]:
                lines += ["", "```", c["message"], "```"]
    if r.uncomparable:
        lines += ["", "Ops that could not be compared (no reference kernel, no registered "
                  "`nanbisect.reference_impl`): " + ", ".join(f"`{u['op']}`"
                                                              for u in r.uncomparable)]
    if r.context:
        lines += ["", "## Ops up to the culprit", "", "| op # | op | module | call | output "
                  "has nan | output has inf | output absmax |", "|---|---|---|---|---|---|---|"]
        for c in r.context:
            mark = "**" if c["culprit"] else ""
            lines.append(f"| {c['op_index']} | {mark}`{c['op']}`{mark} | `{c['module']}` | "
                         f"{c['module_call']} | {'yes' if c['out_nan'] else '-'} | "
                         f"{'yes' if c['out_inf'] else '-'} | "
                         f"{'-' if c['out_absmax'] is None else format(c['out_absmax'], '.3g')} |")
    if r.repro:
        res = r.repro_result or {}
        said = ("reproduced" if res.get("reproduced") else "did not reproduce"
                if res.get("ran") else "not run")
        lines += ["", "## Repro", "", f"`python {r.repro} [--device DEV]` ({said} on "
                  f"`{r.target}`): needs only torch and safetensors."]
        if res.get("output"):
            lines += ["", "```", res["output"], "```"]
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
        if c.op:
            lines.append(f"  op={c.op} op_index={c.op_index}")
        if c.source:
            lines.append(f"  source: {c.source}")
        if r.inf_origin:
            lines.append(f"  inf born in: {r.inf_origin['op']} (op #{r.inf_origin['op_index']}, "
                         f"module {r.inf_origin['module']})")
        if r.repro:
            res = r.repro_result or {}
            lines.append(f"  repro: {out / r.repro}"
                         + (" (reproduced)" if res.get("reproduced") else ""))
    lines.append(f"  classification: {r.classification or '-'}; report: {out / 'report.md'}")
    return "\n".join(lines)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden directory beside ``out`` that replaces it only if the block succeeds."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
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


def write_report(r: Report, out: Path) -> None:
    """Write report.json, report.md and report.html into ``out`` (a staged directory)."""
    from .html import to_html

    data, md = r.to_json(), to_markdown(r)
    (out / "report.json").write_text(json.dumps(data, indent=1, allow_nan=False))
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(to_html(data, md))
