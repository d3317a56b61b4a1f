"""Numbers that are not finite are data, not errors: one JSON encoding for every record (strict
JSON, non-finite floats as "nan", "inf", "-inf"; `nanbisect.util.recordjson`), plots that place
or mark 0, negative, subnormal, huge and non-finite values, and markdown and HTML that print
them. Fuzzed with hypothesis over every numeric field of a report (reproducible: derandomized,
as tests/bundle/test_fuzz.py; ``NANBISECT_FUZZ_EXAMPLES=N`` for a longer random campaign).
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanbisect.records import (BadValue, Comparison, ContextRow, Culprit, Divergence, Fidelity,
                               Finding, HistoryEntry, Losses, OpCheck, RankReference, RankResult,
                               RankSummary, Remedy, ReplicaDiff, RunFacts, Stats, StepRow,
                               StepsWindow, TimelineRow, TraceRow, json_number)
from nanbisect.report.axes import nice_ceil, nice_floor, nice_ticks
from nanbisect.report.model import Report
from nanbisect.report.plots import SIZES, history_svg, plot_svg
from nanbisect.report.prose import terminal
from nanbisect.report.write import write_report
from nanbisect.util.recordjson import dumps, number

_N = int(os.environ.get("NANBISECT_FUZZ_EXAMPLES", "0"))
FAST = settings(max_examples=_N or 40, deadline=None, derandomize=not _N, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NASTY = [0.0, -0.0, -1.5, -1e308, 5e-324, 2.2e-308, 1e-300, 1e308, 1.7976931348623157e308,
         math.inf, -math.inf, math.nan, 1.0, 65504.0, 3e-5]
nums = st.sampled_from(NASTY) | st.floats(allow_nan=True, allow_infinity=True)
maybe = st.none() | nums
counts = st.sampled_from([0, 1, 3, 10 ** 12]) | st.integers(-5, 2 ** 62)

# a coordinate attribute of an SVG element: its value must be a finite number (or numbers)
COORD = re.compile(r'\s(x|y|x1|x2|y1|y2|cx|cy|r|width|height|points|d|viewBox)="([^"]*)"')


def strict_loads(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity (RFC 8259 JSON)."""
    def refuse(token: str):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def assert_finite_coordinates(svg: str) -> None:
    bad = [f"{k}={v}" for k, v in COORD.findall(svg) if re.search(r"nan|inf", v, re.I)]
    assert not bad, bad[:5]


def _stats(draw) -> Stats:
    return Stats(draw(counts), draw(counts), draw(counts), draw(nums), draw(nums))


def _comparison(draw) -> Comparison:
    return Comparison(False, 8, 3, draw(nums), (1, 2), draw(nums), draw(nums), draw(nums),
                      draw(nums), draw(nums), nonfinite_new=draw(counts))


