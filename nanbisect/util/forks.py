"""Run a Python main program in a fork of a process that imported torch once.

A fresh interpreter that imports torch costs about 2 s of CPU here (3.5 s with what a replay
imports after it); a fork of one that already did costs milliseconds and shares the imported
pages. Two users: the ranks of a multi-rank replay (`nanbisect.multirank.spawn`) and triage's
replays (`ForkServer`, one per worker process).

What makes the fork safe: the process that forks has imported modules and run no torch op and
started no thread, so the child inherits no OpenMP pool (GNU OpenMP's does not survive a fork) and
no lock held by a thread that is not there. Environment variables torch reads when it is imported
(``OMP_NUM_THREADS``, ``ATEN_CPU_CAPABILITY``) are the forking process's: a child that needs other
values needs a fresh interpreter.

`ForkServer` protocol: the client holds one end of a ``SOCK_SEQPACKET`` pair; a request is one
JSON message ``{"target", "cwd", "env", "prelude"}`` carrying file descriptors (the child's
stderr, a reply socket, then any the child keeps). The server forks a reaper, which forks the
child in a session of its own, sends ``{"pid": P}`` and, when the child has ended, ``{"code": C}``
on the reply socket (C < 0: killed by signal -C, as `subprocess` reports it). The server ends
when the client's end closes (the client exited or was killed); children have their own
guards against outliving their starter (triage's pipe guardian).

`reaped` and `stop`: every child this package starts (a fork, a `subprocess.Popen`, a server's
`Child`) is killed and waited for when its starter is interrupted between the start and the wait
(KeyboardInterrupt and SystemExit too), and the interrupt goes on unchanged; `held` keeps a
signal's handler from running between an ``os.fork()`` and the line that stores its pid.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

_MAX_MSG = 1 << 20
_MAX_FDS = 8

# what torch (or Python) reads when it is imported: a child forked from a server would not see
# another value of these than the server's
IMPORT_TIME = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|ATEN_|TORCH|PYTORCH_|CUDA_|PYTHON|LD_)")

# the warm-up (`serve`) of a server that forks `nanbisect run` processes: triage's workers', the
# test suite's (named, not imported: it lives in a later stage and imports torch)
REPLAY_WARM = "nanbisect.pipeline.run:warm_fork_server"

# in a child started with ``share``: its server's socket and what that server read at import
_inherited: tuple[int, dict[str, str]] | None = None


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that torch or Python read when they are imported."""
    return {k: v for k, v in env.items() if IMPORT_TIME.match(k)}


def run_main(target: list[str]) -> int:
    """Run ``target`` (``["-m", MODULE, ARG...]`` or ``[SCRIPT, ARG...]``) in this (forked)
    process as ``python`` would run it as its main program, then end it as the interpreter's exit
    does (non-daemon threads joined, then atexit); its exit status. For a module, ``sys.path[0]``
    is the caller's to set (``python -m`` puts the working directory there)."""
    import atexit
    import runpy
    import traceback
    import warnings

    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            with warnings.catch_warnings():   # preloaded: "found in sys.modules" is expected
                warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = str(Path(target[0]).resolve().parent)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()                 # as the interpreter's exit does: threads, then atexit
    atexit._run_exitfuncs()
    return code


def end_child(code: int) -> None:
    """Leave a forked child: flush what it printed, never return into the parent's code."""
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


def preload() -> None:
    """What every forked replay would import first (torch, and ``torch._dynamo``, which building
    an optimizer imports: 1.4 s more), imported without running an op."""
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    with contextlib.suppress(ImportError):
        import setproctitle  # noqa: F401


