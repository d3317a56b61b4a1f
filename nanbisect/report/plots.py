"""The two plots of report.html, as inline SVG (no script, no external file): the module calls
along the step and the steps before the failing one.

Guarantees: every axis is labelled with real values (log axes with 1-2-5 or decade ticks, never
only their ends), tick labels closer than a line of text are dropped rather than overlapped,
module calls are numbered from 0 as the report's tables number them (the ``#`` column of
"Module calls around the culprit"), bars are centred on their ticks, and each plot comes in a
wide and a narrow drawing (`SIZES`) whose text is 12 px at its natural width; the page's CSS
shows the one that fits the window. Any number draws (`nanbisect.report.axes`): a value a log
axis has no place for is marked, never dropped silently and never an error: 0 as a hollow
circle at the axis bottom, a value that is not finite as a triangle at the top (labelled
``nan``, ``inf``, ``-inf``); a series that goes below 0 gets a linear axis;
no coordinate in the SVG is ever ``nan`` or ``inf``. A call whose bad values were passed through
(its inputs, or its incoming gradient, already held them: a propagator; or a call that holds the
culprit's call) is drawn hatched and pale, its tooltip says so, and a legend entry explains it;
only the culprit's call is drawn as where they were born. Which calls passed them through is
known from the roles of the report's backtrace (the calls around the culprit) and, for every
other call, from whether what came into it already held NaN/inf (`TimelineRow.came_in_bad`).
Not guaranteed: that very long module
names fit the culprit label at phone width (the label is shortened from the left).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass

from nanbisect.records import HistoryEntry, TimelineRow, module_label
from nanbisect.report.axes import count_axis, finite, nice_ceil, value_axis, word

FONT = 12                   # px, at the drawing's natural width
CHAR = 0.6 * FONT           # a sans-serif character's width, roughly (labels' boxes, shortening)


@dataclass(frozen=True)
class Size:
    """One drawing's geometry: its width and the paddings around the plot area."""

    name: str               # the CSS class that shows it: plot-wide / plot-narrow
    w: int
    pad_l: int
    pad_r: int
    y_ticks: int            # at most this many labels on a y axis
    x_gap: int              # at least this many px between two x labels


SIZES = (Size("wide", 960, 66, 66, 7, 48), Size("narrow", 360, 58, 56, 5, 36))


def _x_step(n: int, pw: float, gap: float) -> int:
    """Every how many positions an x label goes: a 1-2-5 number leaving ``gap`` px between."""
    need = n * gap / pw
    return 1 if need <= 1 else int(nice_ceil(need))


def _shorten(text: str, chars: int) -> str:
    return text if len(text) <= chars else "…" + text[-(chars - 1):]


def _open(size: Size, h: int, what: str, label: str) -> list[str]:
    return [f'<svg class="plot plot-{size.name}" data-plot="{what}" '
            f'xmlns="http://www.w3.org/2000/svg" width="{size.w}" height="{h}" '
            f'viewBox="0 0 {size.w} {h}" font-family="sans-serif" font-size="{FONT}" '
            f'role="img" aria-label="{html.escape(label)}">',
            f'<rect x="0" y="0" width="{size.w}" height="{h}" fill="white"/>']


def _y_labels(ticks, x: float, base: float, colour: str, side: str) -> list[str]:
    """Tick marks and labels of a y axis at ``x`` (``side`` left or right of the plot)."""
    out = []
    sign, anchor = (-1, "end") if side == "left" else (1, "start")
    for h, label in ticks:
        y = base - h
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{y:.1f}" x2="{x + 4 * sign:.1f}" '
                   f'y2="{y:.1f}" stroke="{colour}"/><text class="ylabel" '
                   f'x="{x + 6 * sign:.1f}" y="{y + FONT / 3:.1f}" text-anchor="{anchor}" '
                   f'fill="{colour}">{label}</text>')
    return out


@dataclass(frozen=True)
class _Frame:
    """A plot's box: its width and height, its left and top padding, the inner width and
    height, and the y of its x axis."""

    W: float
    H: float
    PL: float
    PT: float
    pw: float
    ph: float

    @property
    def base(self) -> float:
        return self.PT + self.ph


# a role of the backtrace (`nanbisect.records.TraceRow.role`) whose bad values were not born in
# the call -> how a bar's tooltip says it
PASSED = {"propagator": "passed through: its {side} already held them",
          "encloses culprit": "passed up from the culprit's call, which it holds"}


