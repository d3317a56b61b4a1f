"""Row narrowing (issue 38, item 7): the ``samples`` remedy removes the rows the op tracing named
(``culprit.samples``) first, then bisects them down to a minimal set; when the budget ends the
narrowing, the verified line itself says so. A tiny task (tests/tasks/narrow_rows.py: the trace
names rows 2 and 3, only row 2 breaks the step) replayed in process, and the search alone on
made-up answers."""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch

import nanbisect
import narrow_rows as tasks
from helpers import TEST_TASKS
from nanbisect.bundle.format import read_bundle
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.records import Remedy, RowTrace
from nanbisect.remedies import _samples
from nanbisect.remedies.narrow import narrow
from nanbisect.remedies.trials import DEFAULT_BUDGET, Trials
from nanbisect.replay.replayer import Replayer
from nanbisect.report.prose import terminal, to_markdown, verified

TASK = TEST_TASKS / "narrow_rows.py"


def capture(tmp_path):
    bundle = tmp_path / "bundle"
    nanbisect.capture(tasks.masked_weights(), tasks.batch(), bundle,
                      entry=f"{TASK}:masked_weights")
    return bundle


def samples(report) -> Remedy:
    (s,) = [m for m in report.remedies if m.kind == "samples"]
    return s


def before_samples(report) -> int:
    """The replays the remedies tried before ``samples`` (precision's)."""
    return sum(1 for m in report.remedies if m.kind != "samples" and m.outcome != "skipped")


def test_a_row_masked_after_the_culprit_is_left_out_by_the_trace(tmp_path):
    """The trace names rows [2, 3] at the culprit, and follows them on: row 3's NaN is masked
    by the ``where``, only row 2's reaches the loss. One replay without row 2 is finite, and
    the remedy says why that set is the right one."""
    bundle = capture(tmp_path)
    r = run_bundle(bundle, RunOptions(run_repro=False, remedies=DEFAULT_BUDGET), tmp_path / "r")
    assert (r.culprit.op, r.culprit.module, r.culprit.samples) == ("aten.sqrt.default", "conf",
                                                                   [2, 3])
    s = samples(r)
    assert (s.outcome, s.change, s.detail["rows"]) == ("finite", "without batch rows [2]", [2])
    assert (s.detail["found_by"], s.detail["traced"], s.detail["complete"]) == ("trace", [2, 3],
                                                                              True)
    assert "tried" not in s.detail       # the one replay: the step without row 2
    at = s.detail["reached_at"]
    assert at.endswith("in forward") and at.startswith("aten.")
    assert s.detail["minimal"] == f"row 3 is bad at the culprit too, but masked before {at}"
    assert s.loss is not None and [i["fields"] for i in s.detail["identify"]] == [{"id": "row-2"}]
    assert verified(r) == [f"the step is finite without batch rows [2], a minimal set: "
                           f"{s.detail['minimal']} (row 2: id 'row-2', "
                           f"sha256 {s.detail['identify'][0]['sha256']})"]


def test_traced_rows_are_narrowed_by_bisection_or_the_line_says_the_budget_ended(tmp_path):
    """A trace that did not follow its rows to where they meet (rows [2, 3], no reach): the
    step is finite without both, and without row 2 alone: with the budget for it the remedy is
    row 2; one replay short, rows [2, 3], and the verified line says the narrowing was cut
    short, and where."""
    bundle = capture(tmp_path)
    r = run_bundle(bundle, RunOptions(run_repro=False, remedies=0), tmp_path / "r")
    rep = Replayer(read_bundle(bundle), torch.device("cpu"))
    unfollowed = RowTrace([2, 3], 8)
    s = _samples(Trials(rep, nullcontext, 2, "optimizer", lambda *a: None), unfollowed)
    assert (s.outcome, s.change, s.detail["rows"]) == ("finite", "without batch rows [2]", [2])
    assert s.detail["found_by"] == "trace, narrowed by bisection" and s.detail["complete"]
    assert [(t["without"], t["outcome"]) for t in s.detail["tried"]] == [
        ([2, 3], "finite"), ([2], "finite")]

    s = _samples(Trials(rep, nullcontext, 1, "optimizer", lambda *a: None), unfollowed)
    assert (s.outcome, s.detail["rows"], s.detail["complete"]) == ("finite", [2, 3], False)
    ended = "narrowed to 2 rows, budget ended; row 2 alone not tried"
    assert s.sentence() == f"the step is finite without batch rows [2, 3] ({ended})"
    r = replace(r, remedies=[s])
    (line,) = verified(r)
    assert line.startswith(f"the step is finite without batch rows [2, 3] ({ended}) (row 2: ")
    assert f"**Verified:** {line}." in to_markdown(r)
    assert f"  verified: {line}" in terminal(r, tmp_path / "r").splitlines()


class FakeTrials:
    """`Trials` with a made-up step: finite when none of ``bad`` is left in the batch."""

    def __init__(self, bad: set[int], budget: int):
        self.bad, self.budget, self.used = bad, budget, 0

    @property
    def left(self) -> int:
        return self.budget - self.used

    def spent(self, kind: str, change: str) -> Remedy:
        return Remedy(kind, change, "skipped", detail={"reason": "budget"})

    def replay(self, change, *, edit):
        self.used += 1
        left = set(edit({"row": torch.arange(8)})["row"].tolist())
        return ("still-failing", None, {"phase": "forward"}) if left & self.bad \
            else ("finite", 0.5, {})


