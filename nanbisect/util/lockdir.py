"""Scratch directories whose owner is alive exactly while it holds a lock inside them.

`make` creates ``PREFIX*`` with a file ``.lock`` that the calling process holds an exclusive
``flock`` on; the kernel lets go of it when that process ends, however it ends (SIGKILL too).
`state` tells another process, in this PID namespace or another one that shares the directory
(a container, ``unshare --pid``), whether the owner is alive, with no pid involved: a pid says
nothing across namespaces, and a dead owner's pid may name an unrelated live process.

Guarantees: the lock file gets its name only once it is held, so ``.lock`` is never seen free
while its owner lives; links are not followed. Not guaranteed: file systems without ``flock``
(some network file systems) read as "held" (nothing is removed by mistake).

What is built on it (a directory for the length of a block, the sweep of dead owners' ones, a
janitor that kills an owner's processes when it dies): `nanbisect.proc.scratch`.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

LOCK = ".lock"


def make(prefix: str, dir: str | None = None) -> tuple[Path, int]:
    """A new directory ``DIR/PREFIXxxxxxxxx`` and the descriptor of its held lock; close the
    descriptor (or end the process) to let it go.

    >>> d, fd = make("nanbisect-doc-")
    >>> state(d)
    'held'
    >>> os.close(fd); state(d)
    'free'
    >>> import shutil; shutil.rmtree(d)
    """
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    fd = os.open(path / (LOCK + ".new"), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(path / (LOCK + ".new"), path / LOCK)
    except BaseException:
        os.close(fd)
        raise
    return path, fd


def state(path: str | Path) -> str:
    """``"held"`` (its owner is alive), ``"free"`` (its owner is gone) or ``"none"`` (no lock:
    written by a nanbisect before these locks, or its owner was killed between creating the
    directory and its lock; judge it by its age)."""
    try:
        fd = os.open(Path(path) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "none"
    except OSError:
        return "held"            # unreadable, a link: never removed on its account
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return "held"
    finally:
        os.close(fd)
    return "free"


def freed(path: str | Path, within: float) -> bool:
    """Whether the lock of ``path`` is free, or comes free within ``within`` seconds (an owner
    that is exiting: the kernel lets go of its lock as it closes its files, maybe a moment after
    another of them, e.g. a pipe, told a watcher it died)."""
    deadline = time.monotonic() + within
    while True:
        now = state(path)
        if now != "held" or time.monotonic() >= deadline:
            return now == "free"
        time.sleep(0.02)