def plot_svg(timeline: list[TimelineRow], culprit: tuple[str, int | None] | None,
             phase: str, size: Size = SIZES[0],
             roles: dict[tuple[str, int], str] | None = None) -> str:
    """SVG of ``timeline`` rows in execution order (x: their position from 0, as the tables'
    ``#``), NaN (red) and inf (orange) bars centred on each call's tick on a log count axis,
    the largest finite magnitude (green line) on its own log axis, the ``culprit`` call marked.
    ``roles``: (module, call) -> its backtrace role; a call whose role is in `PASSED` is drawn
    hatched (passed through, not born there), with a legend entry when one is."""
    if not timeline:
        return "<p>(no module calls recorded)</p>"
    H, PT, PB = (320, 30, 64) if size.name == "wide" else (300, 30, 80)
    W, PL, PR = size.w, size.pad_l, size.pad_r
    n = len(timeline)
    f = _Frame(W, H, PL, PT, W - PL - PR, H - PT - PB)
    counts, count_ticks = count_axis(max(max(r.nan, r.inf) for r in timeline), f.ph,
                                     size.y_ticks, FONT + 2)
    mags, mag_ticks = value_axis([r.absmax for r in timeline], f.ph, size.y_ticks, FONT + 2)
    out = _open(size, H, "timeline", "NaN and inf counts per module call")
    out += _timeline_axes(f, size, n, count_ticks, mag_ticks)
    hatch = f"passed-{size.name}"           # the pattern's id: unique among the page's drawings
    out.append(f'<defs><pattern id="{hatch}" patternUnits="userSpaceOnUse" width="6" height="6" '
               'patternTransform="rotate(45)"><rect width="6" height="6" fill="white"/>'
               '<line x1="0" y1="0" x2="0" y2="6" stroke="#777" stroke-width="3"/></pattern>'
               '</defs>')
    passed = {k: v for k, v in (roles or {}).items() if v in PASSED}
    side = "inputs" if phase == "forward" else "incoming gradient"
    marker = _timeline_rows(out, f, timeline, counts, mags, culprit, (passed, hatch, side))
    if marker is not None:
        out += _culprit_mark(f, marker)
    shown = any((r.module, r.call) in passed and (r.nan or r.inf) for r in timeline)
    out += _timeline_titles(f, size, n, phase, mags, hatch if shown else None)
    return "\n".join(out)


def _timeline_axes(f: _Frame, size: Size, n: int, count_ticks, mag_ticks) -> list[str]:
    """The timeline's axes: the count axis (left), the magnitude axis (right), a tick per
    call shown (every ``step``-th, and the last when its label has room)."""
    PL, PT, pw, base = f.PL, f.PT, f.pw, f.base
    bw = pw / n
    out = [f'<line x1="{PL}" y1="{base}" x2="{PL + pw}" y2="{base}" stroke="#333"/>',
           f'<line x1="{PL}" y1="{PT}" x2="{PL}" y2="{base}" stroke="#333"/>',
           f'<line x1="{PL + pw}" y1="{PT}" x2="{PL + pw}" y2="{base}" stroke="#2ca02c"/>']
    out += _y_labels(count_ticks, PL, base, "#333", "left")
    out += _y_labels(mag_ticks, PL + pw, base, "#2ca02c", "right")
    step = _x_step(n, pw, size.x_gap)
    xs = list(range(0, n, step))
    if (n - 1) - xs[-1] >= step * 0.6:
        xs.append(n - 1)                   # the last call, when its label has room
    for i in xs:
        x = PL + (i + 0.5) * bw
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" '
                   f'stroke="#333"/><text class="xlabel" x="{x:.1f}" y="{base + 8 + FONT}" '
                   f'text-anchor="middle">{i}</text>')
    return out


