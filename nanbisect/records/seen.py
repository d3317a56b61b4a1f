"""What a replay saw: a module call's identity (`CallId`) and statistics (`Stats`), a
non-finite value (`BadValue`), how a step ended (`StepOutcome`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from nanbisect.util.recordjson import number

if TYPE_CHECKING:
    import torch


class CallId(NamedTuple):
    """The k-th call of a module in the step: the one identity every stage uses for it.

    >>> CallId("blocks.1.mlp.act", 2)
    CallId(module='blocks.1.mlp.act', call=2)
    """

    module: str     # dotted name as in named_modules(); "" = the root module
    call: int       # which call of that module in this step, from 0

@dataclass(frozen=True)
class Stats:
    """NaN/inf counts and magnitudes of the tensors at one side of a module call."""

    nan: int
    posinf: int
    neginf: int
    absmax: float           # largest finite magnitude
    abssum: float = 0.0     # sum of finite magnitudes

    @staticmethod
    def from_json(d: dict) -> "Stats":
        """The inverse of ``asdict``, the number fields read back from "nan"/"inf"."""
        return Stats(**{k: number(x) for k, x in d.items()})

    @property
    def inf(self) -> int:
        return self.posinf + self.neginf

    def bad(self, kind: str) -> bool:
        """For a NaN failure only NaN is bad (-inf is legitimate); for an inf one, both."""
        return self.nan > 0 if kind == "nan" else (self.nan + self.inf) > 0

@dataclass(frozen=True)
class BadValue:
    """A named tensor (batch leaf, parameter, gradient, ...) holding non-finite values."""

    where: str      # "batch" | "parameter" | "buffer" | "optimizer" | "grad" | "loss"
    name: str
    nan: int
    posinf: int
    neginf: int

    @property
    def kind(self) -> str:
        return "nan" if self.nan else "inf"


def before_the_step(bad: list[BadValue]) -> tuple[str, str | None]:
    """The classification of non-finite values found before the step ran, and the note that
    says why: ``data`` when the batch, a parameter or the optimizer's state holds them (what was
    fed or loaded); when only the model's buffers do, the model made them in an earlier step's
    forward (a moving average's 0/0, a running statistic), which is not data: ``unknown`` (the
    op is in that earlier step), and the note names the buffers and where to look.

    >>> before_the_step([BadValue("buffer", "vq.embed", 4, 0, 0)])[0]
    'unknown'
    >>> before_the_step([BadValue("batch", "x", 1, 0, 0), BadValue("buffer", "bn.mean", 1, 0, 0)])
    ('data', None)
    """
    if not bad or any(b.where != "buffer" for b in bad):
        return "data", None
    names = ", ".join(b.name for b in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5
                                                  else "")
    return "unknown", (
        f"only the model's buffers held non-finite values before the step ({names}): the "
        "model's own forward made them in an earlier step (a moving average, a running "
        "statistic), not the data; a Guard reads buffers with every step and bundles the step "
        "that made them")


@dataclass(frozen=True)
class StepOutcome:
    """What one replay of the step showed."""

    loss: float | None
    phase: str | None                 # first phase with non-finite values; None = clean
    bad: list[BadValue] = field(default_factory=list)
    # detached: it names the loss value (and its storage, for provenance) without keeping the
    # step's autograd graph, and every activation it holds, alive after the run
    loss_tensor: "torch.Tensor | None" = field(default=None, repr=False, compare=False)
    micro_batch: int | None = None    # the micro-batch where it failed (or stopped)
    scaler_skipped: bool = False      # the GradScaler skipped the update (not a failure)

    @property
    def kind(self) -> str | None:
        return None if not self.bad else ("nan" if any(b.nan for b in self.bad) else "inf")
