"""The plots' axes (`nanbisect.report.plots`): log axes with 1-2-5 ticks for magnitudes and
counts, a linear axis for a series that goes below 0, and where each value goes on them.

Guarantees: every function here takes any float (0, negative, subnormal, 1e308, nan, +-inf)
without raising, and every height it returns is a finite number of pixels within the plot
(0 .. ``ph``). A value a log axis has no place for (0, negative, not finite) is given height 0
by `Axis.height`; the plots draw those with a marker of their own (`Axis.placed` says which
values are on the axis). Not guaranteed: readable ticks on an axis that spans more than 600
decades (every k-th decade is labelled).
"""
from __future__ import annotations

import math
import sys

MAX = sys.float_info.max        # the top of any axis
MIN = 1e-300                    # the bottom of a log axis: smaller values sit on it


def _pow10(k: int) -> float:
    """10 ** k, inf above the largest float and 0 below the smallest (never OverflowError)."""
    return math.inf if k > 308 else 0.0 if k < -323 else 10.0 ** k


def _clamp(v: float) -> float:
    return min(max(v, MIN), MAX)


def nice_ticks(lo: float, hi: float, limit: int) -> list[float]:
    """Real values for a log axis over [lo, hi] (both > 0): 1-2-5 in each decade when at most
    ``limit`` of them fit, else 1-3, else decades (every k-th one on a wide range).

    >>> nice_ticks(1, 400, 7)
    [1, 3, 10, 30, 100, 300]
    >>> nice_ticks(0.5, 30, 7)
    [0.5, 1, 2, 5, 10, 20]
    >>> nice_ticks(1e-3, 1e9, 5)
    [0.001, 1, 1000, 1000000, 1000000000]
    >>> nice_ticks(1e300, MAX, 3)
    [1e+300, 1e+304, 1e+308]
    """
    lo, hi = _clamp(lo), _clamp(hi)
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    inside = lambda v: math.isfinite(v) and lo * (1 - 1e-9) <= v <= hi * (1 + 1e-9)  # noqa: E731
    for mult in ((1, 2, 5), (1, 3), (1,)):
        ticks = [_round(m * _pow10(k)) for k in range(a, b + 1) for m in mult
                 if inside(m * _pow10(k))]
        if len(ticks) <= limit:
            return ticks
    step = math.ceil((b - a + 1) / limit)
    return [_round(_pow10(k)) for k in range(a, b + 1) if (k - a) % step == 0
            and inside(_pow10(k))]


def nice_ceil(v: float) -> float:
    """The 1-2-5 value at or above ``v`` > 0: the top of an axis, a real value (at most the
    largest float; below `MIN`, `MIN`'s).

    >>> nice_ceil(348), nice_ceil(1005.5), nice_ceil(0.03), nice_ceil(1.5e308) == MAX
    (500, 2000, 0.05, True)
    """
    v = _clamp(v)
    k = math.floor(math.log10(v))
    for m in (1, 2, 5, 10):
        c = m * _pow10(k)
        if c >= v * (1 - 1e-9):
            return _round(c) if math.isfinite(c) else MAX
    return _round(_pow10(k + 1)) if k < 308 else MAX


def nice_floor(v: float) -> float:
    """The 1-2-5 value at or below ``v`` > 0 (never below `MIN`).

    >>> nice_floor(0.8), nice_floor(3.2), nice_floor(5e-324) == MIN
    (0.5, 2, True)
    """
    v = _clamp(v)
    k = math.floor(math.log10(v))
    for m in (5, 2, 1):
        c = m * _pow10(k)
        if MIN <= c <= v * (1 + 1e-9):
            return _round(c)
    return max(_round(_pow10(k - 1)), MIN)


def _round(v: float) -> float:
    r = float(f"{v:.6g}")
    if not math.isfinite(r):      # the largest float rounds up to inf at 6 digits
        return MAX
    return int(r) if abs(r) < 1e15 and r == int(r) else r


def fmt(v: float) -> str:
    """A tick label: ``0.001``, ``20``, ``5000``, ``2e5``, ``1e-6``; ``nan``, ``inf``.

    >>> [fmt(v) for v in (0.001, 20, 5000, 200000, 1e-6, 0.35, -2e5, float("inf"))]
    ['0.001', '20', '5000', '2e5', '1e-6', '0.35', '-2e5', 'inf']
    """
    if not math.isfinite(v):
        return word(v)
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:g}"
    m, e = f"{v:.2e}".split("e")
    m = m.rstrip("0").rstrip(".")
    return f"{m}e{int(e)}"


