"""One bundle, in a worker: its replay in a process of its own (``nanbisect run`` in a new
session, forked from the worker's fork server, `nanbisect.proc`: torch is imported once per
worker, not once per bundle), guarded so that nothing outlives the process that started it.

Guarantees: `analyse_one` never raises; a hang, a crash or a missing report is a row of its own.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from nanbisect.errors import signal_name
from nanbisect.util.numbers import omp_threads
from nanbisect.nightly.cache import MAX_REPORT
from nanbisect.nightly.reports import place_report
from nanbisect import proc
from nanbisect.util import lockdir
from nanbisect.util.files import read_json

_STDERR_TAIL = 2000



def _guard_replay() -> None:
    """Called first in the replay process (in a session of its own: a fork of this worker's
    fork server, or ``python -c _CHILD run BUNDLE ...``), which then runs the CLI: it dies with
    its starter and a guardian kills its whole process group when the starter is done with it
    or dies (`nanbisect.proc.guard_group`), then removes the replay's scratch directory (which a
    starter killed by SIGKILL cannot)."""
    fd = int(os.environ.pop("NANBISECT_TRIAGE_FD"))
    starter = int(os.environ.pop("NANBISECT_TRIAGE_PARENT") or os.getppid())
    scratch = os.environ.pop("NANBISECT_TRIAGE_TMP", "")
    proc.guard_group(fd, starter, lambda said: _clear(scratch, said))
    sys.argv[0] = "nanbisect"


def _clear(scratch: str, said: bytes) -> None:
    """In the guardian, once the replay's group is gone: its scratch directory, and the run's
    when the starter died (it wrote no ``done``) and so did the run (its lock is free)."""
    if os.path.basename(scratch).startswith("nanbisect-triage-"):
        shutil.rmtree(scratch, ignore_errors=True)
        up = os.path.dirname(scratch)
        if not said.startswith(b"done") and os.path.basename(up).startswith(
                "nanbisect-triage-") and lockdir.freed(up, 2.0):
            shutil.rmtree(up, ignore_errors=True)


# the fork server's warm-up for `nanbisect run` (named: importing it would import torch here)
REPLAY_WARM = "nanbisect.pipeline.run:warm_fork_server"
_CHILD = ("from nanbisect.nightly.one_bundle import _guard_replay; _guard_replay(); "
          "from nanbisect.cli import main; main()")
# the replays this process is running: killed when the triage process is gone
_active = proc.Processes()


_SIGNAL_HINT = {"SIGKILL": " (as the out-of-memory killer does)", "SIGSEGV": " (a crash in native "
                "code)", "SIGABRT": " (os.abort or a failed native assertion)"}


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("nanbisect: error: "):
            return ln[len("nanbisect: error: "):]
    return lines[-1][:300] if lines else "no message"


def _read_report(report_dir: Path) -> dict | None:
    data = read_json(report_dir / "report.json", MAX_REPORT)
    return data if isinstance(data, dict) and isinstance(data.get("verdict"), str) else None


def _forks() -> bool:
    """Replays are forked from this worker's fork server (torch imported once per worker)
    unless ``NANBISECT_TRIAGE_FORK=0`` or the platform has no fork and descriptor passing."""
    return (os.environ.get("NANBISECT_TRIAGE_FORK", "1") != "0" and hasattr(os, "fork")
            and hasattr(socket, "send_fds") and hasattr(socket, "SOCK_SEQPACKET"))


def _start(args: list[str], r: int, err: int, tmp: Path, cwd: str | None):
    """Start ``nanbisect ARGS`` in a session of its own, guarded by the read end ``r`` of the
    starter's pipe (`_guard_replay`): forked from this worker's fork server, or, when that is
    off or cannot start, a fresh interpreter. Returns what has ``pid``, ``wait``, ``poll``."""
    env = {**os.environ, "NANBISECT_TRIAGE_TMP": str(tmp)}
    if _forks():
        try:
            return proc.ForkServer.get(warm=REPLAY_WARM).start(
                ["-m", "nanbisect", *args], cwd=cwd or os.getcwd(), stderr=err,
                env={**env, "NANBISECT_TRIAGE_PARENT": ""}, keep={"NANBISECT_TRIAGE_FD": r},
                prelude="nanbisect.nightly.one_bundle:_guard_replay", share=True)
        except OSError:
            pass                        # a fresh interpreter, as without the server
    env.update(NANBISECT_TRIAGE_FD=str(r), NANBISECT_TRIAGE_PARENT=str(os.getpid()))
    return proc.start_exec([sys.executable, "-c", _CHILD, *args], stdout=subprocess.DEVNULL,
                           stderr=err, pass_fds=(r,), start_new_session=True, env=env, cwd=cwd)


def _run_args(bundle: str, out: Path, options: dict) -> list[str]:
    """The `nanbisect run` arguments of one bundle's replay into ``out``."""
    args = ["run", bundle, "--out", str(out),
            "--reference", str(options.get("reference") or "none")]
    if options.get("target"):
        args += ["--target", str(options["target"])]
    # the code on disk by default: a night's triage says which failures today's code still has
    # (a fixed bug does not keep its old culprit); "bundle" replays each bundle's own copy
    args += ["--code", str(options.get("code") or "local")]
    return args


