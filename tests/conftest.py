"""Shared helpers: run the real CLI in a subprocess (or in-process), copy fixture bundles into tmp
dirs."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "bundles"
TASKS = ROOT / "fixtures" / "tasks"
TEST_TASKS = Path(__file__).resolve().parent / "tasks"
sys.path.insert(0, str(TASKS))   # the fixture tasks' modules (tinygpt: the GPT and plain_step)
sys.path.insert(0, str(TEST_TASKS))   # the tests' own task modules (loops, traps, ...)
# Remedies (issue 27) replay a culprit's step up to 4 more times by default; the suite's other
# tests are not about them: one remedy each keeps the machinery exercised on every culprit at a
# quarter of the cost (the CLI children inherit it). tests/test_remedies.py and the remedies
# assertions elsewhere ask for their budgets explicitly.
os.environ.setdefault("NANBISECT_REMEDY_BUDGET", "1")
# torch's inductor reuses kernels and its precompiled header from its cache directory whatever
# ATEN_CPU_CAPABILITY says: a suite run forced to another instruction set (issue 44: the suite
# under default, avx2 and unset) then fails to compile ("'at::vec' has not been declared"). Each
# forced instruction set gets a cache of its own (torch 2.13; a user's own setting is kept).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-nanbisect-tests-{os.getuid()}-"
                               f"{os.environ['ATEN_CPU_CAPABILITY'].lower()}")


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
    server (`nanbisect.util.forks`: torch imported once), or, with ``fresh`` (or an environment that
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
    """This worker's fork server (the product's, `nanbisect.util.forks`: torch imported once),
    started on first use; None from `start` when it cannot serve a request (then the caller starts
    a fresh interpreter)."""

    def __init__(self) -> None:
        self.server = None
        self.env: dict[str, str] = {}
        self.lock = threading.Lock()

    def _same_import_env(self, env: dict[str, str]) -> bool:
        from nanbisect.util.forks import import_env

        return import_env(env) == import_env(self.env)

    def start(self, target: list[str], cwd: Path, env: dict[str, str], stdout: int,
              stderr: int):
        """Fork ``python TARGET`` from the server (started, or restarted for another import
        environment, here): its `nanbisect.util.forks.Child`, or None when the server is busy
        with another thread's request or cannot serve."""
        from nanbisect.util.forks import REPLAY_WARM, ForkServer

        if not self.lock.acquire(blocking=False):      # a test running CLIs side by side
            return None
        try:
            if self.server is not None and (self.server.proc.poll() is not None
                                            or not self._same_import_env(env)):
                self.close()
            if self.server is None:
                self.env = dict(env)
                self.server = ForkServer(env, warm=REPLAY_WARM)
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
    """``nanbisect run --ckpt BUNDLE --json FLAGS``: assert the exit code, return report.json."""
    res = cli("run", "--ckpt", bundle, "--json", *flags, env=env)
    assert res.code == code, res.stdout[-2000:] + res.stderr
    return json.loads(res.stdout)


def one_line_exit_2(res: CliResult, *words: str) -> str:
    """Assert a CLI result is a one-line error with exit 2 naming every one of ``words``, no
    traceback; the line."""
    line = res.stderr.strip()
    assert res.code == 2, res.stdout + res.stderr
    assert "\n" not in line and "Traceback" not in line, line
    assert all(w in line for w in words), line
    return line


def aged(*paths, seconds=3 * 86400) -> None:
    """Set every file and directory under ``paths`` (and they) to ``seconds`` ago."""
    old = time.time() - seconds
    for p in paths:
        for q in sorted(Path(p).rglob("*"), reverse=True) + [Path(p)]:
            os.utime(q, (old, old), follow_symlinks=False)


def tree_digest(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): to show a tree was left untouched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture
def reported(tmp_path):
    """A copy of the nan_batch bundle with its report (in-process run)."""
    b = tmp_path / "b"
    shutil.copytree(FIXTURES / "nan_batch", b, ignore=shutil.ignore_patterns("nanbisect-report"))
    assert invoke("run", b).code == 1
    return b


@pytest.fixture
def fixture_bundle(tmp_path):
    """Copy a shipped bundle into tmp_path (so reports never land in the repository)."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
        return dst

    return copy


def same_run(name: str):
    """Mark for the tests that read the `replayed` run of shipped bundle ``name``: one
    pytest-xdist group, so they go to one worker (scripts/test.sh: --dist loadgroup), where that
    run is done once."""
    return pytest.mark.xdist_group(f"replayed-{name}")


@pytest.fixture(scope="session")
def replayed(tmp_path_factory):
    """``replayed(name)``: (a copy of the shipped bundle ``name``, the report that `nanbisect run
    --json` printed for it, exit code 1 checked); ``replayed(name, json_=False)``: (another copy,
    the `CliResult` of a plain `nanbisect run --ckpt` of it). Each is run once per worker, however
    many tests read it (mark those with `same_run`); they only read the copy and its report."""
    done: dict = {}

    def get(name: str, json_: bool = True):
        if (name, json_) not in done:
            bundle = tmp_path_factory.mktemp("replayed") / name
            shutil.copytree(FIXTURES / name, bundle,
                            ignore=shutil.ignore_patterns("nanbisect-report"))
            if json_:
                done[name, json_] = bundle, run_json(bundle)
            else:
                done[name, json_] = bundle, cli("run", "--ckpt", bundle)
        return done[name, json_]

    return get


@pytest.fixture(scope="session")
def travel_bundle(tmp_path_factory):
    """One capture of tests/tasks/travel.py on this machine (an optimizer NaN after a finite
    loss whose last bits depend on the CPU's instruction set), shared by the session's tests:
    replay a copy (`shutil.copytree`), never the bundle itself."""
    import travel

    from nanbisect import Guard, NonFiniteStep

    guard = Guard(travel.task(), entry=f"{TEST_TASKS / 'travel.py'}:task",
                  out=tmp_path_factory.mktemp("travel"))
    with pytest.raises(NonFiniteStep) as e:
        guard.step(travel.batch())
        guard.close()      # the NaN is born in the update: read here
    return e.value.bundle


def pytest_configure(config):
    """One progress line per test file as it finishes (tests/progress.py)."""
    from progress import FileProgress

    config.pluginmanager.register(FileProgress(config), "nanbisect-file-progress")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (tens of seconds under a loaded -n 3) run first, in their collection
    order, then the rest as collected: a long test started last would leave the other workers idle
    at the end (with ``--dist loadgroup``, scripts/test.sh, xdist_group groups go out first)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _captured_bundle_cache(tmp_path_factory):
    """Multi-rank captures shared by the session's tests and workers (tests/bundles.py)."""
    import bundles

    bundles.CACHE = bundles.session_cache(tmp_path_factory.getbasetemp())
    yield
    _ZYGOTE.close()
