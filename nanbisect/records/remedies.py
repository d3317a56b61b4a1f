"""What was tried, by replaying the step, to make a failing step finite (`Remedy`), and which
batch rows the first bad value depends on (`RowTrace`).

A remedy is never a suggestion: every entry says what the replay with that change gave
(``finite``, ``still-failing``, ``error``) or why it was not replayed (``skipped``: not applicable
here, or the budget of replays was spent).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from nanbisect.util.recordjson import number

KINDS = ("precision", "samples", "state", "optimizer")
OUTCOMES = ("finite", "still-failing", "error", "skipped")


@dataclass(frozen=True)
class Remedy:
    """One change tried on the step and what came of it.

    ``change`` is phrased to follow "the step is finite" / "the step still fails" (e.g. "without
    batch rows [5]", "when module extra (call 0) runs in float32"); ``loss`` is the step's loss
    with the change when it was finite; ``detail`` holds what a machine needs (the rows and how
    they were found, the dtype, the reason a remedy was skipped, the error).

    >>> r = Remedy("samples", "without batch rows [5]", "finite", 0.25, {"rows": [5]})
    >>> r.sentence(), r.to_json()["outcome"]
    ('the step is finite without batch rows [5]', 'finite')
    >>> Remedy("samples", "without batch rows [2, 3]", "finite", 0.25, {
    ...     "rows": [2, 3], "complete": False,
    ...     "note": "narrowed to 2 rows; row 2 alone not tried"}).sentence()
    'the step is finite without batch rows [2, 3] (narrowed to 2 rows; row 2 alone not tried)'
    """

    kind: str
    change: str
    outcome: str
    loss: float | None = None
    detail: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"remedy outcome {self.outcome!r} is not one of {OUTCOMES}")
        if self.loss is not None and not math.isfinite(self.loss):
            object.__setattr__(self, "loss", None)      # JSON: a finite float or null

    @property
    def finite(self) -> bool:
        return self.outcome == "finite"

    def sentence(self) -> str:
        """The remedy in words: what the replay with the change showed."""
        if self.outcome == "finite":
            # a search the budget (or an error) ended: how far it got, on the same line
            unfinished = self.detail.get("note") if self.detail.get("complete") is False \
                else None
            return f"the step is finite {self.change}" + (f" ({unfinished})" if unfinished
                                                           else "")
        if self.outcome == "still-failing":
            return f"the step still fails {self.change}"
        if self.outcome == "error":
            return f"the step {self.change} could not be replayed: {self.detail.get('error')}"
        return f"not tried: the step {self.change} ({self.detail.get('reason', 'skipped')})"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Remedy":
        return Remedy(d["kind"], d.get("change", ""), d["outcome"], number(d.get("loss")),
                      dict(d.get("detail") or {}))


@dataclass(frozen=True)
class RowTrace:
    """Which rows of the batch (indices along dim 0 of its tensors) the culprit's first bad value
    depends on, traced through the ops; ``samples`` None when they cannot be (``why`` says
    why: a reduction over the batch, a value made from the model's state alone, ...).
    ``reached``: those of them whose bad value the trace followed, on its own, to the first op
    that mixes rows and made a bad value of them (``reached_at``: that op and its phase); None
    when the trace did not follow them that far."""

    samples: list[int] | None
    rows: int | None                 # the batch's rows (None: no tensor with a row dim)
    why: str | None = None           # why ``samples`` is None
    reached: list[int] | None = None
    reached_at: str | None = None
