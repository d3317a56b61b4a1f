"""Run a repro script once, where nanbisect cannot be imported by it, and say what it said (no
torch imported by this module).

`run_repro` starts a fresh interpreter when the script is ready (it pays ``import torch``, about as
much as several training steps of a small model). `Fork` runs it in a fork of this process, which
has torch loaded: a CPU run of a built-in op. `Interpreter` is a fresh one started ahead, so that
its ``import torch`` overlaps the passes that find the culprit (a run on an accelerator);
`prestart` starts one before this process imports torch itself (the CLI's first step), and the
next run takes it (the pool is `nanbisect.proc.Spares`; every process here starts, ends and is
reaped through `nanbisect.proc`).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from nanbisect import proc
from nanbisect.records import ReproResult
from nanbisect.util import torch_internals as ti


def _said(code: int, stdout: str, stderr: str) -> ReproResult:
    """Reproduced: exit 1 *and* the script's own "REPRODUCED:" line (an uncaught exception, an
    import that fails before the script's main, also exits 1)."""
    tail = (stdout + stderr).strip().splitlines()[-6:]
    said = any(line.startswith("REPRODUCED:") for line in stdout.splitlines())
    return ReproResult(code == 1 and said, code, "\n".join(tail))


def run_repro(script: Path, device: str, timeout: int = 300) -> ReproResult:
    """Run the repro once in a fresh interpreter, from another directory; report what it said.
    (Not `subprocess.run`: interrupted, it kills the child without waiting for it.)"""
    said = proc.Output()
    with proc.reaped(said):
        p = proc.start_exec([sys.executable, str(script.resolve()), "--device", device],
                            cwd=str(script.parent.parent), stdin=None, stdout=said.out,
                            stderr=said.err)
        return _collected(p, said, timeout, timeout)


def _timed_out(timeout: float) -> ReproResult:
    return ReproResult(False, None, f"timed out after {timeout:g}s")


def _collected(child, said: proc.Output, left: float, timeout: float) -> ReproResult:
    """What ``child`` said once it ended (``left`` seconds at most: then it is killed, its
    group too, and reaped, and the run timed out after ``timeout``)."""
    code = proc.finish(child, left)
    if code is None:
        said.close()
        return _timed_out(timeout)
    return _said(code, *said.said())


class _Pending:
    """What `Interpreter` and `Fork` share: the submitted run, its deadline, and the plain
    `run_repro` they fall back to when they could not run it themselves. ``result`` waits for
    the run; ``close`` ends (and reaps) one whose result nobody will collect: whoever submits
    closes on every path (a KeyboardInterrupt between the two too); after ``result``, a no-op.
    An exception inside ``result`` ends the run before it goes through."""

    def _submitted(self, script: Path, device: str, timeout: int) -> None:
        self.script, self.device, self.timeout = script, device, timeout
        self.deadline = time.monotonic() + timeout

    def _fallback(self) -> ReproResult:
        return run_repro(self.script, self.device, self.timeout)

    def _left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())


# The finder both kinds of runs install: an ``import nanbisect`` by the script itself fails as it
# would where nanbisect is not installed; a file the script loads to register a custom op (e.g.
# the entry file) may import what it likes, as with `run_repro`.
_BLOCK = r"""
import sys

class _NoNanbisect:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "nanbisect":
            return None
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith("<frozen importlib"):
            f = f.f_back
        if f is not None and f.f_globals.get("__name__") == "__main__":
            raise ModuleNotFoundError("No module named %r (a repro must run without nanbisect)"
                                      % name, name=name)
        return None

sys.meta_path.insert(0, _NoNanbisect())
"""

# The started interpreter: it blocks nanbisect for the script, imports what every repro imports,
# then waits for one line: [script, directory, *argv], and runs the script there as
# ``python script *argv`` would (``__main__``, sys.argv, sys.path[0]).
_WAITING = _BLOCK + r"""
import json, os, runpy
try:
    import torch
    import safetensors.torch
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    script, cwd, *argv = json.loads(line)
    os.chdir(cwd)
except Exception:
    sys.exit(75)      # not set up: the caller runs the script in a plain interpreter instead
sys.argv = [script, *argv]
sys.path[0] = os.path.dirname(script)
del json, line, cwd, argv
runpy.run_path(script, run_name="__main__")
"""