def _outcome(rc: int, tmp: Path, out: Path, keep: str | None) -> dict:
    """What a replay that exited with ``rc`` gave: {report[, report_dir | report_error]} (its
    report directory ``out`` placed at ``keep`` when given, or why it could not be), or
    {error, kind[, stderr]}."""
    stderr = _tail(tmp / "stderr")
    report = _read_report(out) if rc in (0, 1, 3) else None
    if report is not None:
        why = place_report(out, Path(keep)) if keep else None
        kept = {} if not keep else {"report_dir": keep} if why is None else {"report_error": why}
        return {"report": report, **kept}
    extra = {"stderr": stderr[-_STDERR_TAIL:]} if stderr.strip() else {}
    if rc < 0:
        name = signal_name(-rc)
        return {"error": f"replay killed by signal {name}{_SIGNAL_HINT.get(name, '')}",
                "kind": "signal", **extra}
    if rc == 2:
        return {"error": _reason(stderr), "kind": "bad-input", **extra}
    return {"error": f"replay exited with code {rc} without a report: {_reason(stderr)}",
            "kind": "crash", **extra}


def analyse_one(bundle: str, options: dict, timeout: float, parent: int,
                 cwd: str | None = None, scratch: str | None = None,
                 keep: str | None = None) -> dict:
    """Replay one bundle with `nanbisect run` in a fresh process; never raises. Its scratch
    directory goes under ``scratch`` (the triage run's, when this machine has it); its report
    directory is kept at ``keep`` (`place`), when given and writable from here.

    Returns {bundle, report, seconds[, report_dir | report_error]} or {bundle, error, kind,
    seconds[, stderr]}."""
    t0 = time.monotonic()

    def done(**kw) -> dict:
        return {"bundle": bundle, "seconds": round(time.monotonic() - t0, 2),
                "worker": f"{socket.gethostname()}:{os.getpid()}",
                # this worker's share of the cores, which its replays keep (joblib sets it in
                # each worker before its fork server imports torch; None: one worker, the
                # capture's count): `nanbisect.replay.fidelity.match_threads`
                "threads": omp_threads(), **kw}

    try:
        # in a loky worker: when the triage process is gone (kill -9 included), kill our
        # replays and exit, instead of waiting for them as loky would (not on a cluster's
        # worker, which is no child of triage)
        proc.exit_when_orphaned(parent, _active, code=70)
        # held while this replay runs: a sweep elsewhere (another PID namespace too) leaves it
        tmp, lock = lockdir.make("nanbisect-triage-", scratch if scratch and
                                 os.path.isdir(scratch) else None)
    except Exception as e:  # noqa: BLE001
        return done(error=f"could not start the replay ({type(e).__name__}: {e})", kind="crash")
    child = None
    r = w = -1
    try:
        out = tmp / "report"            # `run --out` refuses existing directories: a fresh path
        args = _run_args(bundle, out, options)
        r, w = os.pipe()
        with open(tmp / "stderr", "wb") as err:
            child = _start(args, r, err.fileno(), tmp,
                           cwd if cwd and os.path.isdir(cwd) else None)
        os.close(r)
        r = -1
        _active.add(child.pid, child)
        rc = proc.finish(child, timeout)      # past it: its group killed, and reaped
        if rc is None:
            return done(error=f"replay exceeded --timeout {timeout:g}s and was killed",
                        kind="timeout")
        return done(**_outcome(rc, tmp, out, keep))
    except Exception as e:  # noqa: BLE001 - one bundle must never stop the night
        return done(error=f"replay could not run ({type(e).__name__}: {str(e)[:300]})",
                    kind="crash")
    finally:
        if child is not None:
            # interrupted while waiting: the replay goes too, reaped (the first error wins)
            proc.stop(child, reraise=sys.exc_info()[0] is None)
            _active.discard(child.pid)
        if w >= 0:
            with contextlib.suppress(OSError):
                os.write(w, b"done")    # a finish, not a death: the run's directory stays
        for fd in (r, w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)       # closing w lets the guardian clear the process group
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