def _title(target: list[str]) -> None:
    """Show the child in ``ps`` (and /proc/PID/cmdline) as the command it runs, not as the
    server's; needs ``setproctitle`` (a dependency; without it the server's line stays)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join([sys.executable, *target]))


# the synchronous signals a fault raises, never held
_FAULTS = ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS",
           "SIGABRT")


@contextlib.contextmanager
def held() -> Iterator[set | None]:
    """Around an ``os.fork()`` and the line that stores its pid: the asynchronous signals are
    held (blocked, not lost) so that no handler (a KeyboardInterrupt, a timer's) runs between
    the fork's return and that line; the parent's mask is restored on the way out. Gives the
    mask to restore (None where there are no masks): the child never leaves the block (it
    ends with ``os._exit``) and restores it itself (`unheld`) inside its own ``try``, so that
    no exception of its unwinds into the parent's code. (``_thread.interrupt_main`` sends no
    signal: it cannot be held.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield None
        return
    faults = {getattr(signal, name) for name in _FAULTS if hasattr(signal, name)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [])   # read only: an interrupt here is harmless
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - faults)
        yield old
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unheld(mask: set | None) -> None:
    """In a child forked inside `held`: the signal mask its parent had before."""
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _settled(step: Callable[[], object], caught: list) -> None:
    """``step()`` of a cleanup, which never raises: once more when an interrupt (a second
    Ctrl-C, a timer) cuts it short, the interrupt kept in ``caught``; an error (the process is
    gone already) ends it."""
    for _ in range(3):
        try:
            step()
        except Exception:  # noqa: BLE001 - gone already, or cannot: nothing more to do
            return
        except BaseException as e:  # noqa: BLE001 - an interrupt: the wait is still owed
            caught.append(e)
            continue
        return


def stop(proc, reraise: bool = True) -> None:
    """End ``proc`` now (SIGKILL, to its whole process group where it leads one) and wait for
    it. ``proc``: a `subprocess.Popen`, a `Child`, the pid of a fork of this process (an int),
    or what ends and reaps its own with ``close()``; None: nothing. Raises nothing of its own;
    an interrupt that came while it waited is raised once the child is reaped (with
    ``reraise``; `reaped`, which is already raising the first error, drops it)."""
    if proc is None:
        return
    caught: list = []
    if isinstance(proc, int):
        _settled(lambda: os.kill(proc, signal.SIGKILL), caught)
        _settled(lambda: os.waitpid(proc, 0), caught)
    elif isinstance(proc, Child):
        if proc.returncode is None:
            _settled(proc.kill_group, caught)
            _settled(proc.wait, caught)
    elif isinstance(proc, subprocess.Popen):
        def kill() -> None:
            if proc.returncode is None:         # not reaped: its pid is still its own
                if os.getpgid(proc.pid) == proc.pid != os.getpgrp():
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
        _settled(kill, caught)
        _settled(proc.wait, caught)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                _settled(f.close, caught)
    else:
        _settled(proc.close, caught)
    if caught and reraise:
        raise caught[0]


@contextlib.contextmanager
def reaped(*procs) -> Iterator[None]:
    """What the block raises, KeyboardInterrupt and SystemExit included, first ends and reaps
    ``procs`` (`stop`), then goes on unchanged: a cleanup that fails never replaces it. Every
    child this package starts is waited for inside one, or with `stop` in a ``finally``, from
    the line that stores it to its wait."""
    try:
        yield
    except BaseException:
        for proc in procs:
            stop(proc, reraise=False)   # the block's error goes on, not a later interrupt
        raise


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(req: dict, err: int, out: int, keep: list[int]) -> None:
    """In the forked child: a session of its own, stdin on /dev/null, stdout on ``out`` (else
    /dev/null), stderr on ``err``, ``cwd`` and exactly ``env``; the ``prelude``
    (``module:function``) called first, then the target run as ``python`` would run it."""
    global _inherited
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDWR)
        for fd, target in ((null, 0), (null if out < 0 else out, 1), (err, 2)):
            os.dup2(fd, target)
        for fd in {null, err, out} - {-1, 0, 1, 2}:
            os.close(fd)
        if req.get("share"):              # the server's socket: this process's, not inherited
            os.set_inheritable(keep[-1], False)
            _inherited = (keep[-1], import_env(req["env"]))
            keep = keep[:-1]
        for name, fd in zip(req.get("fd_env", []), keep):
            os.set_inheritable(fd, True)
            req["env"][name] = str(fd)
        os.chdir(req["cwd"])
        _title(req["target"])             # before the environment changes (it moves environ)
        os.environ.clear()
        os.environ.update(req["env"])
        import random
        import tempfile

        random.seed()                     # a fresh interpreter's would differ from its sibling's
        tempfile.tempdir = None           # TMPDIR is read again, from this child's environment
        # what `python -m` puts first; for a script, `run_main` puts its directory there
        sys.path.insert(0, os.getcwd() if req["target"][0] == "-m" else "")
        if req.get("prelude"):
            import importlib

            module, _, func = req["prelude"].partition(":")
            getattr(importlib.import_module(module), func)()
        code = run_main(req["target"])
    except BaseException:  # noqa: BLE001 - never return into the server's code
        import traceback

        traceback.print_exc()
    finally:
        end_child(code)


