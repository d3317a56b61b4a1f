"""Which batch rows to remove to make the step finite, narrowed to a minimal set (`narrow`).

The search asks one question, "is the step finite without these rows?", each answer a replay
(``attempt``: "finite", "still-failing", "error", or "budget" when no replay is left), and
assumes that removing more of the rows to blame never brings the failure back. It starts from the
rows the op tracing named (``culprit.samples``) when there are some and the step is finite
without them, else from the whole batch, and then removes what is not needed (delta debugging,
rows kept in order; a removal of fewer rows than one that did not help is not replayed):

- halves first: the step without one half of the candidates, then without the other; finite:
  that half is the new candidates (one bad row among 16 costs 4 replays);
- neither half alone: smaller pieces, the step without each piece and without all but each
  piece, until single rows;
- on the whole batch, neither half alone means that each half keeps the step failing on its
  own (the step without one half is the step with only the other): both hold rows to blame.
  Adaptive group testing takes over: a group shown to hold one is split, and each half is
  replayed alone (the batch without every other row); a half that still fails holds one and is
  split in turn, down to single rows, each then shown to break the step alone. A group whose
  halves are each finite alone is rows that act together, the only case where the search says
  so. The rows found are verified together at the end: the step without all of them.

It ends with a minimal set (the step is finite without it, and, one piece at a time down to single
rows, no smaller removal was; or each of its rows breaks the step alone), or where the budget or
an error stopped it; `Narrowed` says which, and what was to be tried next (`untried_text`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nanbisect.remedies.trials import rows_text

Attempt = Callable[[list[int]], str]       # rows -> "finite" | "still-failing" | "error" | "budget"


@dataclass
class Narrowed:
    """Where the search ended: ``rows`` (the step was seen finite without them; None: no
    removal made it finite), ``stop`` ("minimal"; "together": the rows found include groups
    whose rows act together, not narrowed further; "unverified": rows that each break the
    step alone were found, but the step without all of them still fails; "budget", "error"),
    ``next`` (the removal that was to be tried next, when the budget or an error stopped it),
    every removal asked, in order (``asked``: (rows, outcome)), the rows shown to break the step
    alone (``alone``) and the groups shown to act together (``together``)."""

    rows: list[int] | None
    stop: str
    next: list[int] | None = None
    asked: list[tuple[list[int], str]] = field(default_factory=list)
    alone: list[int] = field(default_factory=list)
    together: list[list[int]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.stop in ("minimal", "together", "unverified")


def _pieces(rows: list[int], n: int) -> list[list[int]]:
    """``rows`` in ``n`` consecutive pieces of (nearly) equal size, the larger first."""
    k, extra = divmod(len(rows), n)
    out, at = [], 0
    for i in range(n):
        size = k + (1 if i < extra else 0)
        out.append(rows[at:at + size])
        at += size
    return [p for p in out if p]


def narrow(attempt: Attempt, start: list[int], known: bool,
           failed: list[list[int]] = ()) -> Narrowed:
    """Narrow ``start`` (the step is finite without it when ``known``; else it is the whole
    batch) to a minimal set of rows whose removal makes the step finite; ``failed``: removals
    already seen still failing (not asked again, nor any part of them).

    >>> bad = {3, 6}
    >>> def attempt(rows): return "finite" if bad <= set(rows) else "still-failing"
    >>> found = narrow(attempt, list(range(16)), known=False)
    >>> found.rows, found.stop, len(found.asked)
    ([3, 6], 'minimal', 8)
    >>> narrow(lambda rows: "finite" if 2 in rows else "still-failing", [2, 3], True).rows
    [2]
    >>> def apart(rows): return "finite" if {3, 12} <= set(rows) else "still-failing"
    >>> found = narrow(apart, list(range(16)), known=False)     # one bad row in each half
    >>> found.rows, found.stop, found.alone, len(found.asked)
    ([3, 12], 'minimal', [3, 12], 15)
    """
    asked: list[tuple[list[int], str]] = []
    seen: dict[tuple[int, ...], str] = {}
    fails: list[set[int]] = [set(f) for f in failed]

    def ask(rows: list[int]) -> str:
        key = tuple(rows)
        if key not in seen:
            if any(set(rows) <= f for f in fails):
                return "still-failing"      # fewer rows than a removal that did not help
            out = attempt(rows)
            if out == "budget":
                return out
            seen[key] = out
            asked.append((rows, out))
            if out == "still-failing":
                fails.append(set(rows))
        return seen[key]

    cand, n = list(start), 2
    found: list[int] | None = list(start) if known else None
    while len(cand) > 1:
        pieces = _pieces(cand, n)
        tries = list(pieces)
        if len(pieces) > 2:      # with two pieces, without all but one is without the other
            tries += [[r for r in cand if r not in set(p)] for p in pieces]
        for rows in tries:
            out = ask(rows)
            if out in ("budget", "error"):
                return Narrowed(found, out, rows, asked)
            if out == "finite":
                n = 2 if rows in pieces else max(len(pieces) - 1, 2)
                cand = found = rows
                break
        else:
            if found is None:       # each half of the whole batch fails alone: both hold rows
                return _group_test(ask, cand, pieces, asked)
            if len(pieces) >= len(cand):
                break
            n = min(2 * len(pieces), len(cand))
    return Narrowed(found, "minimal", None, asked)


def _group_test(ask: Callable[[list[int]], str], batch: list[int], groups: list[list[int]],
                asked: list[tuple[list[int], str]]) -> Narrowed:
    """Adaptive group testing from ``groups`` (each shown to hold a row that breaks the step
    alone): split each, replay each half alone (``batch`` without every other row), keep the
    halves that still fail; then the step without every row found."""
    todo, alone, together = list(groups), [], []

    def only(rows: list[int]) -> list[int]:
        keep = set(rows)
        return [r for r in batch if r not in keep]

    while todo:
        group = todo.pop(0)
        if len(group) == 1:
            alone += group
            continue
        holds = []
        for half in _pieces(group, 2):
            out = ask(only(half))
            if out in ("budget", "error"):
                return Narrowed(None, out, only(half), asked, sorted(alone), together)
            if out == "still-failing":
                holds.append(half)
        if not holds:
            together.append(group)
        todo += holds
    rows = sorted(alone + [r for g in together for r in g])
    out = ask(rows)
    if out in ("budget", "error"):
        return Narrowed(None, out, rows, asked, sorted(alone), together)
    if out != "finite":
        return Narrowed(None, "unverified", None, asked, sorted(alone), together)
    return Narrowed(rows, "together" if together else "minimal", None, asked, sorted(alone),
                    together)


def untried_text(rows: list[int]) -> str:
    """The removal the budget left out, as the verified line names it.

    >>> untried_text([2]), untried_text([0, 1, 2, 3])
    ('row 2 alone not tried', 'batch rows [0-3] alone not tried')
    """
    what = f"row {rows[0]}" if len(rows) == 1 else rows_text(rows)
    return f"{what} alone not tried"
