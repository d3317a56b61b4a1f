"""The lifeline: a child ends with its starter, whatever kills the starter.

- `guard_group`: the child dies with its parent (Linux ``PR_SET_PDEATHSIG``) and forks a
  guardian holding the read end of a pipe whose write end only the starter has: when the
  starter is done with it or dies (SIGKILL too), the read returns EOF and the guardian kills the
  child's whole process group, then runs a cleanup (what a starter killed by SIGKILL cannot).
- `exit_when_free`: a thread that waits for the starter's lock on a `locked` directory to come
  free (it ended, or it was killed: the kernel lets go of a dead process's locks), then cleans
  up and ends this process;
- `exit_when_orphaned`: a thread that, once this process's parent is gone (its ``getppid``
  changed), kills the children this process supervises (a `Processes`) and ends it.

Not guaranteed: ``PR_SET_PDEATHSIG`` exists on Linux only; elsewhere the guardian alone acts.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from nanbisect.proc.processes import Processes


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))     # PR_SET_PDEATHSIG


def guard_group(fd: int, starter: int,
                cleanup: Callable[[bytes], None] = lambda said: None) -> None:
    """Called first in a child that leads its own process group (a session of its own),
    started by ``starter`` (a pid) with the read end ``fd`` of the starter's pipe: the child
    dies with its parent, and a guardian kills the group once ``fd`` reads EOF, then calls
    ``cleanup(said)`` (``said``: the first bytes the starter wrote, e.g. ``b"done"`` before a
    finish; nothing when it died). Exit 125 at once when the starter died already."""
    _die_with_parent()
    if os.getppid() != starter:         # it died before the line above
        os._exit(125)
    group = os.getpgrp()
    if os.fork() == 0:
        said = b""
        try:
            os.setpgid(0, 0)            # out of the group it is about to kill
            os.closerange(0, fd)
            while chunk := os.read(fd, 4096):
                said += chunk[:16]
        except BaseException:  # noqa: BLE001 - whatever happens, the group goes
            pass
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(BaseException):
            cleanup(said)
        os._exit(0)
    os.close(fd)


def exit_when_free(directory: Path, cleanup: Callable[[], None] = lambda: None) -> None:
    """End this process (exit 1, after ``cleanup()``) once the owner of ``directory`` (a
    `nanbisect.proc.locked` one) lets go of its lock; at once, without ``cleanup``, when there
    is no lock (the owner is gone already and took its directory with it). Watches from a
    daemon thread that blocks without the GIL."""
    try:
        fd = os.open(directory / ".lock", os.O_RDONLY)
    except OSError:
        os._exit(1)

    def wait() -> None:
        fcntl.flock(fd, fcntl.LOCK_SH)    # blocks (without the GIL) while the owner lives
        cleanup()
        os._exit(1)

    threading.Thread(target=wait, name="nanbisect-owner-watch", daemon=True).start()


_orphan_watch: list[int] = []      # the parent watched for, once per process


def exit_when_orphaned(parent: int, children: Processes, code: int = 70,
                       every: float = 0.2) -> bool:
    """When this process is a child of ``parent``: a daemon thread that, once ``parent`` is gone
    (kill -9 included: this process is handed to another parent), kills ``children`` (SIGKILL,
    their process groups) and ends this process with ``code``, instead of waiting for them.
    Started once per process; False (nothing started) when this process is not ``parent``'s
    child (a cluster's worker) or is watched already."""
    if _orphan_watch or os.getppid() != parent:
        return False
    _orphan_watch.append(parent)

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        children.kill()
        os._exit(code)

    threading.Thread(target=loop, name="nanbisect-orphan-watch", daemon=True).start()
    return True
