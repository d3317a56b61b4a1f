"""Run the real CLI (and other Python programs) the way users do: in a process of its own,
forked from this worker's fork server (torch imported once) where it can be, else a fresh
interpreter; or in-process for errors where a subprocess adds nothing."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from helpers.paths import ROOT


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str

    def report(self, out: Path) -> dict:
        return json.loads((out / "report.json").read_text())


def cli(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: int = 300,
        fresh: bool = False) -> CliResult:
    """Run ``python -m nanbisect ARGS`` in a process of its own: forked from this worker's fork
    server (`nanbisect.proc`: torch imported once), or, with ``fresh`` (or an environment that
    differs in what torch reads at import, or ``NANBISECT_FRESH_CLI=1``), a fresh interpreter."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NANBISECT_TEST")}
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    argv = [str(a) for a in args]
    return run_python(["-m", "nanbisect", *argv], cwd=cwd, env=full_env, timeout=timeout,
                      fresh=fresh)


def run_python(target: list[str], *, cwd: Path = ROOT, env: dict | None = None,
               timeout: float = 300, fresh: bool = False) -> CliResult:
    """``python TARGET`` (``["-m", MODULE, ARG...]`` or ``[SCRIPT, ARG...]``) with exactly
    ``env`` (None: this process's), forked from this worker's fork server where it can be (see
    `cli`), else in a fresh interpreter."""
    env = dict(os.environ) if env is None else env
    if not fresh and os.environ.get("NANBISECT_FRESH_CLI") != "1":
        with tempfile.TemporaryDirectory(prefix="nanbisect-cli-") as d:
            return Started(target, Path(cwd), env, Path(d)).finish(timeout)
    p = subprocess.run([sys.executable, *target], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return CliResult(p.returncode, p.stdout, p.stderr)


class _Zygote:
    """This worker's fork server (the product's, `nanbisect.proc`: torch imported once),
    started on first use; None from `start` when it cannot serve a request (then the caller starts
    a fresh interpreter)."""

    def __init__(self) -> None:
        self.server = None
        self.env: dict[str, str] = {}
        self.lock = threading.Lock()

    def _same_import_env(self, env: dict[str, str]) -> bool:
        from nanbisect.proc import import_env

        return import_env(env) == import_env(self.env)

    def start(self, target: list[str], cwd: Path, env: dict[str, str], stdout: int,
              stderr: int):
        """Fork ``python TARGET`` from the server (started, or restarted for another import
        environment, here): its `nanbisect.proc.Child`, or None when the server is busy
        with another thread's request or cannot serve."""
        from nanbisect.proc import ForkServer

        if not self.lock.acquire(blocking=False):      # a test running CLIs side by side
            return None
        try:
            if self.server is not None and (self.server.proc.poll() is not None
                                            or not self._same_import_env(env)):
                self.close()
            if self.server is None:
                self.env = dict(env)
                self.server = ForkServer(env, warm="nanbisect.pipeline.run:warm_fork_server")
            return self.server.start(target, cwd=str(cwd), env=env, stdout=stdout,
                                     stderr=stderr, share=True)
        except OSError:
            self.close()
            return None
        finally:
            self.lock.release()

    def close(self) -> None:
        if self.server is not None:
            self.server.proc.kill()
            self.server.close()
            self.server = None


_ZYGOTE = _Zygote()


class Started:
    """``python TARGET`` started (by `start_python`, `run_python`) and running: forked from the
    worker's fork server, else a fresh interpreter; ``poll()``, ``kill()``, and
    ``finish(timeout)`` -> `CliResult` (what it printed, once it ended)."""

    def __init__(self, target: list[str], cwd: Path, env: dict[str, str], folder: Path) -> None:
        self.out, self.err = folder / "out", folder / "err"
        with open(self.out, "wb") as fo, open(self.err, "wb") as fe:
            self.child = _ZYGOTE.start(target, cwd, env, fo.fileno(), fe.fileno())
            if self.child is None:
                self.child = subprocess.Popen([sys.executable, *target], cwd=cwd, env=env,
                                              stdout=fo, stderr=fe, start_new_session=True)

    def poll(self) -> int | None:
        return self.child.poll()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.child.pid, signal.SIGKILL)

    def finish(self, timeout: float) -> CliResult:
        try:
            code = self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.child.wait()
            raise
        return CliResult(code, self.out.read_text(errors="replace"),
                         self.err.read_text(errors="replace"))


def start_python(target: list[str], folder: Path, *, cwd: Path = ROOT, env: dict | None = None
                 ) -> Started:
    """Start ``python TARGET`` and return at once (several side by side: each is forked from
    this worker's fork server, else a fresh interpreter), in a session of its own; what it
    prints goes to files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return Started(target, Path(cwd), dict(os.environ) if env is None else env, folder)


def invoke(*args: str) -> CliResult:
    """The CLI in this process (`nanbisect.cli.main` with stdout and stderr captured): for
    errors where a subprocess adds nothing."""
    import contextlib
    import io

    from nanbisect.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


def run_json(bundle, *flags, env: dict | None = None, code: int = 1) -> dict:
    """``nanbisect run BUNDLE --json FLAGS``: assert the exit code, return report.json."""
    res = cli("run", "--ckpt", bundle, "--json", *flags, env=env)
    assert res.code == code, res.stdout[-2000:] + res.stderr
    return json.loads(res.stdout)


def one_line_exit_2(res: CliResult, *words: str) -> str:
    """Assert a CLI result is a one-line error with exit 2 naming every one of ``words``, no
    traceback; the line. Only a `run` that knew its culprit before the error (a report that
    cannot be written) has said so on one line before it."""
    line = res.stderr.strip()
    found, _, rest = line.partition("\n")
    if found.startswith("nanbisect: culprit found: ") and rest:
        line = rest
    assert res.code == 2, res.stdout + res.stderr
    assert "\n" not in line and "Traceback" not in line, line
    assert all(w in line for w in words), line
    return line