def _reap(req: dict, fds: list[int]) -> None:
    """The reaper: fork the child, report its pid and then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    reply, err = fds[0], fds[1]
    out, keep = (fds[2], fds[3:]) if req.get("stdout") else (-1, fds[2:])
    answer = socket.socket(fileno=reply)
    pid = os.fork()
    if pid == 0:
        answer.detach()
        os.close(reply)
        _child(req, err, out, keep)
    for fd in fds[1:]:
        os.close(fd)
    code = 1
    try:
        answer.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        answer.sendall(json.dumps({"code": _status(status)}).encode() + b"\n")
        code = 0
    except BaseException:  # noqa: BLE001 - the client is gone: nothing to tell
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    os._exit(code)


def serve(fd: int, warm: str = "") -> None:
    """The server's loop on socket ``fd``: a reaper per request, until the client's end closes.
    ``warm`` (``module:function``, optional): called once after `preload`, before any fork, to
    import and build what the children will need (it must run no torch op, start no thread)."""
    if sys.path and sys.path[0] == "":   # -c's working directory: only nanbisect came from there
        del sys.path[0]
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the client's to stop, by closing its end
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)    # reapers are reaped by the kernel
    sock = socket.socket(fileno=fd)
    preload()
    if warm:
        import importlib

        module, _, func = warm.partition(":")
        getattr(importlib.import_module(module), func)()
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, _MAX_FDS)
        except OSError:
            break
        if not msg:
            break
        try:
            req = json.loads(msg)
        except ValueError:
            for f in fds:
                os.close(f)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            sock.detach()
            os.close(fd)
            _reap(req, fds)
        for f in fds:
            os.close(f)
    os._exit(0)


class Child:
    """A child a `ForkServer` started: its ``pid`` (its process group too), and `wait`."""

    def __init__(self, pid: int, answer: socket.socket, buf: bytes = b""):
        self.pid, self._answer, self._buf, self.returncode = pid, answer, buf, None

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; `subprocess.TimeoutExpired` when it has not ended within ``timeout``
        (it keeps running). An exit nobody could report (the reaper killed) reads as -SIGKILL."""
        if self.returncode is not None:
            return self.returncode
        self._answer.settimeout(timeout)
        try:
            while b"\n" not in self._buf:
                chunk = self._answer.recv(4096)
                if not chunk:
                    self.returncode = -signal.SIGKILL
                    self._answer.close()
                    return self.returncode
                self._buf += chunk
        except (socket.timeout, BlockingIOError):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
        self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["code"])
        self._answer.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill_group(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)