class Interpreter(proc.Waiting, _Pending):
    """A fresh interpreter for one repro run, started before the repro exists
    (`nanbisect.proc.Waiting`: it blocks nanbisect for the script and imports torch meanwhile).

    ``start()`` launches it; ``run(script, device)`` hands it the script and waits for what it
    says, as `run_repro` would; ``close()`` ends one that was not used. If it cannot start or
    dies before the script is handed over, ``run`` falls back to `run_repro`, so the result
    never depends on it.
    """

    def __init__(self) -> None:
        super().__init__(_WAITING)

    def submit(self, script: Path, device: str, timeout: int = 300) -> "Interpreter":
        """Hand the script over; it runs while the caller goes on (`result` collects it)."""
        self._submitted(script, device, timeout)
        self.handed = self.hand(json.dumps([str(script.resolve()), str(script.parent.parent),
                                            "--device", device]) + "\n")
        return self

    def result(self) -> ReproResult:
        """What the submitted script said (exit 1: reproduced), as `run_repro` reports it."""
        p, self.proc = self.proc, None
        said, self.output = self.output, None
        if p is None:
            if said is not None:
                said.close()
            return self._fallback()
        with proc.reaped(p, said):
            got = _collected(p, said, self._left(), self.timeout)
        if p.returncode == 75 or not getattr(self, "handed", False):
            return self._fallback()     # it was not set up, or never got the script
        return got

    def run(self, script: Path, device: str, timeout: int = 300) -> ReproResult:
        return self.submit(script, device, timeout).result()


def _from_inherited(target: list[str], **kw):
    """Fork ``target`` from the fork server this process was forked from (`ServerFork`'s
    default start); OSError when there is none (or it could not)."""
    child = proc.from_server(target, **kw)
    if child is None:
        raise OSError("this process was not forked from a fork server")
    return child


class ServerFork(_Pending):
    """One repro run forked from a fork server: by default the one this process was itself
    forked from (a triage replay's, a test's run; `nanbisect.proc.forkserver`), or what
    ``start`` (``start(target, cwd=, env=, stdout=, stderr=, prelude=)`` -> a started `Child`,
    OSError when it cannot) gives. Torch is loaded there and no user code ever ran there, so the
    script registers a custom op or imports the entry itself, as in a fresh interpreter, without
    paying an interpreter's start and ``import torch``. The child drops nanbisect's modules the
    server preloaded and cannot import nanbisect (`isolate`). For a device whose ranks may be
    forked (the CPU): `usable` says when. Same ``submit``/``result`` as `Interpreter`; when it
    could not start the child, ``error`` says why and ``result`` falls back to `run_repro`."""

    def __init__(self, start=None) -> None:
        self._start = start or _from_inherited
        self.child = None
        self.output: proc.Output | None = None
        self.error: OSError | None = None

    @staticmethod
    def usable(device_type: str) -> bool:
        from nanbisect import devices

        server = proc.ForkServer.inherited(dict(os.environ))
        if server is None:
            return False
        server.close()
        return devices.entry(device_type).forkable

    def submit(self, script: Path, device: str, timeout: float = 300) -> "ServerFork":
        self._submitted(script, device, timeout)
        self.output = proc.Output()
        try:
            self.child = self._start([str(script.resolve()), "--device", device],
                                     cwd=str(script.parent.parent), env=dict(os.environ),
                                     stdout=self.output.out.fileno(),
                                     stderr=self.output.err.fileno(),
                                     prelude="nanbisect.report.rerun:isolate")
        except OSError as e:
            self.error = e
        if self.child is None:
            self.output.close()
        return self

    def result(self) -> ReproResult:
        if self.child is None:
            return self._fallback()
        with proc.reaped(self.output):
            return _collected(self.child, self.output, self._left(), self.timeout)

    def close(self) -> None:
        if self.child is not None:
            proc.stop(self.child)
            self.output.close()


def isolate() -> None:
    """A fork server child's prelude before it runs a repro (`ServerFork`,
    `nanbisect.compiler.launch.run_repro_forked`): the nanbisect modules the server preloaded
    are dropped and the script cannot import nanbisect, as in a fresh interpreter."""
    for name in [m for m in sys.modules if m.split(".")[0] == "nanbisect"]:
        del sys.modules[name]
    exec(_BLOCK, {})