def narrowed(monkeypatch, bad: set[int], budget: int, traced: list[int] | None) -> Remedy:
    trials = FakeTrials(bad, budget)
    trials.rep = SimpleNamespace(task=SimpleNamespace(accumulate=1))
    monkeypatch.setattr("nanbisect.remedies._batch", lambda rep: {"row": torch.arange(8)})
    trace = RowTrace(traced, 8, None if traced is not None else "mixed by aten.mean.dim")
    return _samples(trials, trace)


def test_rows_the_trace_missed_are_found_by_bisecting_the_whole_batch(monkeypatch):
    """The trace names row 2, but row 3 breaks the step too: without row 2 it still fails, then
    bisection of the whole batch finds both (the step without row 2 alone is not replayed
    twice)."""
    s = narrowed(monkeypatch, {2, 3}, 20, [2])
    assert (s.outcome, s.detail["rows"], s.detail["found_by"]) == ("finite", [2, 3],
                                                                    "bisection")
    assert s.detail["traced"] == [2] and s.detail["complete"]
    assert [(t["without"], t["outcome"]) for t in s.detail["tried"]] == [
        ([2], "still-failing"), ([0, 1, 2, 3], "finite"), ([0, 1], "still-failing"),
        ([2, 3], "finite"), ([3], "still-failing")]
    s = narrowed(monkeypatch, {2, 6}, 1, [2])     # no replay left after the traced rows'
    assert (s.outcome, s.change, s.detail["found_by"]) == (
        "still-failing", "without batch rows [2]", "trace")
    assert "still fails without the traced rows" in s.detail["note"]
    s = narrowed(monkeypatch, {5}, 3, None)       # untraced: 8 rows halved twice, 3 replays
    assert (s.outcome, s.detail["rows"], s.detail["complete"]) == ("finite", [4, 5], False)
    assert s.sentence().endswith("(narrowed to 2 rows, budget ended; row 4 alone not tried)")


def test_independent_rows_in_both_halves_are_found_by_group_testing(monkeypatch):
    """Rows 2 and 6, one in each half of the batch: neither half alone makes the step finite,
    which says that each half holds a row that breaks it (the step without one half is the
    step with only the other), not that the rows act together. Each half is split and each
    piece replayed alone, down to single rows; the two are then verified together."""
    s = narrowed(monkeypatch, {2, 6}, 20, [2])
    assert (s.outcome, s.change, s.detail["rows"]) == ("finite", "without batch rows [2, 6]",
                                                       [2, 6])
    assert (s.detail["found_by"], s.detail["alone"], s.detail["complete"]) == (
        "group testing", [2, 6], True)
    assert s.detail["minimal"].startswith("each of them alone keeps the step failing")
    tried = [(t["without"], t["outcome"]) for t in s.detail["tried"]]
    assert tried[:3] == [([2], "still-failing"), ([0, 1, 2, 3], "still-failing"),
                         ([4, 5, 6, 7], "still-failing")]
    assert ([0, 1, 3, 4, 5, 6, 7], "still-failing") in tried     # row 2 alone fails
    assert tried[-1] == ([2, 6], "finite")                       # verified together
    assert len({tuple(t) for t, _ in tried}) == len(tried)
    assert not any("act together" in str(v) for v in s.detail.values())
    s = narrowed(monkeypatch, {2, 6}, 4, None)    # cut short: says so, claims nothing more
    assert (s.outcome, s.detail["rows"], s.detail["complete"]) == ("still-failing", None, False)
    assert "budget ended" in s.detail["note"] and "act together" not in s.detail["note"]


def test_the_search_ends_with_a_minimal_set():
    """From a set the step is known to be finite without, whichever rows in it are to blame
    (any 1 to 3 of 6), the search ends with exactly those; each removal asked once."""
    start = list(range(6))
    for k in (1, 2, 3):
        for bad in itertools.combinations(start, k):
            asked = []

            def attempt(rows, bad=set(bad)):
                asked.append(tuple(rows))
                return "finite" if bad <= set(rows) else "still-failing"
            found = narrow(attempt, start, known=True)
            assert (found.rows, found.stop) == (list(bad), "minimal"), bad
            assert len(asked) == len(set(asked)), bad
    # the whole batch, not known to be finite without all of it: rows in both halves
    whole = narrow(lambda rows: "finite" if {1, 4} <= set(rows) else "still-failing", start,
                   known=False)
    assert (whole.rows, whole.stop, whole.alone, whole.complete) == ([1, 4], "minimal", [1, 4],
                                                                     True)
    # rows that only break the step together (1 with 2, or 4 with 5): said only once shown
    pairs = narrow(lambda rows: "finite" if {1, 2} & set(rows) and {4, 5} & set(rows)
                   else "still-failing", start, known=False)
    assert (pairs.stop, pairs.together, pairs.alone) == ("together", [[0, 1, 2], [3, 4, 5]], [])
    assert ([0, 1, 2, 5], "finite") in pairs.asked and ([2, 3, 4, 5], "finite") in pairs.asked
    cut = narrow(lambda rows: "budget" if len(rows) < 3 else "finite", start, known=False)
    assert (cut.rows, cut.stop, cut.next, cut.complete) == ([0, 1, 2], "budget", [0, 1], False)