class ForkServer:
    """A fork server process (`serve`) and this process's end of its socket. ``env``: the
    server's environment (None: this process's), which fixes what torch read when it was
    imported for every child."""

    _lock = threading.Lock()
    _instance: ForkServer | None = None
    _owner = 0

    def __init__(self, env: dict[str, str] | None = None, *, sock: socket.socket | None = None,
                 warm: str = "") -> None:
        self.proc: subprocess.Popen | None = None
        if sock is not None:            # a server this process was forked from (`inherited`)
            self.sock = sock
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # started where this nanbisect was imported from (a checkout's root, site-packages),
        # so the server and its children run this copy; `serve` takes that off sys.path again
        home = str(Path(__file__).resolve().parent.parent.parent)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from nanbisect.util.forks import serve; "
                 f"serve({theirs.fileno()}, {warm!r})"], pass_fds=(theirs.fileno(),), env=env,
                cwd=home,
                stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self.sock = mine
        with reaped(mine, self.proc):
            mine.settimeout(120.0)
            try:
                ready = mine.recv(16)
            except OSError:
                ready = b""
            mine.settimeout(None)
        if ready != b"ready":
            self.close()
            raise OSError("the fork server did not start")

    @classmethod
    def inherited(cls, env: dict[str, str]) -> ForkServer | None:
        """In a child a server started with ``share``: that server, to fork a child with
        ``env`` from, when ``env`` holds what the server read at import; else None."""
        if _inherited is None or import_env(env) != _inherited[1]:
            return None
        return cls(sock=socket.socket(fileno=os.dup(_inherited[0])))

    @classmethod
    def get(cls, warm: str = "") -> ForkServer:
        """This process's server, started on first use (again after a fork or its death), with
        ``warm`` (see `serve`) when this call starts it."""
        with cls._lock:
            me = cls._instance
            if me is None or cls._owner != os.getpid() or me.proc.poll() is not None:
                # NB: not an inherited server: a worker's replays must not outlive it
                cls._instance, cls._owner = cls(warm=warm), os.getpid()
            return cls._instance

    def start(self, target: list[str], *, cwd: str, env: dict[str, str], stderr: int,
              stdout: int | None = None, keep: dict[str, int] | None = None,
              prelude: str = "", share: bool = False) -> Child:
        """Fork a child running ``target`` (as `run_main` takes it) with exactly ``env`` in
        ``cwd``, in a session of its own (its pid is its process group); its stderr (and
        stdout, else /dev/null) on the descriptors given. ``keep``: {variable: descriptor} the
        child keeps open; it finds each one's number (another than here) in that environment
        variable. ``prelude``: ``module:function`` the child calls before the target.
        ``share``: the child may fork children of its own from this server (`inherited`).
        OSError when the server cannot (it died: `get` starts another)."""
        keep = keep or {}
        answer, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            msg = json.dumps({"target": target, "cwd": cwd, "env": env, "prelude": prelude,
                              "stdout": stdout is not None, "fd_env": list(keep),
                              "share": share}).encode()
            fds = [theirs.fileno(), stderr, *([stdout] if stdout is not None else []),
                   *keep.values(), *([self.sock.fileno()] if share else [])]
            socket.send_fds(self.sock, [msg], fds)
        finally:
            theirs.close()
        line = b""
        try:
            answer.settimeout(60.0)
            try:
                line = answer.recv(4096)
            except OSError:
                line = b""
            if b"\n" not in line:
                answer.close()
                raise OSError("the fork server did not start the child")
            first, _, rest = line.partition(b"\n")
            return Child(int(json.loads(first)["pid"]), answer, rest)
        except OSError:
            raise
        except BaseException:   # an interrupt: the child may start all the same; it goes
            _unwanted(answer, line)
            raise

    def close(self) -> None:
        """End the server (its children are not touched); for an inherited one, let go of it."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc is None:
            return
        with reaped(self.proc):
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _unwanted(answer: socket.socket, got: bytes) -> None:
    """A child asked of a server whose pid the asker was interrupted before it read (``got``:
    what it had read): its pid, read now (5 s at most), then it is ended and waited for."""
    buf = got

    def read() -> None:
        nonlocal buf
        answer.settimeout(5.0)
        while b"\n" not in buf:
            chunk = answer.recv(4096)
            if not chunk:
                return
            buf += chunk
    _settled(read)
    first, nl, rest = buf.partition(b"\n")
    if nl:
        with contextlib.suppress(Exception):
            stop(Child(int(json.loads(first)["pid"]), answer, rest))
    _settled(answer.close)
