"""How each rank came to hold the failure, from every rank's crossings (`multirank.ledger`): the
rule of birth applied to the ops between ranks, with every rank's side of them on the table.

Pure functions over the exchanged records (no torch.distributed, no tensors): tested
in-process.

- A rank whose first non-finite crossing already had non-finite input (or that failed in an
  earlier phase than any crossing) **computed** the value itself; so did a rank where an op of a
  comm hook made it from finite input (the cast of a float16 compression, a division).
- A rank whose first non-finite crossing is a collective fed finite values by this rank
  **received** it, from the ranks of the group that fed it non-finite values; a receive
  (point to point) from the rank whose send of that message carried them.
- When no rank of the group fed it non-finite values, the value was **born in the collective**
  (`born-in-collective`): with a float16 sum that is an overflow of the reduction.
"""
from __future__ import annotations

from nanbisect.records import Crossing, RankPath, RankSummary
from nanbisect.util.text import ranks_text

ORDER = {"input": 0, "forward": 1, "backward": 2, "grad-reduce": 3, "optimizer": 4}
# a rank's failing phase as its first pass saw it: gradients are read after their reduction,
# so a "backward" failure may come out of the gradient reduction
_SEEN = {**ORDER, "grad-reduce": ORDER["backward"]}


def _fed(summaries: dict[int, RankSummary], c: Crossing, keep: int) -> list[int] | None:
    """The ranks of ``c``'s group that fed ``c`` (the same collective: `Crossing.same`)
    non-finite values; None when a rank's side of it is unknown (that rank kept its `KEEP`
    entries before reaching it)."""
    from nanbisect.multirank.ledger import KEEP

    fed = []
    for r in (c.group if c.group is not None else sorted(summaries)):
        s = summaries.get(r)
        if s is None:
            return None
        mine = next((x for x in s.crossings if x.collective and x.same(c)), None)
        if mine is None:
            if len(s.crossings) >= (keep or KEEP):
                return None
            continue          # nothing non-finite went in or came out there
        if mine.in_bad:
            fed.append(r)
    return fed


def _earlier(a: str | None, b: str | None) -> str | None:
    """The earlier of two phases (a pipeline stage sends a value it made in forward before its
    own gradients, where its first pass saw the failure, went bad)."""
    if a is None or b is None:
        return a or b
    return a if _SEEN.get(a, 9) <= _SEEN.get(b, 9) else b


def rank_path(summary: RankSummary, summaries: dict[int, RankSummary], keep: int = 0
              ) -> RankPath:
    """How ``summary``'s rank came to hold its failure (see the module's rules)."""
    first = next((c for c in summary.crossings if c.out_bad), None)
    failed = summary.phase
    if failed == "input":    # it held the values before the step: it neither made nor got them
        return RankPath(None, phase=failed)
    if first is None:
        return RankPath("computed" if failed not in (None, "input") else None, phase=failed)
    if failed is not None and _SEEN.get(failed, 9) < _SEEN.get(first.phase, 9):
        return RankPath("computed", phase=failed)     # it failed before anything crossed
    if first.in_bad:     # it fed the crossing what it had made: by then at the latest
        return RankPath("computed", phase=_earlier(failed, first.phase))
    if not first.collective:     # an op of a comm hook or of FSDP's reduction made it
        return RankPath("computed", first, phase=failed)
    fed = _fed(summaries, first, keep)
    if fed is None:
        return RankPath("received", first, phase=failed)
    others = [r for r in fed if r != summary.rank]
    if others:
        return RankPath("received", first, others, phase=failed)
    return RankPath("born-in-collective", first, phase=failed)


def rank_paths(summaries: list[RankSummary | None], keep: int = 0) -> dict[int, RankPath]:
    """Every rank's `RankPath` (ranks with no summary left out)."""
    by = {s.rank: s for s in summaries if s is not None}
    return {r: rank_path(s, by, keep) for r, s in sorted(by.items())}


def birth(paths: dict[int, RankPath]) -> tuple[str, list[int], Crossing | None]:
    """Where the failure was born across the job: ("computed", ranks, the hook op or None),
    ("collective", ranks that saw it born there, the collective) or ("none", [], None); the
    earlier phase wins, and within one, a rank's computation before a collective's output."""
    born = [(ORDER.get(p.via.phase if p.via else p.phase or "", 9),
             0 if p.how == "computed" else 1, r, p)
            for r, p in paths.items() if p.how in ("computed", "born-in-collective")]
    if not born:
        return "none", [], None
    born.sort(key=lambda x: x[:3])
    _, _, _, p = born[0]
    if p.how == "computed":     # the ranks that made it the same way (in the same phase)
        def where(q: RankPath) -> str | None:
            return q.via.phase if q.via is not None else q.phase
        return "computed", [r for r, q in paths.items() if q.how == "computed"
                            and where(q) == where(p)], p.via
    return "collective", [r for r, q in paths.items() if q.how == p.how and q.via is not None
                          and q.via.same(p.via)], p.via


def overflow_words(c: Crossing, summaries: list[RankSummary | None]) -> str:
    """The words for a low-precision overflow at ``c``: the dtype's limit and the largest
    finite value each rank fed it."""
    fed = []
    for s in summaries:
        if s is None:
            continue
        mine = next((x for x in s.crossings if x.collective and x.same(c)), None)
        if mine is not None and mine.in_absmax is not None:
            fed.append(f"rank {s.rank} {mine.in_absmax:.6g}")
    limit = {"float16": "65504"}.get(c.dtype, "its largest finite value")
    what = f"the {c.dtype} {c.reduce or 'result'}" if c.collective else f"the {c.dtype} result"
    return (f"{what} overflowed (over {limit})"
            + (f"; the largest magnitudes fed in: {', '.join(fed[:8])}" if fed else ""))


def received_words(p: RankPath) -> str:
    """"received it through c10d.alltoall_base_.default in moe call 0, in forward, from rank 1"
    (what follows a rank's name)."""
    v = p.via
    src = f", from {ranks_text(p.from_ranks)}" if p.from_ranks else ""
    return f"received it through {v.where()}{src}" if v else "received it"


def grouped(said: list[tuple[int, str]]) -> list[str]:
    """``(rank, what)`` pairs as phrases, the ranks that share a ``what`` named together ("ranks
    0, 2-999 (999 ranks) received it through ..."): bounded by the paths, not the world size.

    >>> grouped([(0, "received it"), (2, "received it"), (3, "computed it")])
    ['ranks 0, 2 (2 ranks) received it', 'rank 3 computed it']
    """
    by: dict[str, list[int]] = {}
    for rank, what in said:
        by.setdefault(what, []).append(rank)
    return [f"{ranks_text(rs)} {what}" for what, rs in by.items()]