def _timeline_rows(out: list[str], f: _Frame, timeline: list[TimelineRow], counts, mags,
                   culprit: tuple[str, int | None] | None, passing: tuple) -> tuple | None:
    """Each call's NaN and inf bars (and its abs-max, off the axis when it has no place) onto
    ``out``, then the abs-max line; returns (x, #, row) of the culprit's call, or None.
    ``passing``: (the calls that passed their bad values through -> their role, the hatch
    pattern's id, what their bad values came in: "inputs" or "incoming gradient")."""
    passed, hatch, side = passing
    PL, PT, base = f.PL, f.PT, f.base
    bw = f.pw / len(timeline)
    points, marker = [], None
    width = max(min(0.8 * bw, 40.0), 1.0)      # one bar, or the pair, centred on the tick
    for i, r in enumerate(timeline):
        cx = PL + (i + 0.5) * bw
        bars = [(k, c) for k, c in (("nan", "#d62728"), ("inf", "#ff7f0e")) if getattr(r, k)]
        role = passed.get((r.module, r.call))
        how = ("" if role is None else f", {PASSED[role].format(side=side)} (not born here)")
        if culprit is not None and (r.module, r.call) == culprit:
            role, how = None, ", born here (the culprit's call)"
        for j, (key, colour) in enumerate(bars):
            h = counts.height(getattr(r, key))
            bx = cx - width / 2 + j * width / len(bars)
            bw_ = width / len(bars)
            title = (f'<title>#{i} {html.escape(module_label(r.module))} call {r.call}: '
                     f'{key} {getattr(r, key)}{html.escape(how)}</title>')
            if role is None:
                out.append(f'<rect class="bar" x="{bx:.2f}" y="{base - h:.1f}" '
                           f'width="{bw_:.2f}" height="{h:.1f}" fill="{colour}">{title}</rect>')
            else:       # hatched over a pale fill, outlined in the colour of its kind
                out.append(f'<rect class="bar bar-passed" x="{bx:.2f}" y="{base - h:.1f}" '
                           f'width="{bw_:.2f}" height="{h:.1f}" fill="url(#{hatch})" '
                           f'stroke="{colour}" stroke-width="1.5">{title}</rect>')
        if r.absmax is not None and mags.placed(r.absmax):
            points.append(f"{cx:.1f},{base - mags.height(r.absmax):.1f}")
        elif r.absmax is not None:      # 0 on the log axis, or not finite: marked
            out.append(_off_axis(cx, base, PT, "#2ca02c",
                                 f"#{i} {module_label(r.module)} call {r.call}: largest "
                                 "finite |value|", r.absmax, label=False))
        if culprit and (r.module, r.call) == culprit and marker is None:
            marker = (cx, i, r)
    out.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="#2ca02c" '
               'stroke-width="1.5"/>')
    return marker


def _culprit_mark(f: _Frame, marker: tuple) -> list[str]:
    """The culprit call's dashed line and its label, kept inside the plot."""
    cx, i, r = marker
    W, PT, base = f.W, f.PT, f.base
    out = [f'<line class="culprit-mark" x1="{cx:.1f}" y1="{PT - 8}" x2="{cx:.1f}" '
           f'y2="{base}" stroke="#1f77b4" stroke-width="2" stroke-dasharray="5,3"/>']
    room = int((W - 12) / CHAR)
    label = _shorten(f"culprit #{i}: {module_label(r.module)}, call {r.call}", room)
    lw = CHAR * len(label) + 10
    lx = min(max(cx - lw / 2, 2), W - lw - 2)
    out.append(f'<rect x="{lx:.1f}" y="2" width="{lw:.1f}" height="{FONT + 6}" rx="3" '
               'fill="white" stroke="#1f77b4"/>'
               f'<text class="culprit-label" x="{lx + lw / 2:.1f}" y="{FONT + 2}" '
               f'text-anchor="middle" fill="#1f77b4" font-weight="bold">'
               f'{html.escape(label)}</text>')
    return out