@st.composite
def reports(draw) -> Report:
    """A culprit report whose every numeric field is drawn from the nasty numbers."""
    facts = RunFacts("b", "train.py:task", "cpu", "cpu", {"loss": "nan"},
                     Losses(json_number(draw(maybe)), json_number(draw(maybe)),
                            json_number(draw(maybe)), False),
                     Fidelity([], [], True, False, loss_rel_diff=draw(maybe),
                              tolerance=draw(maybe), tolerance_dtype="float32"))
    culprit = Culprit("forward", "blocks.0.attn", 0, ["float16"], [[2, 8]], "m.py:3",
                      "aten.exp.default", 17)
    n_hist = draw(st.integers(2, 8))
    history = [HistoryEntry(100 + i, loss=draw(maybe), grad_norm=draw(maybe), lr=draw(maybe))
               for i in range(n_hist)]
    timeline = [TimelineRow(f"blocks.{i}", 0, draw(counts), draw(counts), draw(nums))
                for i in range(draw(st.integers(1, 6)))]
    comparison = _comparison(draw)
    rank = RankResult(0, summary=RankSummary(0, "forward", json_number(draw(nums)), "nan"),
                      module_stats={"inputs": _stats(draw), "output": None},
                      reference=RankReference(None, json_number(draw(nums)), "loss",
                                              json_number(draw(nums))))
    return Report(
        "culprit", "numerics", "forward", "inf", culprit, facts,
        input_nonfinite=[BadValue("batch", "x", draw(counts), draw(counts), draw(counts))],
        backtrace=[TraceRow(0, "blocks.0.attn", 0, "culprit", _stats(draw), _stats(draw))],
        context=[ContextRow(17, "aten.exp.default", "blocks.0.attn", 0, "forward", False, True,
                            draw(maybe), True)],
        divergence=Divergence("forward", "loss", comparison),
        op_check=OpCheck("aten.exp.default", 17, "mismatch", "kernel", [comparison]),
        ranks=[rank], timeline=timeline,
        replicas_out_of_sync=[ReplicaDiff("model:w", [[0], [1]], draw(maybe))],
        history=history,
        history_findings=[Finding("loss-jump", "the loss jumped", 101, value=draw(maybe),
                                  baseline=draw(maybe), ratio=draw(maybe), z=draw(maybe))],
        steps=StepsWindow([StepRow(100 + i, draw(maybe), draw(maybe), draw(maybe), draw(maybe),
                                   i == 1) for i in range(2)], 101, 0,
                          {"bit_exact": False, "max_rel_diff": draw(maybe)},
                          failing_prestate_max_rel_diff=draw(maybe)),
        timings={"read": draw(nums), "build": draw(nums)},
        remedies=[Remedy("precision", "when aten.exp.default runs in float32", "finite",
                         draw(maybe), {"dtype": "float32", "loss": draw(nums)})])


@FAST
@given(reports())
def test_every_report_is_written_whatever_its_numbers(r):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        written = write_report(r, out)
        # nothing was left out: every rendering succeeded (its fallback would hide a crash)
        assert written.errors == []
        data = strict_loads((out / "report.json").read_text())
        assert data["verdict"] == "culprit" and data["errors"] == []
        md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
        assert md.startswith("# nanbisect report: culprit") and "</html>" in page
        svgs = re.findall(r"<svg.*?</svg>", page, re.S)
        # the history, wide and narrow; the timeline too where a call had NaN/inf
        assert len(svgs) == (4 if any(t.nan or t.inf for t in r.timeline) else 2)
        for svg in svgs:
            assert_finite_coordinates(svg)
        # the page folds report.json in as it is written: strict there too
        folded = re.search(r"<summary>report.json</summary><pre>(.*?)</pre>", page, re.S)
        assert strict_loads(html.unescape(folded.group(1))) == data
        assert terminal(written, out).startswith("nanbisect: culprit")


def _markers(svg: str) -> int:
    """Values drawn: points on an axis, zeros at its bottom, non-finite at its top."""
    return len(re.findall(r'class="(?:point|point-zero|point-nonfinite)"', svg))


@FAST
@given(st.lists(st.tuples(maybe, maybe), min_size=2, max_size=12))
def test_history_plot_places_or_marks_every_value(values):
    history = [HistoryEntry(7 + i, loss=a, grad_norm=b) for i, (a, b) in enumerate(values)]
    given_values = sum(v is not None for pair in values for v in pair)
    for size in SIZES:
        svg = history_svg(history, [(8, "loss-jump")], size)
        assert_finite_coordinates(svg)
        assert _markers(svg) == given_values


@FAST
@given(st.lists(st.tuples(counts, counts, nums), min_size=1, max_size=12))
def test_timeline_plot_takes_any_number(rows):
    timeline = [TimelineRow(f"m{i}", 0, a, b, v) for i, (a, b, v) in enumerate(rows)]
    for size in SIZES:
        svg = plot_svg(timeline, ("m0", 0), "backward", size)
        assert_finite_coordinates(svg)
        # every abs-max is on the line or marked
        line = re.search(r'<polyline points="([^"]*)"', svg).group(1).split()
        marked = len(re.findall(r'class="(?:point-zero|point-nonfinite)"', svg))
        assert len(line) + marked == len(rows)


