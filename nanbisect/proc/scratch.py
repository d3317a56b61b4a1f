"""A child's scratch directory, locked by its owner, and the cleanups that rely on that lock.

`locked` makes ``$TMPDIR/PREFIX*`` with ``.lock`` held (`nanbisect.util.lockdir`): the kernel
lets go of the lock when its owner ends, however it ends (SIGKILL too). `sweep` removes what a
killed owner left (its lock free), whatever pid a name holds. `watched` adds a janitor: a small
Python process without torch, in a session of its own, that waits for the lock and then kills
every process naming the directory on its command line (`processes_naming`) and removes it.

Guarantees: a directory whose lock is held is never removed by a sweep, here or from another
PID namespace sharing the directory. Not guaranteed: a kill in the few milliseconds between
creating a directory and its janitor's start leaves it for the next sweep.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from nanbisect.proc.reap import reaped, stop
from nanbisect.proc.supervisor import start_exec
from nanbisect.util import lockdir

# Waits (as a shared lock) until the owner lets go of its exclusive lock, i.e. until it ended or
# was killed; then kills every process that names the directory and removes that directory.
# Stdlib only (started with -I -S: milliseconds, no torch). The directory comes in the environment,
# not argv, so that the janitor does not name it on its own command line.
_JANITOR = r"""
import fcntl, os, shutil, signal, sys
fcntl.flock(int(sys.argv[1]), fcntl.LOCK_SH)
run = os.environ["NANBISECT_RUN_DIR"]
key = b"\0" + os.fsencode(run) + b"\0"
for pid in os.listdir("/proc"):
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as f:
            cmd = b"\0" + f.read().rstrip(b"\0") + b"\0"
            if key in cmd or key in cmd.replace(b" ", b"\0"):
                os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
shutil.rmtree(run, ignore_errors=True)
"""


@contextlib.contextmanager
def locked(prefix: str, dir: str | None = None) -> Iterator[Path]:
    """A new directory ``DIR/PREFIXxxxxxxxx`` whose lock this process holds while the block
    runs; removed (and the lock let go) when it ends, however it ends.

    >>> with locked("nanbisect-doc-") as d:
    ...     lockdir.state(d)
    'held'
    """
    path, fd = lockdir.make(prefix, dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def processes_naming(path: Path) -> list[int]:
    """The live processes (this one aside) that name ``path`` as one of their arguments: in
    their command line, or in the title a fork server's child shows instead (the arguments
    joined by spaces)."""
    key, out = b"\0" + os.fsencode(str(path)) + b"\0", []
    for d in (Path("/proc").iterdir() if Path("/proc").is_dir() else []):
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = b"\0" + (d / "cmdline").read_bytes().rstrip(b"\0") + b"\0"   # zombies: empty
            if key in cmd or key in cmd.replace(b" ", b"\0"):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_named(path: Path, within: float = 5.0) -> None:
    """SIGKILL every process naming ``path`` (`processes_naming`), until none is left
    (``within`` seconds at most)."""
    deadline = time.monotonic() + within
    while True:
        left = processes_naming(path)
        _kill(left)
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _old(path: str, age: float) -> bool:
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime >= age
    except OSError:
        return False


def sweep(pattern: str, tmp: Path | str | None = None, *, unlocked_after: float | None = None,
          kill: bool = False) -> list[Path]:
    """Remove the directories of ``tmp`` (default: the temporary directory) whose name matches
    ``pattern`` (a regular expression, whole name) and whose owner is gone: its lock free
    (held while they are removed), or, with ``unlocked_after``, no lock and older than that
    many seconds (an older nanbisect's, or killed before its lock existed). ``kill``: first
    kill every process still naming it. Returns what it removed."""
    base = Path(tmp or tempfile.gettempdir())
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    removed = []
    for e in entries:
        if not re.fullmatch(pattern, e.name) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(Path(e.path) / lockdir.LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        except OSError:
            continue                    # unreadable, a link: never removed on its account
        if fd is None and (unlocked_after is None or not _old(e.path, unlocked_after)):
            continue
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue                    # its owner is alive, here or in another PID namespace
        try:
            if kill:
                _kill(processes_naming(Path(e.path)))
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _janitor(path: Path) -> subprocess.Popen:
    """Start the janitor of ``path`` (its lock's own open file, shared-locked once free)."""
    watch = os.open(path / lockdir.LOCK, os.O_RDONLY)
    try:
        return start_exec([sys.executable, "-I", "-S", "-c", _JANITOR, str(watch)],
                          pass_fds=(watch,), env={**os.environ, "NANBISECT_RUN_DIR": str(path)},
                          start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    finally:
        os.close(watch)


@contextlib.contextmanager
def watched(prefix: str) -> Iterator[Path]:
    """A `locked` directory that a janitor watches for as long as the block runs (the
    directories of dead owners with the same prefix swept first, their processes killed):
    when this process ends, however it ends, every process naming it is killed and it is
    removed."""
    sweep(re.escape(prefix) + ".*", kill=True)
    path, fd = lockdir.make(prefix)
    janitor = None
    try:
        janitor = _janitor(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)            # lets the janitor go: it finds nothing left, and exits
        if janitor is not None:
            with reaped(janitor):       # interrupted: ended and reaped, the interrupt goes on
                try:
                    janitor.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    stop(janitor)
