"""The private directory of one multi-rank run (``$TMPDIR/nanbisect-ranks-*``), its lock and its
janitor (`nanbisect.proc.watched`): every process of the run names the directory on its command
line, so when the run ends, fails, times out or its launcher is killed (even by SIGKILL) they
are all killed and the directory removed (`run_dir`, `sweep`). The guarantees are `launcher`'s.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanbisect import proc
from nanbisect.proc import processes_naming as run_processes

PREFIX = "nanbisect-ranks-"

__all__ = ["PREFIX", "kill_run", "run_dir", "run_processes", "sweep"]


def kill_run(spawner, partial: Path) -> None:
    """SIGKILL the spawner's session (its ranks are in it) and reap it, then every process of
    the run (one that left the session too), until none is left (5 s at most)."""
    proc.stop(spawner, within=5)
    proc.kill_named(partial, within=5)


def sweep(tmp: Path | None = None) -> list[Path]:
    """Remove the run directories of runs that are gone (their lock is free): a launcher and its
    janitor both killed at once. Returns what it removed."""
    return proc.sweep(re.escape(PREFIX) + ".*", tmp, kill=True)


@contextmanager
def run_dir() -> Iterator[Path]:
    """PARTIAL, locked by this process and watched by a janitor for as long as the block runs."""
    with proc.watched(PREFIX) as partial:
        yield partial