def word(v: float) -> str:
    """A value no axis places, as report.json writes it: ``nan``, ``inf``, ``-inf``.

    >>> word(float("nan")), word(-float("inf"))
    ('nan', '-inf')
    """
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Axis:
    """A log axis from ``bottom`` to ``top`` (both > 0) mapped on ``ph`` pixels; ``offset`` 1 for
    counts (log10(1 + n): 0 sits at the bottom).

    >>> a = Axis(1, 100, 200)
    >>> a.height(10), a.height(0), a.height(float("nan")), a.height(1e308), a.placed(0)
    (100.0, 0.0, 0.0, 200.0, False)
    """

    log = True

    def __init__(self, bottom: float, top: float, ph: float, offset: float = 0.0):
        self.lo = math.log10(_clamp(bottom + offset))
        self.span = (math.log10(_clamp(top + offset)) - self.lo) or 1.0
        self.ph, self.offset = ph, offset

    def placed(self, v: float) -> bool:
        """Whether ``v`` has a place on this axis (finite, and above 0 on a log axis)."""
        return finite(v) and v + self.offset > 0

    def height(self, v: float) -> float:
        """Pixels above the bottom: within 0 .. ph (0 for what is not `placed`)."""
        if not self.placed(v):
            return 0.0
        h = self.ph * (math.log10(_clamp(v + self.offset)) - self.lo) / self.span
        return float(min(max(h, 0.0), self.ph))


class LinearAxis(Axis):
    """A linear axis from ``bottom`` to ``top`` on ``ph`` pixels: a series with values below 0.

    >>> a = LinearAxis(-10, 10, 100)
    >>> a.height(0), a.height(-10), a.height(-1e308), a.height(1e308)
    (50.0, 0.0, 0.0, 100.0)
    >>> LinearAxis(-1e308, 1e308, 100).height(-5e307)     # placed, not pinned to the top
    25.0
    """

    log = False

    def __init__(self, bottom: float, top: float, ph: float):
        self.bottom, self.top, self.ph, self.offset = bottom, top, ph, 0.0
        self.half = (top / 2 - bottom / 2) or 1.0      # halves: 1e308 - -1e308 is inf

    def placed(self, v: float) -> bool:
        return finite(v)

    def height(self, v: float) -> float:
        if not self.placed(v):
            return 0.0
        h = self.ph * ((v / 2 - self.bottom / 2) / self.half)   # NB: ph * 1e308 is inf
        return float(min(max(h, 0.0), self.ph))


def linear_ticks(lo: float, hi: float, limit: int) -> tuple[float, float, list[float]]:
    """(bottom, top, ticks) of a linear axis over [lo, hi]: a 1-2-5 step, at most ``limit``
    ticks, 0 among them when the range holds it.

    >>> linear_ticks(-3.2, 7.9, 7)
    (-4, 8, [-4, -2, 0, 2, 4, 6, 8])
    >>> linear_ticks(-1e308, 1e308, 5)[2][:2]
    [-1e+308, -5e+307]
    """
    if hi <= lo:
        pad = min(abs(lo), MAX / 2) or 1.0
        lo, hi = max(lo - pad, -MAX), min(hi + pad, MAX)
    span = min(hi / 2 - lo / 2, MAX / 2) * 2
    n = max(limit - 1, 1)
    step = nice_ceil(span / n)
    while True:
        first, last = math.floor(lo / step), math.ceil(hi / step)
        if last - first <= n or step >= MAX:
            break
        step = nice_ceil(step * 1.5)
    bottom, top = max(first * step, -MAX), min(last * step, MAX)
    ticks = [_round(k * step) for k in range(first, last + 1) if -MAX <= k * step <= MAX]
    return _round(bottom), _round(top), ticks


def spaced(ticks: list[tuple[float, str]], gap: float) -> list[tuple[float, str]]:
    """Ticks (pixel height, label) with those closer than ``gap`` to the last kept one dropped."""
    kept: list[tuple[float, str]] = []
    for h, label in ticks:
        if not kept or h - kept[-1][0] >= gap:
            kept.append((h, label))
    return kept


def count_axis(top_count: float, ph: float, limit: int, gap: float
               ) -> tuple[Axis, list[tuple[float, str]]]:
    """The log axis of NaN/inf counts from 0 to at least ``top_count``, with its ticks."""
    top = nice_ceil(max(top_count, 1) if finite(top_count) else 1)
    axis = Axis(0, top, ph, offset=1.0)
    ticks = [(0.0, "0")] + [(axis.height(v), fmt(v)) for v in nice_ticks(1, top, limit - 1)]
    return axis, spaced(ticks, gap)


def value_axis(values: list, ph: float, limit: int, gap: float
               ) -> tuple[Axis, list[tuple[float, str]]]:
    """The axis of a series of values and its ticks: log over the positive finite values, or
    linear when some finite value is below 0 (0 is then on it too). Values not finite are
    left to the caller's markers.

    >>> value_axis([0.0, 0.0], 100, 5, 14)[0].log, value_axis([-1.0, 2.0], 100, 5, 14)[0].log
    (True, False)
    """
    ok = [v for v in values if finite(v)]
    if any(v < 0 for v in ok):
        bottom, top, ticks = linear_ticks(min(ok), max(ok), limit)
        axis: Axis = LinearAxis(bottom, top, ph)
        return axis, spaced([(axis.height(v), fmt(v)) for v in ticks], gap)
    pos = [v for v in ok if v > 0]
    lo, hi = (_clamp(min(pos)), _clamp(max(pos))) if pos else (1.0, 1.0)
    bottom, top = nice_floor(lo), nice_ceil(hi)
    if top <= bottom * 1.0001:
        bottom, top = nice_floor(lo / 10), nice_ceil(min(hi, MAX / 10) * 10)
    axis = Axis(bottom, top, ph)
    return axis, spaced([(axis.height(v), fmt(v)) for v in nice_ticks(bottom, top, limit)],
                        gap)