def runner(device_type: str, op: str | None, spare: Interpreter | None = None) -> _Pending:
    """What runs a repro once: on the CPU, for a built-in op, a `Fork` of this process; else,
    where this process came from a fork server, a `ServerFork`; else ``spare`` (an interpreter
    started ahead) or a new `Interpreter`. ``op``: None for a module call's repro."""
    if op is not None and Fork.usable(device_type, op):
        return Fork()
    if ServerFork.usable(device_type):
        if spare is not None:
            spare.close()
        return ServerFork()
    return spare or Interpreter()


BUILTIN_NAMESPACES = ti.BUILTIN_NAMESPACES


class Fork(_Pending):
    """One repro run in a fork of this process: torch is loaded already, so the run costs what
    the script costs, not an interpreter's start-up. For a CPU run of a built-in op only (a
    forked process cannot use CUDA its parent initialised; a custom op is registered in this
    process by code the script must prove it imports itself): `usable` says when.

    The child drops every nanbisect module and blocks importing it from the script (as the
    fresh interpreter does), restores default signal handlers, runs torch on one intra-op thread
    (GNU OpenMP's thread pool does not survive a fork: a child using it hangs), writes to files
    of its own, and runs the script as ``python script --device D`` would, from the report
    directory. Same ``submit``/``result`` as `Interpreter`.
    """

    child: proc.Forked | None = None
    output: proc.Output | None = None

    @staticmethod
    def usable(device_type: str, op: str) -> bool:
        """A CPU run of a built-in op (``op`` as ``str()`` of its overload)."""
        from nanbisect import devices    # torch: only once a run has it loaded

        return (hasattr(os, "fork") and devices.entry(device_type).forkable
                and op.split(".", 1)[0] in BUILTIN_NAMESPACES)

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    def submit(self, script: Path, device: str, timeout: int = 300) -> "Fork":
        self._submitted(script, device, timeout)
        self.output = said = proc.Output()
        try:   # the child is stored before any handler runs (`close` needs it)
            proc.fork(lambda: _forked(script, device, said.out.fileno(), said.err.fileno()),
                      lambda child: setattr(self, "child", child),
                      defaults=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        except OSError:        # e.g. no memory to account a copy of a large process for
            self.child = None
        return self

    def result(self) -> ReproResult:
        if self.child is None:   # it could not fork: a fresh interpreter instead
            self.output.close()
            return self._fallback()
        with proc.reaped(self):
            return _collected(self.child, self.output, self.deadline - time.monotonic(),
                              self.timeout)

    def close(self) -> None:
        proc.stop(self.child)
        if self.output is not None:
            self.output.close()


def _forked(script: Path, device: str, out: int, err: int) -> int:
    """In the forked child: run ``script`` as a fresh ``python script --device D`` would."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = open(1, "w", closefd=False)     # objects of its own: no lock a thread of the
    sys.stderr = open(2, "w", closefd=False)     # parent held at the fork
    import torch
    torch.set_num_threads(1)
    for name in [m for m in sys.modules if m.split(".")[0] == "nanbisect"]:
        del sys.modules[name]
    exec(_BLOCK, {})
    os.chdir(script.parent.parent)
    code = proc.run_target([str(script.resolve()), "--device", device])
    sys.stdout.flush()
    sys.stderr.flush()
    return code


# the interpreter `prestart` starts ahead and `take` hands over
_SPARES: proc.Spares[Interpreter] = proc.Spares(Interpreter)


def prestart(bundle: Path, target: str | None) -> None:
    """Start an interpreter for the repro of a run of ``bundle`` on ``target`` (None: where it
    was captured) now (`take` hands it over): when the bundle records a failure of one process
    (its manifest, read within the bounds of an untrusted file; a bundle it refuses is left to
    the pipeline, which says why) and the target is not the CPU (there the repro runs in a
    `Fork`). One not taken is ended when this process exits."""
    from nanbisect import devices
    if target is not None and devices.entry(str(target)).forkable:
        return
    from nanbisect.bundle.manifest import Manifest
    from nanbisect.errors import BadInput
    try:
        m = Manifest.read(bundle)
        wanted = not m.multi_rank and m.observed is not None
        if wanted and target is None:
            target = m.captured_on
    except BadInput:
        wanted = False
    wanted = wanted and not devices.entry(str(target)).forkable
    if wanted:
        _SPARES.keep()


def take() -> Interpreter:
    """The interpreter `prestart` started, or a new one started now."""
    return _SPARES.take()