def _timeline_titles(f: _Frame, size: Size, n: int, phase: str, mags,
                     hatch: str | None = None) -> list[str]:
    """The timeline's axis titles (shorter when narrow) and its legend (with ``hatch``, the
    pattern of calls that passed bad values through: an entry saying so); closes the SVG."""
    W, H, PL, PT, pw, ph, base = f.W, f.H, f.PL, f.PT, f.pw, f.ph, f.base
    side = "output" if phase == "forward" else "outgoing gradient"
    wide = size.name == "wide"
    title = (f"module calls in {phase} execution order (# 0 .. {n - 1}, as in the tables)"
             if wide else f"module calls, {phase} order (# 0 .. {n - 1})")
    left = f"NaN / inf count of the {side} (log)" if wide else "NaN / inf (log)"
    scale = "log" if mags.log else "linear"
    right = f"largest finite |value| ({scale})" if wide else f"largest |value| ({scale})"
    mid = PT + ph / 2
    legend_y = H - 12
    out = [f'<text class="axis-title" x="{PL + pw / 2}" y="{base + 12 + 2 * FONT}" '
           f'text-anchor="middle">{html.escape(title)}</text>',
           f'<text class="axis-title" x="{FONT}" y="{mid}" transform="rotate(-90 {FONT} {mid})" '
           f'text-anchor="middle">{html.escape(left)}</text>',
           f'<text class="axis-title" x="{W - FONT + 2}" y="{mid}" '
           f'transform="rotate(90 {W - FONT + 2} {mid})" text-anchor="middle" '
           f'fill="#2ca02c">{html.escape(right)}</text>']
    lx = PL
    for name, colour in (("NaN", "#d62728"), ("inf", "#ff7f0e")):
        out.append(f'<rect x="{lx}" y="{legend_y - 10}" width="10" height="10" fill="{colour}"/>'
                   f'<text class="legend" x="{lx + 14}" y="{legend_y}">{name}</text>')
        lx += 14 + int(CHAR * len(name)) + 16
    out += [f'<line x1="{lx}" y1="{legend_y - 4}" x2="{lx + 20}" y2="{legend_y - 4}" '
            f'stroke="#2ca02c" stroke-width="2"/><text class="legend" x="{lx + 24}" '
            f'y="{legend_y}">abs-max</text>']
    if hatch is not None:      # wide: on the legend's line; narrow: on a line of its own above
        lx, y = (lx + 24 + int(CHAR * len("abs-max")) + 16, legend_y) if wide else \
            (PL, legend_y - FONT - 4)
        words = ("passed through (already bad coming in: not born there)" if wide
                 else "passed through: not born there")
        out.append(f'<rect x="{lx}" y="{y - 10}" width="10" height="10" '
                   f'fill="url(#{hatch})" stroke="#d62728"/><text class="legend legend-passed" '
                   f'x="{lx + 14}" y="{y}">{html.escape(words)}</text>')
    out.append("</svg>")
    return out


def _off_axis(cx: float, base: float, top: float, colour: str, what: str, v: float,
              label: bool = True, dy: float = 0.0) -> str:
    """The marker of a value its axis has no place for: 0 as a hollow circle at the bottom, a
    value that is not finite as a triangle at the top, labelled with its word (``nan``, ``inf``,
    ``-inf``) when ``label``; ``what`` and the value in its tooltip."""
    if finite(v):
        return (f'<circle class="point-zero" cx="{cx:.1f}" cy="{base:.1f}" r="3" fill="white" '
                f'stroke="{colour}" stroke-width="1.5"><title>{html.escape(what)} {v:.4g} '
                "(no place on the log axis: drawn at its bottom)</title></circle>")
    y = top + dy
    text = (f'<text class="nonfinite-label" x="{cx + 6:.1f}" y="{y + 4:.1f}" '
            f'fill="{colour}">{word(v)}</text>' if label else "")
    return (f'<path class="point-nonfinite" d="M{cx - 4:.1f},{y + 4:.1f} L{cx + 4:.1f},'
            f'{y + 4:.1f} L{cx:.1f},{y - 3:.1f} Z" fill="{colour}"><title>{html.escape(what)} '
            f"{word(v)} (not finite: drawn at the top)</title></path>{text}")


