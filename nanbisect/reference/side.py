"""The reference side of a run: the same step replayed on the reference device (and dtype),
its random ops drawing what the target drew, its module statistics, and where a finite target
step first parts from it. One class for a single-process run, a rank in lockstep and a rank
replayed alone (whose collectives are served as recorded).

Guarantees: the reference runs from the same pre-step state, batch and RNG draws as the target
(`RandomReplay` of the target's `RandomTape`), with `ReferenceKernels` for ops the reference has
no kernel of; nothing here re-runs the target. Not guaranteed: that a reference at a wider dtype
computes what the target "should" have (that is the op check's question, `opcheck`).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from nanbisect.records import Divergence, StepOutcome
from nanbisect.reference.differential import (RandomReplay, RandomTape, ReferenceKernels,
                                              StepState, first_divergence, step_state)
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer, stacked


def model_dtype(rep: Replayer) -> torch.dtype:
    """The dtype of the replayed model's first parameter (float32 without parameters): the
    dtype whose tolerances a comparison of its step uses."""
    return next(rep.task.model.parameters(), torch.zeros(())).dtype


class ReferenceSide:
    """A reference replay of the step the target replayed, and what it left.

    >>> from nanbisect.bundle.format import read_bundle
    >>> b = read_bundle("fixtures/bundles/healthy")
    >>> target = Replayer(b, torch.device("cpu"))
    >>> tape = RandomTape()
    >>> first = target.run(wrap=lambda: tape)
    >>> side = ReferenceSide(Replayer(b, torch.device("cpu"), torch.float64), torch.float64,
    ...                      step_state(target, first), model_dtype(target))
    >>> side.run(tape).phase is None, side.divergence() is None
    (True, True)
    """

    def __init__(self, rep: Replayer, dtype: torch.dtype | None, target_state: StepState,
                 target_dtype: torch.dtype) -> None:
        self.rep, self.device, self.dtype = rep, rep.device, dtype
        self.target_state = target_state     # the target's step, taken before other passes
        self.target_dtype = target_dtype     # tolerances are the target's dtype's
        self.probe = ModuleProbe(rep.task.model)
        self.outcome: StepOutcome | None = None
        self.state: StepState | None = None

    @property
    def failed(self) -> bool:
        """The reference's own step went non-finite."""
        return self.outcome is not None and self.outcome.phase is not None

    def run(self, tape: RandomTape, served: tuple = (),
            around: Callable[[], ContextManager] = nullcontext) -> StepOutcome:
        """Replay the step; ``served`` modes go underneath the rest (a rank replayed alone:
        its collectives as recorded), ``around()`` wraps the whole replay."""
        with around():
            self.outcome = self.rep.run(phase=probing(self.probe), wrap=lambda: stacked(
                *served, ReferenceKernels(), RandomReplay(tape)))
        self.state = step_state(self.rep, self.outcome)
        return self.outcome

    def divergence(self) -> Divergence | None:
        """Where the target's step first parts from this one (loss, a gradient, an updated
        parameter), beyond the target dtype's tolerance; None when it does not."""
        return first_divergence(self.target_state, self.state, self.target_dtype)
