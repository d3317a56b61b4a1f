"""report.html: a self-contained page (no script, no external file): the culprit card first,
target and reference side by side, the ops before the culprit and the module calls around it as
tables, a plot of per-module-call NaN/inf counts and abs-max along the step's execution order
(the culprit marked), the step history, the notes; report.md and report.json folded at the end.

The plot is an inline SVG drawn here: bars are the NaN (red) and inf (orange) counts of each
module call's output (forward) or outgoing gradient (backward), on a log scale; the line is the
largest finite magnitude, on its own log scale; a dashed line marks the culprit call.
"""
from __future__ import annotations

import html
import json
import math
from importlib.resources import files

from nanbisect.records import TimelineRow, module_label
from nanbisect.report.model import Report
from nanbisect.report.text import (fidelity_text, headline, remedy_detail, rows_text, to_markdown,
                                   verified)

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 960, 320, 60, 60, 30, 60


def _log(x: float) -> float:
    return math.log10(1.0 + max(x, 0.0))


def _ticks(top: float) -> list[tuple[float, str]]:
    """Tick positions (in `_log` units, 0..top) and labels for a log axis: 0, 1, 10, 100, ..."""
    out = [(0.0, "0")]
    k = 0
    while _log(10 ** k) <= top * 1.0001 and k < 40:
        v = 10 ** k
        out.append((_log(v), f"{v:g}" if k < 5 else f"1e{k}"))
        k += 1 if top < 6 else max(1, int(top) // 5)
    return out


def plot_svg(timeline: list[TimelineRow], culprit: tuple[str, int | None] | None,
             phase: str) -> str:
    """SVG of ``timeline`` rows in execution order, the ``culprit`` call marked, both y axes
    with tick values, the x axis with call positions."""
    if not timeline:
        return "<p>(no module calls recorded)</p>"
    n = len(timeline)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    bw = pw / n
    top_count = max(max(_log(r.nan), _log(r.inf)) for r in timeline) or 1.0
    top_mag = max(_log(r.absmax) for r in timeline) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11" role="img" '
           f'aria-label="NaN and inf counts per module call">',
           f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{PAD_L}" y1="{PAD_T + ph}" x2="{PAD_L + pw}" y2="{PAD_T + ph}" '
           'stroke="#333"/>',
           f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{PAD_T + ph}" stroke="#333"/>',
           f'<line x1="{PAD_L + pw}" y1="{PAD_T}" x2="{PAD_L + pw}" y2="{PAD_T + ph}" '
           'stroke="#2ca02c"/>']
    for v, label in _ticks(top_count):          # left axis: counts
        y = PAD_T + ph - ph * v / top_count
        out.append(f'<line class="tick" x1="{PAD_L - 4}" y1="{y:.1f}" x2="{PAD_L}" y2="{y:.1f}" '
                   f'stroke="#333"/><text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{label}</text>')
    for v, label in _ticks(top_mag):            # right axis: abs-max
        y = PAD_T + ph - ph * v / top_mag
        out.append(f'<line class="tick" x1="{PAD_L + pw}" y1="{y:.1f}" x2="{PAD_L + pw + 4}" '
                   f'y2="{y:.1f}" stroke="#2ca02c"/><text x="{PAD_L + pw + 6}" y="{y + 4:.1f}" '
                   f'fill="#2ca02c">{label}</text>')
    step = max(1, round(n / 10))
    for i in list(range(0, n, step)) + ([n - 1] if (n - 1) % step else []):   # x axis: calls
        x = PAD_L + (i + 0.5) * bw
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{PAD_T + ph}" x2="{x:.1f}" '
                   f'y2="{PAD_T + ph + 4}" stroke="#333"/><text x="{x:.1f}" '
                   f'y="{PAD_T + ph + 16}" text-anchor="middle">{i + 1}</text>')
    points = []
    marker = None
    for i, r in enumerate(timeline):
        x = PAD_L + i * bw
        for j, (key, colour) in enumerate((("nan", "#d62728"), ("inf", "#ff7f0e"))):
            h = ph * _log(getattr(r, key)) / top_count
            if h > 0:
                out.append(f'<rect x="{x + j * bw / 2:.1f}" y="{PAD_T + ph - h:.1f}" '
                           f'width="{max(bw / 2 - 0.5, 0.5):.1f}" height="{h:.1f}" '
                           f'fill="{colour}"><title>{html.escape(module_label(r.module))} '
                           f'call {r.call}: {key} {getattr(r, key)}</title></rect>')
        points.append(f"{x + bw / 2:.1f},{PAD_T + ph - ph * _log(r.absmax) / top_mag:.1f}")
        if culprit and (r.module, r.call) == culprit and marker is None:
            marker = (x + bw / 2, r)
    out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#2ca02c" '
               'stroke-width="1.5"/>')
    if marker is not None:
        cx, r = marker
        out.append(f'<line x1="{cx:.1f}" y1="{PAD_T - 4}" x2="{cx:.1f}" y2="{PAD_T + ph}" '
                   'stroke="#1f77b4" stroke-width="2" stroke-dasharray="5,3"/>')
        label = f"culprit: {module_label(r.module)} (call {r.call})"
        width = 6.2 * len(label) + 8           # ~11px sans-serif; the box keeps it on the page
        lx = min(max(cx - width / 2, 2), W - width - 2)
        out.append(f'<rect x="{lx:.1f}" y="2" width="{width:.1f}" height="16" rx="3" '
                   'fill="white" stroke="#1f77b4"/>'
                   f'<text x="{lx + width / 2:.1f}" y="14" text-anchor="middle" fill="#1f77b4" '
                   f'font-weight="bold">{html.escape(label)}</text>')
    side = "output" if phase == "forward" else "outgoing gradient"
    out += [f'<text x="{PAD_L + pw / 2}" y="{H - 25}" text-anchor="middle">module calls in '
            f'{html.escape(phase)} execution order (1 .. {n})</text>',
            f'<text x="14" y="{PAD_T + ph / 2}" transform="rotate(-90 14 {PAD_T + ph / 2})" '
            f'text-anchor="middle">NaN / inf count of the {side} (log)</text>',
            f'<text x="{W - 10}" y="{PAD_T + ph / 2}" transform="rotate(90 {W - 10} '
            f'{PAD_T + ph / 2})" text-anchor="middle" fill="#2ca02c">largest finite |value| '
            '(log)</text>',
            f'<rect x="{PAD_L}" y="{H - 18}" width="10" height="10" fill="#d62728"/>'
            f'<text x="{PAD_L + 14}" y="{H - 9}">NaN</text>',
            f'<rect x="{PAD_L + 60}" y="{H - 18}" width="10" height="10" fill="#ff7f0e"/>'
            f'<text x="{PAD_L + 74}" y="{H - 9}">inf</text>',
            f'<line x1="{PAD_L + 115}" y1="{H - 13}" x2="{PAD_L + 135}" y2="{H - 13}" '
            f'stroke="#2ca02c" stroke-width="2"/><text x="{PAD_L + 139}" y="{H - 9}">abs-max'
            '</text>', "</svg>"]
    return "\n".join(out)