def history_svg(history: list[HistoryEntry], marks: list[tuple[int, str]],
                size: Size = SIZES[0]) -> str:
    """SVG of the history's loss (blue, left axis) and gradient norm (grey, right axis), each on
    a log axis with values (linear when the series goes below 0), a dot per step (its values in
    a tooltip); a value the axis has no place for marked (`_off_axis`: 0 at the bottom, ``nan``
    and ``inf`` at the top); the failing step (the last entry) marked in red, with the values it
    could not plot (``NaN``, ``inf``) written at the top; the steps in ``marks`` (step, what)
    marked dashed."""
    if len(history) < 2:
        return ""
    W, PL, PR = size.w, size.pad_l, size.pad_r
    H, PT, PB = (240, 36, 56) if size.name == "wide" else (240, 36, 70)
    pw, ph = W - PL - PR, H - PT - PB
    base = PT + ph
    steps = [e.step for e in history]
    first, last = min(steps), steps[-1]       # x runs from the earliest step to the latest
    end = max(steps)
    x = lambda s: PL + pw * (s - first + 0.5) / (end - first + 1)  # noqa: E731 (centred)
    out = _open(size, H, "history", "loss and gradient norm of the steps before")
    out += [f'<line x1="{PL}" y1="{base}" x2="{PL + pw}" y2="{base}" stroke="#333"/>']
    scales = []
    for key, colour, side, ax_x, dy in (("loss", "#1f77b4", "left", PL, 0.0),
                                        ("grad_norm", "#555", "right", PL + pw, 12.0)):
        vals = [(e.step, getattr(e, key)) for e in history if getattr(e, key) is not None]
        if vals:
            scales.append(_series(out, vals, key, (colour, side, ax_x, dy), x, last,
                                  _Frame(W, H, PL, PT, pw, ph), size))
    step = _x_step(end - first + 1, pw, size.x_gap)
    ticks = list(range(first, end + 1, step))
    if end - ticks[-1] >= step * 0.6:
        ticks.append(end)
    for s in ticks:
        out.append(f'<line class="tick" x1="{x(s):.1f}" y1="{base}" x2="{x(s):.1f}" '
                   f'y2="{base + 4}" stroke="#333"/><text class="xlabel" x="{x(s):.1f}" '
                   f'y="{base + 8 + FONT}" text-anchor="middle">{s}</text>')
    for s, what in marks:
        if first <= s <= end and s != last:
            out.append(f'<line class="mark" x1="{x(s):.1f}" y1="{PT}" x2="{x(s):.1f}" '
                       f'y2="{base}" stroke="#ff7f0e" stroke-dasharray="4,3">'
                       f'<title>{html.escape(f"{what} (step {s})")}</title></line>')
    e = history[-1]                         # the failing step
    bad = [f"{name} {_word(getattr(e, key))}" for key, name in (("loss", "loss"),
                                                                ("grad_norm", "grad norm"))
           if getattr(e, key) is not None and not finite(getattr(e, key))]
    label = f"failing step {last}" + (f": {', '.join(bad)}" if bad else "")
    lw = CHAR * len(label) + 10
    lx = min(max(x(last) - lw, 2), W - lw - 2)
    out.append(f'<line class="failing-mark" x1="{x(last):.1f}" y1="{PT - 6}" x2="{x(last):.1f}" '
               f'y2="{base}" stroke="#d62728" stroke-width="2"/>'
               f'<rect x="{lx:.1f}" y="4" width="{lw:.1f}" height="{FONT + 6}" rx="3" '
               f'fill="white" stroke="#d62728"/><text class="failing-label" '
               f'x="{lx + lw / 2:.1f}" y="{FONT + 4}" text-anchor="middle" fill="#d62728" '
               f'font-weight="bold">{html.escape(label)}</text>')
    how = "log scales" if set(scales) <= {"log"} else "scales " + " and ".join(scales)
    title = (f"step; loss (blue, left) and gradient norm (grey, right), {how}" if
             size.name == "wide" else "step; loss (left), grad norm (right)")
    out += [f'<text class="axis-title" x="{PL + pw / 2}" y="{base + 12 + 2 * FONT}" '
            f'text-anchor="middle">{html.escape(title)}</text>', "</svg>"]
    return "\n".join(out)


def _series(out: list[str], vals: list[tuple[int, float]], key: str, style: tuple, x, last: int,
            f: _Frame, size: Size) -> str:
    """One series of the history onto ``out`` (its axis, its line and dots, its values the axis
    has no place for marked); returns its scale ("log" or "linear")."""
    colour, side, ax_x, dy = style
    PT, base = f.PT, f.base
    axis, ticks = value_axis([v for _, v in vals], f.ph, size.y_ticks, FONT + 2)
    out.append(f'<line x1="{ax_x}" y1="{PT}" x2="{ax_x}" y2="{base}" stroke="{colour}"/>')
    out += _y_labels(ticks, ax_x, base, colour, side)
    pts = [(x(s), base - axis.height(v), s, v) for s, v in vals if axis.placed(v)]
    if len(pts) > 1:
        out.append(f'<polyline points="{" ".join(f"{a:.1f},{b:.1f}" for a, b, _, _ in pts)}"'
                   f' fill="none" stroke="{colour}" stroke-width="1.5"/>')
    out += [f'<circle class="point" cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{colour}">'
            f'<title>step {s}: {key} {v:.4g}</title></circle>' for a, b, s, v in pts]
    labelled = -math.inf        # x of the last word written at the top: none closer
    for s, v in vals:
        if axis.placed(v):
            continue
        # the failing step's own words are in its label; others' when they have room
        label = not finite(v) and s != last and x(s) - labelled >= CHAR * 5
        labelled = x(s) if label else labelled
        out.append(_off_axis(x(s), base, PT, colour, f"step {s}: {key}", v, label, dy))
    return "log" if axis.log else "linear"


def _word(v: float) -> str:
    """The failing step's label: ``NaN`` as people write it, else ``inf``, ``-inf``."""
    return "NaN" if math.isnan(v) else word(v)


def both(draw, *args) -> str:
    """The wide and the narrow drawing of one plot, one after the other (CSS shows one)."""
    return "\n".join(draw(*args, size) for size in SIZES)
