"""Start the compiler bisection in a process of its own, show its progress, bound its time.

`bisect_compiled` forks `nanbisect.compiler.bisector` from the fork server (`nanbisect.proc`: torch
already imported), reads the lines it prints as progress, and kills its process group at
``NANBISECT_COMPILER_TIMEOUT`` seconds (default `DEFAULT_TIMEOUT`). The bisector's on-disk state
lives in that child's own temporary directory (``TMPDIR`` of its own, removed here), so a later
``torch.compile`` of this process or any other never sees it.

Not guaranteed: a bound finer than the compile in flight when the time runs out (the child is
killed, its result is then "not finished" with what it printed last).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from nanbisect import proc
from nanbisect.records import CompilerFinding, ReproResult
from nanbisect.util.text import clip
from nanbisect.util.numbers import env

TIMEOUT_ENV = "NANBISECT_COMPILER_TIMEOUT"
DEFAULT_TIMEOUT = 600.0


def bisect_timeout() -> float:
    """Seconds the bisection may take (``NANBISECT_COMPILER_TIMEOUT``)."""
    return env(TIMEOUT_ENV, DEFAULT_TIMEOUT)


def _start(target: list[str], env: dict[str, str], **kw):
    """Fork ``target`` from the fork server this process came from when there is one (a
    triage replay, a test's CLI run: torch imported there), else from this process's own."""
    # NB: torch's cache_dir() writes TORCHINDUCTOR_CACHE_DIR into this process's environment
    # when it first compiles; the server did not have it at import: the child is told it in
    # its arguments instead
    bare = {k: v for k, v in env.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return (proc.from_server(target, env, **kw) or proc.from_server(target, bare, **kw)
            or proc.ForkServer.get().start(target, env=env, **kw))


def bisect_compiled(bundle: Path, entry: str | None, target: str, *, eager: str, compiled: str,
                    phase: str | None, backend: str,
                    progress: Callable[[str, str], None] = lambda key, text: None,
                    timeout: float | None = None, run_top_level: bool = False
                    ) -> CompilerFinding:
    """Run torch's compiler bisection of ``bundle``'s step in a child; its finding (one that
    says why when the child failed or ran out of time). ``run_top_level``: the child's
    `Replayer`'s (``--run-top-level``)."""
    from nanbisect.util.torch_internals import check_torch_version
    from nanbisect.util.torch_internals import inductor_cache_dir as cache_dir

    limit = bisect_timeout() if timeout is None else timeout
    base = dict(eager=eager, compiled=compiled, phase=phase, backend=backend)
    too_old = check_torch_version("compiler")
    if too_old is not None:
        return CompilerFinding(**base, detail=f"the bisection could not start: {too_old}")
    # NB: the pid in its name tells a live run's scratch from one left behind
    scratch = Path(tempfile.mkdtemp(prefix=f"nanbisect-compiler-{os.getpid()}-"))
    out = scratch / "finding.json"
    argv = ["-m", "nanbisect.compiler.bisector", str(Path(bundle).resolve()), str(out),
            "--device", target, "--cache-dir", cache_dir(), "--eager", eager,
            "--compiled", compiled,
            *(["--phase", phase] if phase else []), *(["--entry", entry] if entry else []),
            *(["--run-top-level"] if run_top_level else [])]
    env = {**os.environ, "TMPDIR": str(scratch)}
    t0 = time.perf_counter()
    read, write = os.pipe()
    err = os.open(scratch / "stderr.txt", os.O_WRONLY | os.O_CREAT, 0o600)
    child = None
    try:
        try:
            child = _start(argv, env, cwd=os.getcwd(), stderr=err, stdout=write)
        finally:
            os.close(write)
            os.close(err)
        deadline = time.monotonic() + limit
        last, in_time = _follow(read, deadline, progress)
        if not in_time:
            proc.stop(child)                # its group killed, and reaped
            return CompilerFinding(**base, seconds=time.perf_counter() - t0, detail=(
                f"the bisection ran out of its {limit:g} s ({TIMEOUT_ENV}); its last "
                f"step: {last or 'none'}"))
        code = proc.finish(child, max(1.0, deadline - time.monotonic()))
        code = child.returncode if code is None else code     # killed at the deadline
        if code == 0 and out.is_file():
            return CompilerFinding.from_json(json.loads(out.read_text()))
        tail = (scratch / "stderr.txt").read_text(errors="replace").strip().splitlines()[-1:]
        return CompilerFinding(**base, seconds=time.perf_counter() - t0, detail=(
            f"the bisection failed (exit {code}): "
            f"{clip(tail[0], 1000) if tail else last or 'no output'}"))
    except OSError as e:
        return CompilerFinding(**base, detail=f"the bisection could not start: {e}")
    finally:
        # waited for already, else (an interrupt, an OSError) ended and reaped; an interrupt
        # while it waits goes on only when nothing else is already raised (the first wins)
        proc.stop(child, reraise=sys.exc_info()[0] is None)
        os.close(read)
        shutil.rmtree(scratch, ignore_errors=True)
        sys.stdout.flush()


def _follow(read: int, deadline: float, progress: Callable[[str, str], None]
            ) -> tuple[str, bool]:
    """Show each line the child prints (on ``read``) as progress until it closes its end or
    ``deadline`` passes: (its last line, whether it closed in time)."""
    buf, last = b"", ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last, False
        ready, _, _ = select.select([read], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(read, 65536)
        if not chunk:
            return last, True
        buf += chunk
        *lines, buf = buf.split(b"\n")
        buf = buf[-65536:]      # a line that never ends: its tail only
        for line in lines:
            text = clip(line.decode(errors="replace").strip(), 300)
            if text:
                last = text
                progress("compiler-bisect", f"compiler bisection: {text}")


def run_repro_forked(script: Path, device: str, timeout: float = 300.0) -> ReproResult:
    """Run a repro script once, forked from the fork server (torch imported already: a fresh
    interpreter's import is most of a small repro's time; the server may have preloaded
    nanbisect: the script runs without it); what it said. Reproduced: exit 1 and its own
    "REPRODUCED:" line."""
    from nanbisect.report.rerun import ServerFork

    runner = ServerFork(start=_start)
    with proc.reaped(runner):    # an interrupt between the start and the result: ended, reaped
        runner.submit(script, device, timeout)
        if runner.child is None:
            return ReproResult(False, None, f"could not start: {runner.error}", ran=False)
        return runner.result()
