"""report.html: a self-contained page (no script, no external file) with the report and a plot of
per-module-call NaN/inf counts and abs-max along the step's execution order, the culprit marked.

The plot is an inline SVG drawn here: bars are the NaN (red) and inf (orange) counts of each
module call's output (forward) or outgoing gradient (backward), on a log scale; the line is the
largest finite magnitude, on its own log scale; a dashed line marks the culprit call.
"""
from __future__ import annotations

import html
import json
import math

from nanbisect.records import TimelineRow
from nanbisect.report.model import Report
from nanbisect.report.text import headline, to_markdown

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 960, 320, 60, 60, 30, 60


def _log(x: float) -> float:
    return math.log10(1.0 + max(x, 0.0))


def plot_svg(timeline: list[TimelineRow], culprit: tuple[str, int | None] | None,
             phase: str) -> str:
    """SVG of ``timeline`` rows in execution order, the ``culprit`` call marked."""
    if not timeline:
        return "<p>(no module calls recorded)</p>"
    n = len(timeline)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    bw = pw / n
    top_count = max(max(_log(r.nan), _log(r.inf)) for r in timeline) or 1.0
    top_mag = max(_log(r.absmax) for r in timeline) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{PAD_L}" y1="{PAD_T + ph}" x2="{PAD_L + pw}" y2="{PAD_T + ph}" '
           'stroke="#333"/>',
           f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{PAD_T + ph}" stroke="#333"/>']
    points = []
    for i, r in enumerate(timeline):
        x = PAD_L + i * bw
        for j, (key, colour) in enumerate((("nan", "#d62728"), ("inf", "#ff7f0e"))):
            h = ph * _log(getattr(r, key)) / top_count
            if h > 0:
                out.append(f'<rect x="{x + j * bw / 2:.1f}" y="{PAD_T + ph - h:.1f}" '
                           f'width="{max(bw / 2 - 0.5, 0.5):.1f}" height="{h:.1f}" '
                           f'fill="{colour}"><title>{html.escape(r.module or "<root>")} '
                           f'call {r.call}: {key} {getattr(r, key)}</title></rect>')
        points.append(f"{x + bw / 2:.1f},{PAD_T + ph - ph * _log(r.absmax) / top_mag:.1f}")
        if culprit and (r.module, r.call) == culprit:
            cx = x + bw / 2
            out.append(f'<line x1="{cx:.1f}" y1="{PAD_T - 5}" x2="{cx:.1f}" y2="{PAD_T + ph}" '
                       'stroke="#1f77b4" stroke-width="2" stroke-dasharray="5,3"/>')
            label = html.escape(f"culprit: {r.module or '<root>'} (call {r.call})")
            anchor = "end" if cx > W / 2 else "start"
            out.append(f'<text x="{cx + (-4 if anchor == "end" else 4):.1f}" y="{PAD_T + 8}" '
                       f'text-anchor="{anchor}" fill="#1f77b4" font-weight="bold">{label}</text>')
    out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#2ca02c" '
               'stroke-width="1.5"/>')
    side = "output" if phase == "forward" else "outgoing gradient"
    out += [f'<text x="{PAD_L + pw / 2}" y="{H - 25}" text-anchor="middle">module calls in '
            f'{html.escape(phase)} execution order (1 .. {n})</text>',
            f'<text x="15" y="{PAD_T + ph / 2}" transform="rotate(-90 15 {PAD_T + ph / 2})" '
            f'text-anchor="middle">NaN / inf count of the {side} (log)</text>',
            f'<text x="{W - 15}" y="{PAD_T + ph / 2}" transform="rotate(90 {W - 15} '
            f'{PAD_T + ph / 2})" text-anchor="middle" fill="#2ca02c">abs-max (log)</text>',
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
    steps = [e["step"] for e in hs]
    x = lambda s: pl + pw * (s - steps[0]) / max(steps[-1] - steps[0], 1)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">',
           f'<rect x="0" y="0" width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{pl}" y1="{pt + ph}" x2="{pl + pw}" y2="{pt + ph}" stroke="#333"/>']
    for key, colour in (("loss", "#1f77b4"), ("grad_norm", "#7f7f7f")):
        vals = [(e["step"], math.log10(abs(e[key]) + 1e-30)) for e in hs
                if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])]
        if len(vals) < 2:
            continue
        lo, hi = min(v for _, v in vals), max(v for _, v in vals)
        y = lambda v: pt + ph - ph * (v - lo) / ((hi - lo) or 1.0)  # noqa: E731
        pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in vals)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5">'
                   f'<title>{key} (log)</title></polyline>')
    marks = [(f["step"], f["kind"]) for f in r.history_findings if "step" in f]
    if r.steps and r.steps.get("first_divergent_step") is not None:
        marks.append((r.steps["first_divergent_step"], "first divergent step"))
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


def to_html(r: Report) -> str:
    """The page for ``r``: headline, the plot, report.md and report.json, self-contained."""
    c = r.culprit if r.verdict == "culprit" else None
    culprit = (c.module, c.module_call) if c else None
    svg = plot_svg(r.timeline, culprit, r.phase or "")
    head = html.escape(headline(r))
    markdown = to_markdown(r)
    report_json = r.to_json()
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>nanbisect: {html.escape(report_json['verdict'])}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}}
pre{{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}}
.verdict{{font-size:1.3em;font-weight:bold}}</style></head>
<body>
<h1>nanbisect report</h1>
<p class="verdict">{head}</p>
<h2>Module calls along the step</h2>
{svg}
{"<h2>The steps before</h2>" + history_svg(r) if history_svg(r) else ""}
<h2>Report</h2>
<pre>{html.escape(markdown)}</pre>
<h2>report.json</h2>
<pre>{html.escape(json.dumps(report_json, indent=1))}</pre>
</body></html>
"""
