"""The fork server: a process that imported torch once and forks children on request.

A fresh interpreter that imports torch costs about 2 s of CPU here (3.5 s with what a replay
imports after it); a fork of one that already did costs milliseconds and shares the imported
pages. Users: the ranks of a multi-rank replay, triage's replays (one server per worker
process), the compiler bisection, the repro's run, the test suite's CLI runs.

Protocol: the client holds one end of a ``SOCK_SEQPACKET`` pair; a request is one JSON message
``{"target", "cwd", "env", "prelude"}`` carrying file descriptors (the child's stderr, a reply
socket, then any the child keeps). The server forks a reaper, which forks the child in a session
of its own, sends ``{"pid": P}`` and, when the child has ended, ``{"code": C}`` on the reply
socket (C < 0: killed by signal -C, as `subprocess` reports it). The server ends when the
client's end closes (the client exited or was killed); children have their own guards against
outliving their starter (triage's pipe guardian).

A warm-up (``warm``) is what the server calls once after `preload`, before any fork: a function
the caller passes (its module is imported there by name), so that this stage names none of the
later stages that use it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Union

from nanbisect.proc.child import end_child, import_env, preload, run_main, title
from nanbisect.proc.reap import Handle, reaped, settled, stop

_MAX_MSG = 1 << 20
_MAX_FDS = 8

# in a child started with ``share``: its server's socket and what that server read at import
_inherited: tuple[int, dict[str, str]] | None = None

Warm = Union[str, Callable[[], None]]


def warm_name(warm: Warm) -> str:
    """``module:function`` of a warm-up given as a function (or as that text already).

    >>> warm_name(preload)
    'nanbisect.proc.child:preload'
    """
    if callable(warm):
        return f"{warm.__module__}:{warm.__qualname__}"
    return warm or ""


def _call(name: str) -> None:
    """Call ``module:function`` (a prelude, a warm-up)."""
    import importlib

    module, _, func = name.partition(":")
    getattr(importlib.import_module(module), func)()


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
        title(req["target"])             # before the environment changes (it moves environ)
        os.environ.clear()
        os.environ.update(req["env"])
        import random
        import tempfile

        random.seed()                     # a fresh interpreter's would differ from its sibling's
        tempfile.tempdir = None           # TMPDIR is read again, from this child's environment
        # what `python -m` puts first; for a script, `run_main` puts its directory there
        sys.path.insert(0, os.getcwd() if req["target"][0] == "-m" else "")
        if req.get("prelude"):
            _call(req["prelude"])
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


def serve(fd: int, warm: Warm = "") -> None:
    """The server's loop on socket ``fd``: a reaper per request, until the client's end closes.
    ``warm`` (``module:function``, optional: `warm_name`): called once after `preload`, before
    any fork, to import and build what the children will need (it must run no torch op, start
    no thread)."""
    if sys.path and sys.path[0] == "":   # -c's working directory: only nanbisect came from there
        del sys.path[0]
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the client's to stop, by closing its end
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)    # reapers are reaped by the kernel
    sock = socket.socket(fileno=fd)
    preload()
    if warm:
        _call(warm)
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


class Child(Handle):
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
                 warm: Warm = "") -> None:
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
                [sys.executable, "-c", f"from nanbisect.proc.forkserver import serve; "
                 f"serve({theirs.fileno()}, {warm_name(warm)!r})"],
                pass_fds=(theirs.fileno(),), env=env, cwd=home, stdin=subprocess.DEVNULL,
                start_new_session=True)
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
    def get(cls, warm: Warm = "") -> ForkServer:
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
    settled(read, [])
    first, nl, rest = buf.partition(b"\n")
    if nl:
        with contextlib.suppress(Exception):
            stop(Child(int(json.loads(first)["pid"]), answer, rest))
    settled(answer.close, [])