def history_svg(r: Report) -> str:
    """SVG of the history's loss (blue) and gradient norm (grey), each on its own log scale,
    the steps the findings name marked, the step bisected by --steps marked too."""
    hs = [e for e in (r.history or [])]
    if len(hs) < 2:
        return ""
    w, h, pl, pr, pt, pb = 960, 200, 60, 20, 20, 40
    pw, ph = w - pl - pr, h - pt - pb
    steps = [e.step for e in hs]
    x = lambda s: pl + pw * (s - steps[0]) / max(steps[-1] - steps[0], 1)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pl}" y1="{pt + ph}" x2="{pl + pw}" y2="{pt + ph}" stroke="#333"/>']
    for key, colour in (("loss", "#1f77b4"), ("grad_norm", "#7f7f7f")):
        vals = [(e.step, math.log10(abs(getattr(e, key)) + 1e-30)) for e in hs
                if getattr(e, key) is not None and math.isfinite(getattr(e, key))]
        if len(vals) < 2:
            continue
        lo, hi = min(v for _, v in vals), max(v for _, v in vals)
        y = lambda v: pt + ph - ph * (v - lo) / ((hi - lo) or 1.0)  # noqa: E731
        pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in vals)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5">'
                   f'<title>{key} (log)</title></polyline>')
    marks = [(f.step, f.kind) for f in r.history_findings if f.step is not None]
    if r.steps and r.steps.first_divergent_step is not None:
        marks.append((r.steps.first_divergent_step, "first divergent step"))
    for i, (s, what) in enumerate(marks):
        if steps[0] <= s <= steps[-1]:
            out.append(f'<line x1="{x(s):.1f}" y1="{pt}" x2="{x(s):.1f}" y2="{pt + ph}" '
                       'stroke="#d62728" stroke-dasharray="4,3"/>'
                       f'<text x="{x(s) + 3:.1f}" y="{pt + 10 + 12 * i}" fill="#d62728">'
                       f'{html.escape(f"{what} ({s})")}</text>')
    out += [f'<text x="{pl}" y="{h - 10}">step {steps[0]}</text>',
            f'<text x="{pl + pw}" y="{h - 10}" text-anchor="end">step {steps[-1]}</text>',
            f'<text x="{pl + pw / 2}" y="{h - 10}" text-anchor="middle"><tspan fill="#1f77b4">'
            'loss</tspan> and <tspan fill="#7f7f7f">gradient norm</tspan> (each log scale)'
            '</text>', "</svg>"]
    return "\n".join(out)


