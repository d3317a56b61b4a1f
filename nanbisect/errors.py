"""Exceptions that cross module boundaries.

`BadInput` carries a one-line message that names the problem and the fix; the CLI prints it and
exits 2 without a traceback. `NonFiniteStep` is what `Guard` raises after writing a bundle (or
after failing to write one anywhere: ``bundle`` None).
"""
from __future__ import annotations

import signal
from pathlib import Path

from nanbisect.util.text import ranks_arg


def signal_name(num: int) -> str:
    """``SIGSEGV`` for 11: how a process that a signal ended is named in one-line errors."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


class BadInput(Exception):
    """A bundle, path, entry or flag the user gave is unusable.

    The message must say what is wrong and what to do, e.g.
    ``BadInput("bundle 'x': manifest.json is missing; pass a directory written by
    nanbisect.capture")``.
    """


# The fix for a stall of steps skipped with no GradScaler declared on the Task (observed
# ``undeclared_scaler``): said by `NonFiniteStep` and by the report of its bundle.
UNDECLARED_SCALER = ("the loop skipped its updates (non-finite gradients, parameters unchanged) "
                     "with no GradScaler declared on the Task: if it scales its loss with one, "
                     "declare it (Task(grad_scaler=scaler)) so that replays scale the loss as "
                     "the loop does")


class NonFiniteStep(RuntimeError):
    """A guarded training step produced a non-finite loss, gradient or parameter.

    ``bundle`` is the directory that replays the failing step from its pre-step state (under
    torchrun, a bundle whose top manifest has ``partial`` lacks the parts of the ranks that
    could not write theirs; ``ranks`` then lists the ranks it holds, and the message says to
    replay them with ``--ranks``). It is None when no bundle could be written anywhere, not even
    in the rescue directory: ``error`` (also in the message) then says why. ``observed`` is what
    the guard saw (also stored in the bundle's manifest).
    """

    def __init__(self, bundle: Path | None, observed: dict, error: str | None = None,
                 ranks: list[int] | None = None):
        self.bundle = Path(bundle) if bundle is not None else None
        self.observed = observed
        self.error = error
        what = ", ".join(f"{k}={v}" for k, v in observed.get("summary", {}).items())
        held = (f" --ranks {ranks_arg(ranks)} (a partial bundle: the other ranks could "
                "not write their parts)" if ranks else "")
        then = (f"replay it with: nanbisect run {self.bundle}{held}"
                if self.bundle is not None
                else f"no bundle could be written: {error or 'see the warnings above'}")
        fix = (f"; {UNDECLARED_SCALER}" if observed.get("undeclared_scaler") else "")
        # a rank that did not meet one of the Guard's waits: this rank's part was written alone
        met = (f"; {observed['rank_timeout']}; this rank's part was written alone"
               if observed.get("rank_timeout") else "")
        super().__init__(f"non-finite training step {observed.get('step')}: "
                         f"{what or 'see manifest'}{fix}{met}; {then}")


class TopLevelOptIn(UserWarning):
    """A replay is about to run its entry's top level because the bundle's manifest says so
    (``Task(run_top_level=True)`` recorded at capture): said, in one line, before it runs."""


class TaskNotFromEntry(UserWarning):
    """A capture's Task holds parts its entry cannot rebuild (a ``loss_fn`` or model class
    defined in a notebook cell or an interactive ``__main__``): a replay runs the entry's code
    instead. Said in one line at capture; the replay compares what the entry builds
    (`nanbisect.util.fingerprint`) and its report says which code ran."""
