"""The reference side of a run: the same step replayed on the reference device (and dtype),
its random ops drawing what the target drew, its module statistics, and where a finite target
step first parts from it. One class for a single-process run, a rank in lockstep and a rank
replayed alone (whose collectives are served as recorded: ``served``); the chain builds and runs
it (`nanbisect.chain.Chain.reference_side`, `Chain.reference`). It crosses into the callers of the
chain (``pipeline``, ``multirank``) as an in-process object (it holds a replayer): never
serialised; a rank writes what it found as a `RankReference` record.

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
    """A reference replay of the step the target replayed, and what it left. Built by the
    chain (`nanbisect.chain.Chain.reference_side`) on a replayer of the reference device;
    ``served``: modes that go underneath the rest of every replay (a rank replayed alone: its
    collectives as recorded), ``around()``: what wraps the whole replay (that rank's server
    not checking the reference's inputs against the capture's, which differ).

    >>> from nanbisect.bundle.format import read_bundle
    >>> b = read_bundle("fixtures/bundles/healthy")
    >>> target = Replayer(b, torch.device("cpu"))
    >>> tape = RandomTape()
    >>> first = target.run(wrap=lambda: tape)
    >>> side = ReferenceSide(Replayer(b, torch.device("cpu"), torch.float64))
    >>> side.run(tape, step_state(target, first), model_dtype(target)).phase is None
    True
    >>> side.divergence() is None
    True
    """

    def __init__(self, rep: Replayer, served: tuple = (),
                 around: Callable[[], ContextManager] = nullcontext) -> None:
        self.rep, self.device, self.dtype = rep, rep.device, rep.dtype
        self.served, self.around = served, around
        self.probe = ModuleProbe(rep.task.model)
        self.target_state: StepState | None = None   # the target's step, taken before other passes
        self.target_dtype: torch.dtype | None = None  # tolerances are the target's dtype's
        self.outcome: StepOutcome | None = None
        self.state: StepState | None = None

    @property
    def failed(self) -> bool:
        """The reference's own step went non-finite."""
        return self.outcome is not None and self.outcome.phase is not None

    def run(self, tape: RandomTape, target_state: StepState, target_dtype: torch.dtype
            ) -> StepOutcome:
        """Replay the step, its random ops drawing what ``tape`` kept; ``target_state``: the
        target's step it is compared with, at ``target_dtype``'s tolerances."""
        self.target_state, self.target_dtype = target_state, target_dtype
        with self.around():
            self.outcome = self.rep.run(phase=probing(self.probe), wrap=lambda: stacked(
                *self.served, ReferenceKernels(), RandomReplay(tape)))
        self.state = step_state(self.rep, self.outcome)
        return self.outcome

    def divergence(self) -> Divergence | None:
        """Where the target's step first parts from this one (loss, a gradient, an updated
        parameter), beyond the target dtype's tolerance; None when it does not."""
        return first_divergence(self.target_state, self.state, self.target_dtype)
