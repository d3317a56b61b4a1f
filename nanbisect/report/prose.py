"""The report as text people read: the headline, report.md and the CLI's terminal summary.

Guarantees: an op that ran outside any module call in forward or backward (the Task's
``loss_fn``: JSON ``module`` "" or null and ``module_call`` null) is named ``loss_fn`` wherever a
module is printed (`module_cell`, `at_module`), never an empty cell or "call None"; a
classification of ``unknown`` from a run without a reference says so and gives the flag that
would decide it (`classification_text`).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from nanbisect.records import Remedy, Stats, module_label
from nanbisect.report.model import Report
from nanbisect.util.spec import NONE
from nanbisect.util.fingerprint import DRIFT_NOTE
from nanbisect.util.text import clip

MAX_NOTE = 2000    # characters of a note, an error or a line of the terminal summary: they
                   # may quote the bundle (its entry, paths, tensor names)


LOSS_FN = "loss_fn"      # how the reports name where an op outside any module call ran
LOSS_FN_WHAT = "the loss function, outside any module call"
# why ``unknown`` when nothing was replayed on a reference, and the flag that would decide it
NO_REFERENCE = ("no reference: give --reference cpu to tell a device fault from a numerics "
                "one")


def in_loss_fn(module: str | None, call: int | None, phase: str | None) -> bool:
    """Did an op run in the Task's ``loss_fn``: outside any module call (no module, no call) in
    forward or backward (an optimizer step's ops run outside module calls too: not these)."""
    return not module and call is None and phase in ("forward", "backward")


def module_cell(module: str | None, call: int | None, phase: str | None) -> str:
    """The module an op ran in, as a table cell or label prints it: ``loss_fn`` outside any
    module call, else the module's label (`module_label`).

    >>> [module_cell(*w) for w in (("", None, "backward"), ("", 0, "forward"), ("fc", 2, "x"))]
    ['loss_fn', '<root>', 'fc']
    """
    return LOSS_FN if in_loss_fn(module, call, phase) else module_label(module)


def at_module(module: str | None, call: int | None, phase: str | None, quote: str = "'",
              explain: bool = True) -> str:
    """Where an op ran, in a sentence: "module 'fc' (call 2)", or "loss_fn (the loss function,
    outside any module call)" (without ``explain``: "loss_fn"); never "call None".

    >>> at_module("blocks.0", 1, "forward"), at_module(None, None, "backward", "`")
    ("module 'blocks.0' (call 1)", 'loss_fn (the loss function, outside any module call)')
    """
    if in_loss_fn(module, call, phase):
        return f"{LOSS_FN} ({LOSS_FN_WHAT})" if explain else LOSS_FN
    return (f"module {quote}{module_label(module)}{quote}"
            + (f" (call {call})" if call is not None else ""))


def classification_text(r: Report) -> str:
    """The classification as report.md and the summary print it: ``unknown`` from a run with
    no reference says why and what decides it."""
    c = r.classification or "-"
    if c == "unknown" and r.facts.reference in (None, NONE):
        return f"{c} ({NO_REFERENCE})"
    return c


def _fmt_stats(s: Stats | None) -> str:
    if s is None:
        return "-"
    return f"{s.nan:>6} | {s.posinf + s.neginf:>6} | {_num(s.absmax, '.3g')}"


def headline(r: Report) -> str:
    """One line a person reads first."""
    if r.verdict == "culprit" and r.culprit:
        return _culprit_headline(r)
    if r.verdict == "input-nonfinite":
        if not r.input_nonfinite:
            return "non-finite values before the step ran (see the ranks' notes)"
        b = r.input_nonfinite[0]
        more = f" and {len(r.input_nonfinite) - 1} more" if len(r.input_nonfinite) > 1 else ""
        return (f"non-finite values before the step ran: {b.where} '{b.name}' "
                f"(nan={b.nan}, +inf={b.posinf}, -inf={b.neginf}){more}")
    if r.verdict == "not-reproduced":
        f = r.facts.fidelity
        if r.classification == "code-changed" and f is not None:
            return (f"the recorded failure did not reproduce with today's code "
                    f"({len(f.code_changed)} file(s) changed since the capture)")
        if r.classification == "replay-mismatch":
            return ("the recorded failure did not reproduce, but the replay does not compute the "
                    "captured step (its loss differs)")
        if r.classification == "transient":
            return ("the recorded failure did not reproduce on a faithful replay: transient "
                    "(hardware, race)?")
        return "the recorded failure did not reproduce on replay"
    return "the step replays clean: no non-finite loss, gradient or parameter"


def _culprit_headline(r: Report) -> str:
    """`headline` of a culprit: undecided by a replay of some ranks, a divergence from the
    reference, a compiled-only failure, or where it was born (and surfaced)."""
    if r.subset and not r.subset.decided:
        c, nxt = r.culprit, r.subset.next_ranks
        if nxt:
            return (f"{r.kind or 'non-finite'} came from rank {c.rank} ({c.phase}), which was "
                    f"not replayed: replay with --ranks {nxt[0]} to find the op")
        return (f"{r.kind or 'non-finite'} came out of {c.op or 'the gradient reduction'} on rank "
                f"{c.rank} from finite inputs: replay all ranks to tell whether the collective "
                "is at fault")
    if r.kind == "mismatch":
        c = r.culprit
        at = (f" at step {c.step}" if c.step is not None and r.steps else "")
        return (f"target diverges from the reference first in {c.op or 'a module call'} in "
                f"{c.phase} {_at(c)}{at}")
    if r.compiler is not None:
        c, k = r.culprit, r.compiler
        at = (f" in {c.op}" if c.op else "") + (
            f" {_at(c)}" if c.op and (c.module or in_loss_fn(c.module, c.module_call, c.phase))
            else "")
        made = (f"made by {k.backend}; {k.config_change} fixes it" if k.config_change else
                f"made by {k.backend}" + (f" ({k.subsystem})" if k.subsystem else ""))
        return f"{r.kind or 'non-finite'} only when compiled: born{at} in {c.phase}, {made}"
    c = r.culprit
    where = _at(c) + (f", parameter {c.parameter}" if c.parameter else "")
    op = f" in {c.op}" if c.op else ""
    if c.surfaced is not None:      # born in one phase, visible in a later one
        born = _born_kind(r)
        kind = r.kind or "non-finite"
        return (f"{born} born{op} in {c.phase} {where}, surfaced"
                f"{f' as {kind}' if kind != born else ''} in {c.surfaced.phase} at "
                f"{c.surfaced.op}")
    return f"{r.kind or 'non-finite'} born{op} in {c.phase} {where}"


def _at(c) -> str:
    """Where a culprit ran, after its phase: "at module 'fc' (call 2)", "in loss_fn (...)"."""
    if c.phase == "grad-reduce" and not c.module and c.module_call is None:
        return "in the gradient reduction's code"    # a comm hook's op, DDP's collective
    where = at_module(c.module, c.module_call, c.phase)
    return ("in " if in_loss_fn(c.module, c.module_call, c.phase) else "at ") + where


def fidelity_text(r: Report) -> str | None:
    """How close the replay came to the capture (``replay.fidelity``) and what differs from the
    capture machine, in one line; None when the report has nothing to say about it."""
    f = r.facts.fidelity
    if f is None or (f.tier is None and not f.hardware_changed):
        return None
    parts = [f.tier or "not comparable (no finite recorded loss)"]
    if f.tier not in (None, "bit-exact") and f.loss_rel_diff is not None:
        parts.append(f"loss off by a relative {f.loss_rel_diff:.3g}" + (
            f" (step tolerance {f.tolerance:g} for {f.tolerance_dtype})"
            if f.tolerance is not None else ""))
    if f.hardware_changed:
        parts.append("other hardware: " + "; ".join(f.hardware_changed))
    elif not f.hardware_known:
        parts.append("hardware unknown (the bundle records no fingerprint)")
    else:
        parts.append("same hardware as the capture")
    return ", ".join(parts)


def _born_kind(r: Report) -> str:
    """What a culprit that surfaced elsewhere made: its first context row is the culprit."""
    row = next((c for c in r.context if c.culprit), None)
    return "nan" if row is None or row.out_nan else "inf"


def node_made(node, quote: str = "") -> str:
    """What made an autograd node, in words: " (created by aten.log.default at model.py:12)"."""
    parts = [f"by {quote}{node.forward_op}{quote}" if node.forward_op else "",
             f"at {quote}{node.forward_source}{quote}" if node.forward_source else ""]
    said = " ".join(p for p in parts if p)
    return f" (created {said})" if said else ""


def _surfaced_line(r: Report) -> str | None:
    c = r.culprit
    if c is None or c.surfaced is None:
        return None
    s = c.surfaced
    return (f"Surfaced in {s.phase} at `{s.op}` (op #{s.op_index}, "
            f"{at_module(s.module, s.module_call, s.phase, '`', False)}); the culprit above is "
            "where it was born.")


def to_markdown(r: Report) -> str:
    """report.md: the verdict and culprit first, then the evidence, each as a section."""
    lines = [f"# nanbisect report: {r.verdict}", "", f"**{headline(r)}**", ""]
    first = verified(r)
    if first:
        lines += [f"**Verified:** {v}." for v in first] + [""]
    lines += [f"- bundle: `{r.facts.bundle}`", f"- entry: `{clip(r.facts.entry, 300)}`",
             f"- target: `{r.facts.target}`, reference: `{r.facts.reference}`",
             f"- classification: {classification_text(r)}",
             f"- first bad phase: {r.phase or '-'}"]
    rp = r.facts.losses
    lines.append(f"- loss: original {_num(rp.original)}, target {_num(rp.target)}, reference "
                 f"{_num(rp.reference)}")
    fidelity = fidelity_text(r)
    if fidelity:
        lines.append(f"- replay: {fidelity}")
    if r.culprit and r.verdict == "culprit" and not (r.subset and not r.subset.decided
                                                     and r.subset.next_ranks):
        c = r.culprit
        lines += ["", "## Culprit", "", "| field | value |", "|---|---|"]
        for k, v in asdict(c).items():
            if k in ("surfaced", "node", "likely_cause"):
                continue            # sentences of their own, below the table
            if k == "module" and in_loss_fn(c.module, c.module_call, c.phase):
                lines.append(f"| module | `{LOSS_FN}` ({LOSS_FN_WHAT}) |")
                continue
            lines.append(f"| {k} | `{v}` |" if v is not None else f"| {k} | - |")
        if c.node is not None:
            lines.append(f"| node | `{c.node.name}`" + node_made(c.node, "`") + " |")
        if c.likely_cause:
            lines += ["", f"**Likely cause:** {c.likely_cause}."]
        surfaced = _surfaced_line(r)
        if surfaced:
            lines += ["", surfaced]
    if r.inf_origin:
        o = r.inf_origin
        whose = ("The inputs of the op where it surfaced" if r.culprit and r.culprit.surfaced
                 else "The culprit's inputs")
        lines += ["", f"{whose} carried inf, born from finite values in `{o.op}` "
                  f"(op #{o.op_index}, {o.phase}, "
                  f"{at_module(o.module, o.module_call, o.phase, '`', False)})."]
    lines += _errors_md(r) + _compiler_md(r) + _remedies_md(r)
    lines += _ranks_md(r) + _checks_md(r) + _repro_md(r) + _backtrace_md(r)
    lines += _steps_md(r) + _history_md(r)
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {clip(n, MAX_NOTE)}" for n in r.notes]
    return "\n".join(lines) + "\n"


def _errors_md(r: Report) -> list[str]:
    """report.json ``errors``: the stages after the verdict that failed."""
    if not r.errors:
        return []
    return (["", "## Errors", "", "Stages after the verdict that failed; the verdict stands, "
             "what they would have added is missing from this report:", ""]
            + [f"- {e.stage}: `{clip(e.message, MAX_NOTE)}`" for e in r.errors])


def _compiler_md(r: Report) -> list[str]:
    """report.json ``compiler``: where the compiled step parts from the eager one."""
    if r.compiler is None:
        return []
    return (["", "## Compiler (torch's CompilerBisector)", "", "| field | value |", "|---|---|"]
            + [f"| {k} | `{_cell(v)}` |" if v is not None else f"| {k} | - |"
               for k, v in r.compiler.to_json().items()])


def _cell(v) -> str:
    """A value in a markdown table's code cell: one line, bounded, no '|' or '`' to end it."""
    return clip(v, MAX_NOTE).replace("|", "\\|").replace("`", "'")


def rows_text(rem: Remedy) -> str:
    """How the rows of a samples remedy are identified: the batch's own fields, a digest."""
    parts = []
    for row in rem.detail.get("identify") or []:
        fields = ", ".join(f"{k} {v!r}" for k, v in (row.get("fields") or {}).items())
        parts.append(f"row {row['row']}: " + (f"{fields}, " if fields else "")
                     + f"sha256 {row['sha256']}")
    return "; ".join(parts)


def verified(r: Report) -> list[str]:
    """The remedies whose replay made the step finite, as sentences (the report's first news
    after the headline)."""
    out = []
    for rem in r.remedies:
        if rem.finite:
            ids = rows_text(rem) if rem.kind == "samples" else ""
            meaning = rem.detail.get("meaning")
            minimal = rem.detail.get("minimal")
            out.append(rem.sentence() + (f": {meaning}" if meaning else "")
                       + (f", a minimal set: {minimal}" if minimal else "")
                       + (f" ({ids})" if ids else ""))
    return out


def remedy_detail(rem: Remedy) -> str:
    """One cell of what a remedy's detail says."""
    d = rem.detail
    bits = []
    if rem.kind == "samples" and d.get("found_by"):
        bits.append(f"rows found by {d['found_by']}"
                    + (f" ({len(d.get('tried') or [])} replays)" if d.get("tried") else ""))
        if d.get("why_not_traced"):
            bits.append(f"not traced: {d['why_not_traced']}")
    for key in ("meaning", "minimal", "note", "reason", "error"):
        if d.get(key):
            bits.append(str(d[key]))
    if d.get("error_where"):
        bits.append(f"raised at {d['error_where']}")
    if d.get("phase") and rem.outcome == "still-failing":
        bits.append(f"still fails in {d['phase']}")
    # one line whatever a remedy's record holds (an exception's message has newlines)
    return clip(" ".join("; ".join(bits).split()), MAX_NOTE)


def _remedies_md(r: Report) -> list[str]:
    """Every remedy tried by replaying the step, and what came of it."""
    if not r.remedies:
        return []
    lines = ["", "## Remedies, each tried by replaying the step", "",
             "| kind | the step ... | outcome | loss | detail |", "|---|---|---|---|---|"]
    for rem in r.remedies:
        mark = "**" if rem.finite else ""
        lines.append(f"| {_cell(rem.kind)} | {_cell(rem.change)} | {mark}{rem.outcome}{mark} | "
                     f"{_num(rem.loss)} | {_cell(remedy_detail(rem)) or '-'} |")
    ids = [rows_text(rem) for rem in r.remedies if rem.kind == "samples" and rows_text(rem)]
    if ids:
        lines += ["", "The rows, as the data pipeline knows them: " + ids[0] + "."]
    return lines


def _ranks_md(r: Report) -> list[str]:
    """The ranks table of a multi-rank run."""
    lines: list[str] = []
    if r.ranks:
        lines += ["", "## Ranks", "", "| rank | first bad phase | loss | into reduction bad | "
                  "out of reduction bad | culprit module call on this rank (in nan / out nan) | "
                  "failure traced to (op, module call) | how it came to hold it |",
                  "|---|---|---|---|---|---|---|---|"]
        for k in r.ranks:
            ms, s, root = k.module_stats or {}, k.summary, k.root
            cell = "-"
            if ms:
                io = (ms.get("inputs"), ms.get("output"))
                cell = " / ".join(str(x.nan) if x else "-" for x in io)
            via = k.path.via if k.path is not None else None
            phase = via.phase if via is not None and via.op == (root and root.op) else (
                s.phase if s else None)
            at = ("the gradient reduction" if phase == "grad-reduce" and root and not root.module
                  else at_module(root.module, root.module_call, phase, '`') if root else "")
            traced = (f"`{root.op}` in {at}"
                      + (" (a collective: received)" if root.collective else " (computed here)")
                      if root else "-")
            lines.append(f"| {k.rank} | {(s.phase if s else None) or '-'} | "
                         f"{_num(s.loss if s else None)} | "
                         f"{_num(s.reduce_in_bad if s else None)} | "
                         f"{_num(s.reduce_out_bad if s else None)} | {cell} | {traced} | "
                         f"{_path_cell(k.path)} |")
    return lines


def _path_cell(p) -> str:
    """How a rank came to hold the failure (`nanbisect.records.RankPath`), in a table cell."""
    if p is None or p.how is None:
        return "-"
    v = p.via
    if v is None:
        return {"received": "received", "computed": "computed here"}.get(p.how, p.how)
    at = f"`{v.op}` ({v.where().removeprefix(v.op).lstrip()})"
    if p.how == "received":
        src = f" from rank {', '.join(map(str, p.from_ranks))}" if p.from_ranks else ""
        return f"received through {at}{src}"
    if p.how == "born-in-collective":
        return f"born in {at} from finite inputs on every rank"
    return f"computed here by {at}"


def _checks_md(r: Report) -> list[str]:
    """The culprit op in isolation on the reference, ops it could not compare, and the ops up
    to the culprit."""
    lines: list[str] = []
    if r.op_check:
        lines += ["", f"## The culprit op in isolation on `{r.facts.reference}`", "",
                  f"Same inputs on both sides; status **{r.op_check.status}** "
                  f"({r.op_check.how or '-'} on the reference)."]
        for c in r.op_check.comparisons:
            if not c.ok:
                lines += ["", "```", c.message(), "```"]
    if r.uncomparable:
        lines += ["", "Ops that could not be compared (no reference kernel, no registered "
                  "`nanbisect.reference_impl`): " + ", ".join(f"`{u.op}`" for u in r.uncomparable)]
    if r.context:
        lines += ["", "## Ops up to the culprit", "", "| op # | op | module | call | output "
                  "has nan | output has inf | output absmax |", "|---|---|---|---|---|---|---|"]
        for c in r.context:
            mark = "**" if c.culprit else ""
            lines.append(f"| {c.op_index} | {mark}`{c.op}`{mark} | "
                         f"`{module_cell(c.module, c.module_call, c.phase)}` | "
                         f"{_num(c.module_call)} | {'yes' if c.out_nan else '-'} | "
                         f"{'yes' if c.out_inf else '-'} | "
                         f"{_num(c.out_absmax, '.3g')} |")
    return lines


def _repro_md(r: Report) -> list[str]:
    """The repro and what its run said; the non-finite values a step started with."""
    lines: list[str] = []
    if r.repro:
        res = r.repro_result
        said = ("not run" if res is None or not res.ran else
                "reproduced" if res.reproduced else "did not reproduce")
        lines += ["", "## Repro", "", f"`python {r.repro} [--device DEV]` ({said} on "
                  f"`{r.facts.target}`): needs only torch and safetensors."]
        if res is not None and res.output:
            lines += ["", "```", res.output, "```"]
    if r.input_nonfinite:
        lines += ["", "## Non-finite values at step start", "",
                  "| where | name | nan | +inf | -inf |", "|---|---|---|---|---|"]
        lines += [f"| {b.where} | `{b.name}` | {b.nan} | {b.posinf} | {b.neginf} |"
                  for b in r.input_nonfinite[:20]]
        if len(r.input_nonfinite) > 20:
            lines.append(f"| ... | {len(r.input_nonfinite) - 20} more (all in report.json) "
                         "| | | |")
    return lines


def _backtrace_md(r: Report) -> list[str]:
    """The module calls around the culprit."""
    lines: list[str] = []
    if r.backtrace:
        side = "inputs" if r.failed_phase == "forward" else "grad arriving"
        out = "output" if r.failed_phase == "forward" else "grad leaving"
        lines += ["", f"## Module calls around the culprit ({r.failed_phase} order)", "",
                  f"| # | module | call | role | {side} nan | {side} inf | {side} absmax | "
                  f"{out} nan | {out} inf | {out} absmax |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for t in r.backtrace:
            mark = "**" if t.role == "culprit" else ""
            lines.append(f"| {t.order} | {mark}`{module_label(t.module)}`{mark} | {t.call} | "
                         f"{t.role} | {_fmt_stats(t.before)} | {_fmt_stats(t.after)} |")
    return lines


def _num(v, spec: str = ".4g") -> str:
    """A number in a table: ``-`` for none; one that is not finite as ``nan``, ``inf``,
    ``-inf`` (as report.json writes it); a string (report.json's own ``"nan"``) as it is.

    >>> [_num(v) for v in (None, 0.123456, float("-inf"), "nan", 3)]
    ['-', '0.1235', '-inf', 'nan', '3']
    """
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def _steps_md(r: Report) -> list[str]:
    if not r.steps:
        return []
    s = r.steps
    first = s.first_divergent_step
    lines = ["", "## Steps replayed on target and reference", "",
             f"First step whose state parts from the reference: **{_num(first)}**"
             + (f" ({s.advanced} earlier step(s) replayed on the target alone to reach the "
                "window)" if s.advanced else ""), "",
             "| step | original loss | target loss | reference loss | max rel diff | parts |",
             "|---|---|---|---|---|---|"]
    for row in s.replayed:
        mark = "**" if row.step == first else ""
        lines.append(f"| {mark}{row.step}{mark} | {_num(row.original_loss)} | "
                     f"{_num(row.target_loss)} | {_num(row.reference_loss)} | "
                     f"{_num(row.max_rel_diff)} | {row.why or '-'} |")
    reached = s.reached_recorded
    if reached:
        lines += ["", "The target's replay reached the recorded pre-state of the failing step "
                  + ("bit for bit." if reached.get("bit_exact") else
                     f"only to a relative {_num(reached.get('max_rel_diff'))} (see the notes).")]
    return lines


def _history_md(r: Report) -> list[str]:
    if not r.history:
        return []
    lines = ["", f"## History (last {min(len(r.history), 12)} of {len(r.history)} steps)", ""]
    lines += [f"- {f.text}" for f in r.history_findings] or ["- nothing stands out"]
    lines += ["", "| step | loss | grad norm | lr | skipped |", "|---|---|---|---|---|"]
    for e in r.history[-12:]:
        lines.append(f"| {e.step} | {_num(e.loss)} | {_num(e.grad_norm)} | "
                     f"{_num(e.lr)} | {'yes' if e.skipped else '-'} |")
    return lines


# how the note of a replay that imported the bundle's stored copy of the code begins
# (`nanbisect.replay.replayer.code_choice`)
STORED_CODE_RAN = "the bundle's copy of the code ran"


def terminal(r: Report, out: Path) -> str:
    """The short summary the CLI prints. When the replay ran the bundle's stored copy of the
    code (chosen by default because the files here differ, or by ``--code bundle``), its second
    line says so and why (``code: the bundle's copy of the code ran: ... --code local runs
    them``): a fix made here is not what ran."""
    lines = [f"nanbisect: {r.verdict} - {headline(r)}"]
    lines += [f"  code: {n}" for n in r.notes if n.startswith(STORED_CODE_RAN)][:1]
    lines += [f"  code: {n}" for n in r.notes if n.startswith(DRIFT_NOTE)][:1]
    lines += [f"  verified: {v}" for v in verified(r)]
    tried = [rem for rem in r.remedies if rem.outcome in ("still-failing", "error")]
    lines += [f"  tried: {rem.sentence()}" for rem in tried]
    skipped = [rem for rem in r.remedies if rem.outcome == "skipped"]
    if skipped:
        lines.append(f"  not tried: {len(skipped)} remedy(ies) ("
                     + "; ".join(sorted({str(rem.detail.get('reason')) for rem in skipped}))[:300]
                     + ")")
    if r.culprit and r.verdict == "culprit" and not (r.subset and not r.subset.decided
                                                     and r.subset.next_ranks):
        c = r.culprit
        lines.append(f"  phase={c.phase} module={module_cell(c.module, c.module_call, c.phase)} "
                     f"call={_num(c.module_call)} dtypes={c.input_dtypes} shapes={c.input_shapes}")
        if c.op:
            lines.append(f"  op={c.op} op_index={c.op_index}")
        if c.source:
            lines.append(f"  source: {c.source}")
        if c.node is not None:
            lines.append(f"  node: {c.node.name}{node_made(c.node)}")
        if c.likely_cause:
            lines.append(f"  likely cause: {c.likely_cause}")
        if c.surfaced is not None:
            sf = c.surfaced
            lines.append(f"  surfaced: {sf.op} in {sf.phase} (op #{sf.op_index}, "
                         f"{at_module(sf.module, sf.module_call, sf.phase, '', False)})")
        if r.inf_origin:
            o = r.inf_origin
            lines.append(f"  inf born in: {o.op} (op #{o.op_index}, "
                         f"{at_module(o.module, o.module_call, o.phase, '', False)})")
        if r.compiler is not None:
            k = r.compiler
            lines.append(f"  compiler: eager {k.eager}, compiled {k.compiled}; backend "
                         f"{k.backend}, subsystem {k.subsystem or '-'}"
                         + (f", {k.config_change}" if k.config_change else
                            f", bisect number {k.bisect_number}" if k.bisect_number is not None
                            else ""))
        if r.repro:
            lines.append(f"  repro: {out / r.repro}"
                         + (" (reproduced)" if r.repro_result and r.repro_result.reproduced
                            else ""))
    if r.replicas_out_of_sync:
        lines.append(f"  replicas out of sync: {len(r.replicas_out_of_sync)} tensor(s) differ "
                     "between data-parallel ranks, first "
                     f"{clip(r.replicas_out_of_sync[0].tensor, 120)} "
                     "(see the notes)")
    if r.steps:
        lines.append(f"  steps: {len(r.steps.replayed)} replayed, first divergent step "
                     f"{r.steps.first_divergent_step}")
    for f in r.history_findings[:3]:
        lines.append(f"  history: {f.text}")
    f = r.facts.fidelity
    if f is not None and (f.tier not in (None, "bit-exact") or f.hardware_changed):
        lines.append(f"  replay: {fidelity_text(r)}")
    lines += [f"  error in {e.stage}: {e.message} (the report is without it)" for e in r.errors]
    lines.append(f"  classification: {classification_text(r)}; report: {out / 'report.md'}")
    lines.append(f"  in a browser: {out / 'report.html'}")
    return "\n".join(clip(line, MAX_NOTE) for line in lines)


def rebuild_note(observed) -> str | None:
    """What the Guard did to bundle a step whose update failed (``observed.rebuild``), in one
    line; None when it did not rebuild."""
    rb = observed.get("rebuild") if isinstance(observed, dict) else None
    if not isinstance(rb, dict):
        return None
    step = observed.get("step")
    if rb.get("fidelity") == "unavailable":
        why = rb.get("why")
        return (f"the Guard found parameters non-finite at step {step}'s reading, after an "
                "update, but could not rebuild the step that made them"
                + (f" ({clip(why, 200)})" if why else "") + f": the bundle holds step {step} "
                "as it began, its parameters already non-finite")
    how = {"bit-exact": "bit-exact (every replayed loss and gradient norm as in training)",
           "within-tolerance": f"within tolerance (relative difference up to "
                               f"{rb.get('max_rel_diff')})",
           "mismatch": f"a mismatch (the steps replayed differ from training from step "
                       f"{rb.get('first_mismatch')}, relative difference "
                       f"{rb.get('max_rel_diff')}: the loop did something the Task does not "
                       "describe; this pre-state may not be the one that failed)"}
    return (f"the Guard found parameters non-finite at the reading after step {step}'s update "
            f"and rebuilt step {step}'s pre-state from the snapshot of step "
            f"{rb.get('from_step')} and {rb.get('steps')} step(s) replayed since: "
            f"{how.get(rb.get('fidelity'), '?')}; the replay tells whether the update made them "
            "or the loop did between steps")
