"""Which batch rows to remove to make the step finite, narrowed to a minimal set (`narrow`).

The search asks one question, "is the step finite without these rows?", each answer a replay
(``attempt``: "finite", "still-failing", "error", or "budget" when no replay is left), and
assumes that removing more of the rows to blame never brings the failure back. It starts from the
rows the op tracing named (``culprit.samples``) when there are some and the step is finite
without them, else from the whole batch, and then removes what is not needed (delta debugging,
rows kept in order; a removal of fewer rows than one that did not help is not replayed):

- halves first: the step without one half of the candidates, then without the other; finite:
  that half is the new candidates (one bad row among 16 costs 4 replays);
- neither half alone (the rows act together): smaller pieces, the step without each piece and
  without all but each piece, until single rows;
- on the whole batch (not known to be finite without all of it) neither half alone ends the
  search: the failure does not come from a few rows.

It ends with a minimal set (the step is finite without it, and, one piece at a time down to single
rows, no smaller removal was), or where the budget or an error stopped it; `Narrowed` says which,
and what was to be tried next (`untried_text`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nanbisect.remedies.trials import rows_text

Attempt = Callable[[list[int]], str]       # rows -> "finite" | "still-failing" | "error" | "budget"


@dataclass
class Narrowed:
    """Where the search ended: ``rows`` (the step was seen finite without them; None: no
    removal made it finite), ``stop`` ("minimal", "neither half", "budget", "error"), ``next``
    (the removal that was to be tried next, when the budget or an error stopped it) and every
    removal asked, in order (``asked``: (rows, outcome))."""

    rows: list[int] | None
    stop: str
    next: list[int] | None = None
    asked: list[tuple[list[int], str]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.stop in ("minimal", "neither half")


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
            if found is None:
                return Narrowed(None, "neither half", None, asked)
            if len(pieces) >= len(cand):
                break
            n = min(2 * len(pieces), len(cand))
    return Narrowed(found, "minimal", None, asked)


def untried_text(rows: list[int]) -> str:
    """The removal the budget left out, as the verified line names it.

    >>> untried_text([2]), untried_text([0, 1, 2, 3])
    ('row 2 alone not tried', 'batch rows [0-3] alone not tried')
    """
    what = f"row {rows[0]}" if len(rows) == 1 else rows_text(rows)
    return f"{what} alone not tried"