@FAST
@given(nums.filter(lambda v: math.isfinite(v) and v > 0))
def test_nice_bounds_of_any_positive_float(v):
    top, bottom = nice_ceil(v), nice_floor(v)
    assert math.isfinite(top) and math.isfinite(bottom) and 0 < bottom <= top
    assert top >= min(v, 1.7976931348623157e308) * (1 - 1e-9)
    assert all(math.isfinite(t) and t > 0 for t in nice_ticks(bottom, top, 7))


def _issue_report() -> Report:
    """A backtrace ``abssum`` that overflowed to inf (report.json's writer refused it) and a
    gradient norm of exactly 0 all along (the history plot took log10(0))."""
    return Report("culprit", "numerics", "forward", "inf",
               Culprit("forward", "", 0, ["float16"], [[4]], None, "aten.exp.default", 3),
               RunFacts("b", "t.py:task", "cpu", "none", None, Losses("inf", "inf")),
               backtrace=[TraceRow(0, "", 0, "culprit", Stats(0, 0, 0, 1.0, 2.0),
                                   Stats(0, 4, 0, 65504.0, math.inf))],
               history=[HistoryEntry(s, loss=2.0, grad_norm=0.0) for s in range(3)]
               + [HistoryEntry(3, loss=math.inf, grad_norm=0.0)])


def test_the_failures_the_issue_reported():
    """The report of `_issue_report` is written; the all-zero series draws, marked."""
    r = _issue_report()
    with tempfile.TemporaryDirectory() as d:
        written = write_report(r, Path(d))
        data = strict_loads((Path(d) / "report.json").read_text())
        md = (Path(d) / "report.md").read_text()
        page = (Path(d) / "report.html").read_text()
    assert written.errors == []
    assert data["backtrace"][0]["after"]["abssum"] == "inf"
    assert data["history"][-1] == {"step": 3, "loss": "inf", "grad_norm": 0.0}
    assert "|      0 |      4 | 6.55e+04 |" in md and "| 3 | inf | 0 |" in md
    assert page.count('class="point-zero"') == 8      # 4 zero grad norms, wide and narrow


def test_one_encoding_and_its_readers():
    """Non-finite floats anywhere in a record are strings; readers of the rank files take them
    back as floats where the field is a number."""
    assert dumps({"a": [math.nan, (math.inf, -math.inf)], "k": "nan", "n": 0.5}) == \
        '{"a": ["nan", ["inf", "-inf"]], "k": "nan", "n": 0.5}'
    assert [number(v) for v in ("inf", "-inf", "x", 2)] == [math.inf, -math.inf, "x", 2]
    res = RankResult(1, module_stats={"inputs": Stats(0, 1, 0, 3.0, math.inf), "output": None},
                     context=[ContextRow(2, "aten.exp.default", "a", 0, "forward", False, True,
                                         math.inf, True)],
                     remedies=[Remedy("precision", "in float32", "finite", 1.0,
                                      {"loss": math.nan})])
    text = dumps(res.to_json())
    assert '"abssum": "inf"' in text and '"loss": "nan"' in text
    back = RankResult.from_json(strict_loads(text))
    assert back.module_stats["inputs"].abssum == math.inf
    assert back.context[0].out_absmax == math.inf


def test_triage_reads_such_a_report_and_writes_strict_json(tmp_path):
    from nanbisect.nightly.summary import NightState

    write_report(_issue_report(), tmp_path)
    report = strict_loads((tmp_path / "report.json").read_text())
    night = NightState([], set(), tmp_path / "t", {}, "loky", 60.0)
    night.add({"bundle": "b0", "seconds": math.inf, "report": report, "report_dir": None},
              False)
    night.finished = True
    night.write(final=True)
    data = strict_loads((tmp_path / "t" / "triage.json").read_text())
    assert "aten.exp" in data["bundles"][0]["signature"]
    assert data["bundles"][0]["seconds"] == "inf"
