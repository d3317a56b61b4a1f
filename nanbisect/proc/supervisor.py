"""Start a child three ways, each giving a handle `nanbisect.proc.reap` can end and reap.

- `fork`: a fork of this process that runs a function and ends (`Forked`); torch is loaded
  already, so a child costs milliseconds (see `nanbisect.proc.child` for when that is safe);
- `from_server`: forked from the fork server this process itself came from
  (`nanbisect.proc.forkserver`), or None when there is none;
- `start_exec`: a fresh interpreter or any program (`subprocess.Popen`), stdin on /dev/null.

`Output` holds what a child said (its stdout and stderr, in files of their own: no pipe to
drain while it runs), `nanbisect.proc.reap.finish` bounds its time. Guarantees: a `fork`'s pid
is stored before any signal handler of the parent can run (`held`); the child never returns
into its parent's code.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from nanbisect.proc.child import end_child
from nanbisect.proc.forkserver import Child, ForkServer
from nanbisect.proc.reap import Handle, signal_child
from nanbisect.proc.signals import held, unheld


class Forked(Handle):
    """A fork of this process (`fork`): reaped with ``waitpid``; its ``returncode`` is set in
    the same held step as the reap, so that nothing kills a pid it no longer owns."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with held():
                got, status = os.waitpid(self.pid, os.WNOHANG)
                if got:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; `subprocess.TimeoutExpired` when it has not ended in ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """``sig`` to the child, while it is not reaped (as `subprocess.Popen.send_signal`)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL to its process group where it leads one, else to it."""
        signal_child(self, signal.SIGKILL)


def fork(body: Callable[[], int], store: Callable[[Forked], None], *,
         defaults: tuple[int, ...] = ()) -> None:
    """Fork this process; the child sets ``defaults`` (signals) to their default handlers,
    restores the parent's signal mask, runs ``body()`` and ends with its return value as its
    exit status (a traceback and 1 for an exception; it never returns). ``store`` gets the
    child's `Forked` in the parent before any handler can run. What this process printed is
    flushed first (else the child would print it again)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with held() as mask:
        pid, stored = 0, False
        try:
            pid = os.fork()
            if pid:
                store(Forked(pid))
                stored = True
                return
        except BaseException:
            # NB: `_thread.interrupt_main` raises no signal the mask holds: its KeyboardInterrupt
            # lands at the next call, which can be between the fork and the store; the child,
            # not stored anywhere, would outlive the run
            if pid > 0 and not stored:
                _kill_unstored(pid)
            raise
        code = 1
        try:
            for sig in defaults:
                signal.signal(sig, signal.SIG_DFL)
            unheld(mask)
            code = body()
        except BaseException:  # noqa: BLE001 - never return into the parent's code
            import traceback

            traceback.print_exc()
        finally:
            end_child(code)


def _kill_unstored(pid: int) -> None:
    """End and reap a child forked a moment ago that its caller never got to hold."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def start_exec(argv: list[str], **kw) -> subprocess.Popen:
    """``argv`` in a process of its own (`subprocess.Popen`'s keywords; stdin on /dev/null
    unless given)."""
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(argv, **kw)


def from_server(target: list[str], env: dict[str, str], **kw) -> Child | None:
    """``target`` forked (`ForkServer.start`, its keywords) from the fork server this process
    was itself forked from, when there is one whose import-time environment matches ``env``
    and it could start it; else None (the caller starts it another way)."""
    server = ForkServer.inherited(env)
    if server is None:
        return None
    try:
        return server.start(target, env=env, **kw)
    except OSError:
        return None                    # gone: the caller's other way, as without it
    finally:
        server.close()


class Output:
    """What a child says: its stdout and stderr, each in a temporary file of its own (``out``,
    ``err``: give their ``fileno()`` to the child), read back once it ended (`said`)."""

    def __init__(self) -> None:
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()

    def said(self) -> tuple[str, str]:
        """(stdout, stderr) as text (undecodable bytes replaced); the files are closed."""
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        self.close()
        return texts[0], texts[1]

    def close(self) -> None:
        for f in (self.out, self.err):
            f.close()
