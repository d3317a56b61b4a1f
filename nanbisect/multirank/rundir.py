"""The private directory of one multi-rank run (``$TMPDIR/nanbisect-ranks-*``), its lock and its
janitor: every process of the run names the directory on its command line, so when the run ends,
fails, times out or its launcher is killed (even by SIGKILL) they are all killed and the
directory removed (`run_dir`, `sweep`). The guarantees are `launcher`'s.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanbisect.util.forks import reaped, stop

PREFIX = "nanbisect-ranks-"

# Waits (as a shared lock) until the launcher lets go of its exclusive lock, i.e. until it ended or
# was killed; then kills every process that names the run's directory and removes that directory.
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


def run_processes(partial: Path) -> list[int]:
    """The live processes that name ``partial`` as one of their arguments (the spawner, the
    ranks): in their command line, or in the title a fork server's child shows instead
    (`nanbisect.util.forks`: the arguments joined by spaces)."""
    key, out = b"\0" + os.fsencode(str(partial)) + b"\0", []
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


def _kill_run(p: subprocess.Popen, partial: Path) -> None:
    """SIGKILL the spawner's session (its ranks are in it) and every process of the run (one
    that left the session too), then wait until none is left (5 s at most)."""
    if p.poll() is None:    # not reaped yet: its pid is still its own
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 5
    while True:
        left = run_processes(partial)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def sweep(tmp: Path | None = None) -> list[Path]:
    """Remove the run directories of runs that are gone (their lock is free): a launcher and its
    janitor both killed at once. Returns what it removed."""
    removed = []
    for lock in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*/.lock"):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue            # its launcher (or a rank of it) is alive
        try:
            for pid in run_processes(lock.parent):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            shutil.rmtree(lock.parent, ignore_errors=True)
            removed.append(lock.parent)
        finally:
            os.close(fd)
    return removed


@contextmanager
def run_dir() -> Iterator[Path]:
    """PARTIAL, locked by this process and watched by a janitor for as long as the block runs."""
    sweep()
    partial = Path(tempfile.mkdtemp(prefix=PREFIX))
    fd, janitor = None, None
    try:
        # the lock appears under its name only once held: a sweep never takes a live run's lock
        fd = os.open(partial / ".lock.new", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(partial / ".lock.new", partial / ".lock")
        watch = os.open(partial / ".lock", os.O_RDONLY)    # the janitor's own open file
        try:
            janitor = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _JANITOR, str(watch)], pass_fds=(watch,),
                env={**os.environ, "NANBISECT_RUN_DIR": str(partial)}, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.close(watch)
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if fd is not None:
            os.close(fd)        # lets the janitor go: it finds nothing left, and exits
        if janitor is not None:
            with reaped(janitor):       # interrupted: ended and reaped, the interrupt goes on
                try:
                    janitor.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    stop(janitor)