# what each classification means, in one line (the README's table says it at length)
MEANING = {
    "device": "the culprit op, given the same inputs at the same dtype, is wrong on the target "
              "and right on the reference",
    "numerics": "the failure follows from the arithmetic at this dtype: it happens on a "
                "correct device too",
    "data": "the batch or a loaded state already held the non-finite value",
    "communication": "every rank's input to a collective was finite and its output was not",
    "transient": "the failure did not come back on a faithful replay of the captured step",
    "code-changed": "the code differs from the capture's: the edit is the first suspect",
    "replay-mismatch": "the replay does not compute the captured step; no verdict about the "
                       "device follows",
    "compiler": "the failure comes back with the model compiled and not eagerly, from the same "
                "state, batch and RNG: the compiler's transformation made it",
    "unknown": "not enough evidence (no reference, an op the reference cannot run, or another "
               "device or machine than the capture's)",
}


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, ".4g")
    return str(v)


def to_html(r: Report) -> str:
    """The page for ``r``: the culprit card first, target and reference side by side, the ops
    and module calls as tables, the plots, the notes; self-contained (no script, no network),
    readable in a narrow window and printable (`templates/report.html.j2`)."""
    from jinja2 import Environment, StrictUndefined

    c = r.culprit if r.verdict == "culprit" else None
    if c is not None and r.subset and not r.subset.decided and r.subset.next_ranks:
        c = None     # a rank that was not replayed: the headline says which to replay next
    culprit = (c.module, c.module_call) if c else None
    env = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True,
                      lstrip_blocks=True, keep_trailing_newline=True)
    env.globals.update(num=_num, dash=lambda v: "-" if v is None else v,
                       label=module_label, remedy_detail=remedy_detail)
    template = env.from_string(
        (files("nanbisect.report") / "templates" / "report.html.j2").read_text())
    res = r.repro_result
    said = ("not run" if res is None or not res.ran else
            "reproduced" if res.reproduced else "did not reproduce")
    forward = r.phase == "forward"
    return template.render(
        r=r, c=c, headline=headline(r), meaning=MEANING.get(r.classification or ""),
        multi=bool(r.ranks), has_reference=r.facts.reference not in (None, "none"),
        losses=r.facts.losses, repro_said=f"{said} on {r.facts.target}",
        fidelity=fidelity_text(r),
        side_in="inputs" if forward else "grad arriving",
        side_out="output" if forward else "grad leaving",
        timeline_svg=plot_svg(r.timeline, culprit, r.phase or ""),
        # NaN/inf counts along the step: only where some call had any (not for a divergence)
        show_timeline=any(t.nan or t.inf for t in r.timeline),
        history_svg=history_svg(r), markdown=to_markdown(r),
        verified=verified(r), tried=[m for m in r.remedies if m.outcome in ("still-failing",
                                                                           "error")],
        rows_ids=next((rows_text(m) for m in r.remedies if m.kind == "samples"
                       and rows_text(m)), ""),
        report_json=json.dumps(r.to_json(), indent=1))
