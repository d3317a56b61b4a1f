"""Progress on stderr for `nanbisect run` and `nanbisect triage`, drawn with rich.

Guarantees:
- Drawn only when stderr is a terminal (not ``TERM=dumb``) and the command was not given
  ``--quiet``; otherwise nothing at all is written (no line, no control character) and rich is
  not imported: a piped, CI or nightly stderr holds exactly what it held without progress.
- One line, redrawn in place and erased when the command ends (the summary that follows is
  unchanged). While it is drawn, what the process writes to ``sys.stderr`` (warnings, the user
  code's prints) is printed above it; so is ``sys.stdout`` when stdout is the terminal too (a
  piped stdout is left alone: it keeps only what the command prints there).
- `run_progress`'s callback takes the pipeline's ``progress(key, text)``
  (`nanbisect.pipeline.run.STAGES`) and shows the stage in words (`STAGE_WORDS`), the pass's own
  text, how many replays of the step are done and the time since the start. `triage_progress`'s
  takes ``(done, total)`` (`nanbisect.nightly.triage`'s ``progress``) and shows a bar, the
  bundles done of the total, the time elapsed and an estimate of the time left.
- The callbacks never raise (a display that fails stops drawing; the command goes on).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterator

# The stage of each key of `nanbisect.pipeline.run.STAGES`, in words (what the line starts with)
STAGE_WORDS = {
    "steps": "replaying steps", "build": "building the task", "module-pass": "module bisection",
    "compiled": "compiled replay", "reference": "reference replay",
    "op-recording": "op bisection", "cross-phase": "op bisection", "isolate": "op bisection",
    "input-catch": "catching inputs", "compiler-bisect": "compiler bisection", "repro": "repro",
    "module-repro": "repro", "op-check": "op check", "culprit": "culprit found",
    "remedies": "remedies",
    "surfaced-repro": "repro", "report": "report", "ranks": "ranks"}

# The keys whose pass replays the whole step once (counted as "replays done" once it ends)
REPLAYS = frozenset({"module-pass", "compiled", "reference", "op-recording", "cross-phase",
                     "input-catch", "remedies", "surfaced-repro", "module-repro"})


def shown(quiet: bool, stream=None) -> bool:
    """Is progress drawn on ``stream`` (default stderr): a terminal, not ``TERM=dumb``, and not
    ``--quiet``?"""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError, OSError):    # closed, replaced by a non-file
        tty = False
    return tty and not quiet and os.environ.get("TERM") != "dumb"


def _bar(*columns):
    """A transient rich `Progress` on stderr with ``columns``."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), transient=True,
                    redirect_stdout=shown(False, sys.stdout), redirect_stderr=True)


def _safe(draw: Callable, stop: Callable[[], None]) -> Callable:
    """``draw``, which never raises: on its first failure the display stops for good."""
    broken = []

    def call(*args) -> None:
        if broken:
            return
        try:
            draw(*args)
        except Exception:  # noqa: BLE001 - progress must never end the command
            broken.append(True)
            with contextlib.suppress(Exception):
                stop()
    return call


class _RunLine:
    """`run`'s line: a spinner, the time since the start, the replays of the step done, and
    the stage with its pass's text; one line, cut short with "..." on a narrow terminal."""

    def __init__(self) -> None:
        from rich.spinner import Spinner

        self.spinner = Spinner("dots", style="green")
        self.start = time.monotonic()
        self.text = "reading the bundle"
        self.started: list[str] = []        # the replay keys announced so far
        self.done = 0                       # the replays of the step ended

    def stage(self, key: str, text: str) -> None:
        """The pipeline announced the pass ``key`` (``text``): the one before it has ended."""
        self.done = len(self.started)
        if key in REPLAYS:
            self.started.append(key)
        words = STAGE_WORDS.get(key, key)
        self.text = text if text.startswith(words) else f"{words}: {text}"

    def __rich__(self):
        from rich.text import Text

        s = int(time.monotonic() - self.start)
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append_text(self.spinner.render(time.monotonic()))
        line.append(f" {s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}", style="yellow")
        line.append(f" [{self.done} replay{'' if self.done == 1 else 's'} done] ", style="dim")
        line.append(self.text)
        return line


@contextlib.contextmanager
def run_progress(quiet: bool = False) -> Iterator[Callable[[str, str], None]]:
    """The ``progress(key, text)`` callback of `nanbisect.pipeline.run_bundle`, drawing the
    current stage (see the module's guarantees); a no-op callback when not `shown`."""
    if not shown(quiet):
        yield lambda key, text: None
        return
    from rich.console import Console
    from rich.live import Live

    line = _RunLine()
    live = Live(line, console=Console(stderr=True), transient=True, refresh_per_second=10,
                redirect_stdout=shown(False, sys.stdout), redirect_stderr=True)

    def draw(key: str, text: str) -> None:
        line.stage(key, text)
        live.refresh()          # every stage drawn, however short

    with live:
        yield _safe(draw, live.stop)


@contextlib.contextmanager
def triage_progress(quiet: bool = False) -> Iterator[Callable[[int, int], None]]:
    """The ``progress(done, total)`` callback of `nanbisect.nightly.triage`: a bar with the
    bundles done of the total, the time elapsed and the estimated time left (see the module's
    guarantees); a no-op callback when not `shown`."""
    if not shown(quiet):
        yield lambda done, total: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    bar = _bar(TextColumn("triage"), BarColumn(), MofNCompleteColumn(), TextColumn("bundles"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    task = bar.add_task("triage", total=None)

    def draw(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total, refresh=True)

    with bar:
        yield _safe(draw, bar.stop)
