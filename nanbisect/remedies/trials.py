"""The remedies' replays of the step (`Trials`: one change each, counted against the budget,
every change undone after its replay) and the budget itself (`budget`: ``--remedy-budget``,
``NANBISECT_REMEDY_BUDGET``, `DEFAULT_BUDGET`)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

from nanbisect.records import Remedy, StepOutcome
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.util.numbers import NUMBERS, env
from nanbisect.util.text import error_record

DEFAULT_BUDGET = 4
BUDGET_ENV = "NANBISECT_REMEDY_BUDGET"


def budget(requested: int | None = None) -> int:
    """The run's budget of extra replays: ``requested`` (``--remedy-budget``, 0 with
    ``--no-remedies``), else ``NANBISECT_REMEDY_BUDGET`` (a nightly triage's children read it),
    else `DEFAULT_BUDGET`; `BadInput` for a value that is not a count.

    >>> budget(0), budget(3)
    (0, 3)
    """
    if requested is not None:
        return NUMBERS["--remedy-budget"].check(requested, "run")
    return env(BUDGET_ENV, DEFAULT_BUDGET)


Progress = Callable[[str, str], None]


class Trials:
    """Replays of the step, one change each, counted against the budget."""

    def __init__(self, rep: Replayer, wrap: Callable[[], ContextManager], budget: int,
                 judge: str, progress: Progress) -> None:
        self.rep, self.wrap, self.budget, self.judge = rep, wrap, budget, judge
        self.progress = progress
        self.used = 0

    @property
    def left(self) -> int:
        return self.budget - self.used

    def spent(self, kind: str, change: str) -> Remedy:
        return Remedy(kind, change, "skipped", detail={
            "reason": f"the budget of {self.budget} extra replay(s) of the step was spent "
                      "(raise it with --remedy-budget)"})

    def replay(self, change: str, *, edit: Callable[[Any], Any] | None = None,
               modes: Callable[[], list] = list, on_optimizer: Callable[[], None] | None = None,
               clip: float | None = None, around: Callable[[], ContextManager] = nullcontext
               ) -> tuple[str, float | None, dict]:
        """(outcome, loss, detail) of the step replayed with one change."""
        self.used += 1
        self.progress("remedies", f"remedy replay {self.used}/{self.budget}: the step {change}")
        rep, task = self.rep, self.rep.task
        saved_clip = task.clip_grad_norm
        if edit is not None:
            rep.batch_edits.append(edit)
        ms = modes()

        def phase(name: str) -> ContextManager:
            for m in ms:
                if hasattr(m, "phase"):
                    m.phase = name
            if name == "optimizer" and on_optimizer is not None:
                on_optimizer()
            return nullcontext()
        try:
            if clip is not None:
                task.clip_grad_norm = clip
            with around():
                out: StepOutcome = rep.run(phase=phase, wrap=lambda: stacked(self.wrap(), *ms),
                                           stop_after=self.judge)
        except Exception as e:  # noqa: BLE001 - a change the user's code cannot take: an outcome
            return "error", None, error_record(e)
        finally:
            task.clip_grad_norm = saved_clip
            if edit is not None:
                rep.batch_edits.remove(edit)
        if out.phase is None and out.scaler_skipped:    # no update: not a healthy step
            return "still-failing", out.loss, {"phase": "backward", "scaler_skipped": True}
        if out.phase is None:
            return "finite", out.loss, {}
        return "still-failing", out.loss, {"phase": out.phase}


def rows_text(rows: list[int]) -> str:
    """Batch rows as a change names them: runs of consecutive rows as ranges.

    >>> rows_text([5]), rows_text([0, 1, 2, 3, 9])
    ('batch rows [5]', 'batch rows [0-3, 9]')
    """
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    text = ", ".join(parts)
    if len(text) > 80:
        text = text[:80].rsplit(", ", 1)[0] + f", ... ({len(rows)} rows)"
    return f"batch rows [{text}]"
