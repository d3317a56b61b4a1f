"""End and reap a child on every path: `stop` now, `reaped` when a block is interrupted.

Guarantees: every child `nanbisect.proc` starts (a `Handle`: a fork server's `Child`, a
`Forked`; a `subprocess.Popen`) is killed with its whole process group where it leads one, and
waited for, when its starter is interrupted between the start and the wait (KeyboardInterrupt
and SystemExit too); the interrupt goes on unchanged, and a cleanup that fails never replaces
it. Not guaranteed: a grandchild that left the child's process group is not found here (a
run directory's `nanbisect.proc.scratch.kill_named` finds those by name).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Callable, Iterator


class Handle:
    """What every started child has: ``pid``, ``returncode`` (None while it runs, then its
    exit status, negative for a signal as `subprocess` reports it), ``wait(timeout)``
    (`subprocess.TimeoutExpired` when it has not ended), ``poll()`` and ``kill_group()``."""

    pid: int
    returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        raise NotImplementedError

    def kill_group(self) -> None:
        raise NotImplementedError

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


def settled(step: Callable[[], object], caught: list) -> None:
    """``step()`` of a cleanup, which never raises: once more when an interrupt (a second
    Ctrl-C, a timer) cuts it short, the interrupt kept in ``caught``; an error (the process is
    gone already) ends it. (This package's interface: `nanbisect.proc.forkserver` cleans up
    with it too.)"""
    for _ in range(3):
        try:
            step()
        except Exception:  # noqa: BLE001 - gone already, or cannot: nothing more to do
            return
        except BaseException as e:  # noqa: BLE001 - an interrupt: the wait is still owed
            caught.append(e)
            continue
        return


def signal_child(child, sig: int) -> None:
    """``sig`` to ``child`` (a `Handle` or a `subprocess.Popen` this process started) while it
    is not reaped (its pid is still its own): to its whole process group where it leads one of
    its own, else to it alone. A child gone already is no error."""
    if child.returncode is not None:
        return
    try:
        if os.getpgid(child.pid) == child.pid != os.getpgrp():
            os.killpg(child.pid, sig)
        else:
            os.kill(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_pid(pid: int, sig: int) -> bool:
    """``sig`` to process ``pid``, one this process did not start itself (a rank of a run,
    found by the pid its state file names); False when it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop(proc, reraise: bool = True, within: float | None = None) -> None:
    """End ``proc`` now (SIGKILL, to its whole process group where it leads one) and wait for
    it (a `Handle` or a `subprocess.Popen`: ``within`` seconds at most, for a child stuck in
    the kernel; None: until it is reaped). ``proc``: a `Handle`, a `subprocess.Popen`, the pid
    of a fork of this process (an int), or what ends and reaps its own with ``close()``; None:
    nothing. Raises nothing of its own; an interrupt that came while it waited is raised once
    the child is reaped (with ``reraise``; `reaped`, which is already raising the first error,
    drops it)."""
    if proc is None:
        return
    caught: list = []
    if isinstance(proc, int):
        settled(lambda: os.kill(proc, signal.SIGKILL), caught)
        settled(lambda: os.waitpid(proc, 0), caught)
    elif isinstance(proc, Handle):
        if proc.returncode is None:
            settled(proc.kill_group, caught)
            settled(lambda: proc.wait(within), caught)
    elif isinstance(proc, subprocess.Popen):
        settled(lambda: signal_child(proc, signal.SIGKILL), caught)
        settled(lambda: proc.wait(within), caught)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                settled(f.close, caught)
    else:
        settled(proc.close, caught)
    if caught and reraise:
        raise caught[0]


@contextlib.contextmanager
def reaped(*procs) -> Iterator[None]:
    """What the block raises, KeyboardInterrupt and SystemExit included, first ends and reaps
    ``procs`` (`stop`), then goes on unchanged: a cleanup that fails never replaces it. Every
    child is waited for inside one, or with `stop` in a ``finally``, from the line that stores
    it to its wait."""
    try:
        yield
    except BaseException:
        for proc in procs:
            stop(proc, reraise=False)   # the block's error goes on, not a later interrupt
        raise


def finish(child, timeout: float | None):
    """``child``'s exit status once it ended within ``timeout`` seconds (None: no bound);
    None when it ran past: then it is killed (its group) and reaped. An interrupt while it
    waits ends and reaps it, and goes on.

    >>> import sys
    >>> finish(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]), 0.1)
    """
    with reaped(child):
        try:
            return child.wait(timeout)
        except subprocess.TimeoutExpired:
            stop(child)
            return None
