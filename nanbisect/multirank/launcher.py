"""Replay a multi-rank bundle with its recorded world size and gather one report.

Guarantees (each one tested with real processes in tests/test_multirank_faults.py):
- the ranks are started by torch.distributed's own launcher (``torch.distributed.run``, gloo on
  CPU, nccl on CUDA); every rank runs ``--entry`` when the user gives one (checked here before any
  rank starts), else the entry its part recorded; an entry that is not the captured one makes a
  failure that does not come back ``code-changed``, not ``transient``;
- the whole replay, start-up included, is bounded by ``NANBISECT_RANK_TIMEOUT`` seconds (default
  600). At the deadline every rank still running is asked for its Python stacks (SIGUSR1; the
  worker's faulthandler writes them from C, even from inside a blocked collective), and the error
  names the rank that hung: the one still running code (its own, a library's or nanbisect's)
  while the others waited in a collective or inside torch. When every rank was waiting, it says
  where each one waited (the ranks took different control paths);
- a rank that raises is named with its error; a rank that dies is named with its signal or exit
  status, read from torchrun's failure report ("rank 1 was killed by SIGSEGV"), with the place
  faulthandler saw for a fatal signal; its peers' "connection closed" errors are not blamed;
- every failure is one line (`BadInput`: exit 2 from the CLI, no traceback);
- nothing is left behind. The run's files (rank results, stacks, torchrun's logs) live in one
  private directory PARTIAL (``$TMPDIR/nanbisect-ranks-*``), and every process of the run has
  PARTIAL on its command line: when the replay ends, fails or times out, every such process is
  killed and PARTIAL removed before `launch` returns. When this process is killed instead, even
  by SIGKILL, the kernel releases its exclusive lock on ``PARTIAL/.lock``; a janitor (a small
  Python process without torch, in its own session, started before torchrun) waits for that
  lock, then kills every process of the run and removes PARTIAL, and every rank also waits for it
  and exits. A PARTIAL whose janitor was killed as well is removed by the next run (its lock is
  free). Only a kill in the few milliseconds between creating PARTIAL and starting the janitor
  can leave a directory for that next run to sweep.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from nanbisect import devices
from nanbisect.bundle.format import Bundle
from nanbisect.errors import BadInput, signal_name
from nanbisect.multirank.verdict import job_report, subset_report
from nanbisect.records import Losses, RankResult, RunFacts
from nanbisect.replay.fidelity import check as fidelity_check
from nanbisect.replay.replayer import resolve_entry
from nanbisect.report.model import Report
from nanbisect.report.rerun import Fork, run_repro
from nanbisect.report.write import staged, write_report
from nanbisect.task import split_entry
from nanbisect.util.env import env_number
from nanbisect.util.files import read_json as _read_json

PREFIX = "nanbisect-ranks-"


def rank_timeout() -> float:
    """NANBISECT_RANK_TIMEOUT as it is now (seconds, the whole replay)."""
    return env_number("NANBISECT_RANK_TIMEOUT", 600.0, float, empty_is_default=False,
                      shown=repr, what="a positive number of seconds",
                      fix="set it to e.g. 600 or unset it")


# errors a rank sees when a peer died or left: consequences, not causes
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


# ------------------------------------------------------------------------------------------
# the run's private directory, its lock, its janitor

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
            if key in b"\0" + f.read():
                os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
shutil.rmtree(run, ignore_errors=True)
"""


def run_processes(partial: Path) -> list[int]:
    """The live processes that name ``partial`` as one of their arguments (torchrun, the ranks)."""
    key, out = b"\0" + os.fsencode(str(partial)) + b"\0", []
    for d in (Path("/proc").iterdir() if Path("/proc").is_dir() else []):
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if key in b"\0" + (d / "cmdline").read_bytes():   # empty for zombies
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _kill_run(p: subprocess.Popen, partial: Path) -> None:
    """SIGKILL torchrun's session and every process of the run (torchrun starts each rank in a
    session of its own), then wait until none is left (5 s at most)."""
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
            try:
                janitor.wait(timeout=10)
            except subprocess.TimeoutExpired:
                janitor.kill()
                janitor.wait()


# ------------------------------------------------------------------------------------------
# where each rank is: its state file and the stacks faulthandler wrote

_TORCH = str(Path(torch.__file__).parent) + os.sep
_OURS = str(Path(__file__).resolve().parent.parent) + os.sep   # nanbisect/
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k])) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({str(Path(sysconfig.get_paths()[k])) + os.sep for k in ("purelib", "platlib")})
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def _category(path: str) -> str | None:
    """What a frame's file is: None for the standard library (looked through)."""
    if path.startswith("<frozen") or path.startswith(_STDLIB) and not path.startswith(_SITE):
        return None
    if path.startswith(_TORCH):
        return "collective" if path.startswith(_TORCH + "distributed" + os.sep) else "torch"
    if path.startswith(_OURS):
        return "nanbisect"
    return "library" if path.startswith(_SITE) else "user"


@dataclass(frozen=True)
class Where:
    """A rank's innermost frame that is not the standard library's."""

    category: str          # collective | torch | nanbisect | library | user
    at: str                # "file.py:12 in func"

    @property
    def waiting(self) -> bool:
        return self.category in ("collective", "torch")

    def __str__(self) -> str:
        return {"collective": "waited in a collective", "torch": "was inside torch",
                "nanbisect": "was still inside nanbisect",
                "library": "was still running library code",
                "user": "was still running its own code"}[self.category] + f" at {self.at}"


def where(dump: str) -> Where | None:
    """The main thread's innermost non-stdlib frame in a faulthandler dump (the last dump)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Current thread 0x", "Thread 0x")):
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].append((m[1], int(m[2]), m[3]))
    # the main thread is the one not started by `threading` (frames are innermost first)
    main = [t for t in threads if t and not any(
        f[2] in ("_bootstrap", "_bootstrap_inner") and f[0].endswith("threading.py") for f in t)]
    for path, line, func in (main[0] if main else []):
        cat = _category(path)
        if cat is not None:
            return Where(cat, f"{Path(path).name}:{line} in {func}")
    return None


def _stacks(partial: Path, ranks: list[int]) -> dict[int, Where | None]:
    """Ask every rank in ``ranks`` for its stacks (SIGUSR1) and read where each one is."""
    def size(r: int) -> int:
        try:
            return (partial / f"rank{r}.stacks").stat().st_size
        except OSError:
            return 0

    before, live = {}, run_processes(partial)
    for r in ranks:
        state = _read_json(partial / f"rank{r}.state")
        pid = state.get("pid") if state else None
        if isinstance(pid, int) and pid in live:
            before[r] = size(r)
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:   # until every dump is written and has stopped growing
        time.sleep(0.2)
        now = {r: size(r) for r in before}
        if all(now[r] > before[r] for r in before) and now == sizes:
            break
        sizes = now
    out = {}
    for r in ranks:
        text = ""
        if r in before:
            try:
                with open(partial / f"rank{r}.stacks", errors="replace") as f:
                    f.seek(before[r])
                    text = f.read()
            except OSError:
                pass
        out[r] = where(text) if text else None
    return out


# ------------------------------------------------------------------------------------------
# what torchrun saw

_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def exit_statuses(log: str) -> tuple[dict[int, int], int | None]:
    """(rank -> exit status, the first rank that failed) from torchrun's failure report; a
    negative status is the signal that killed the rank."""
    statuses = {int(m[1]): int(m[2]) for m in _FAILURE.finditer(log)}
    root = None
    at = log.find("Root Cause")
    if at >= 0:
        m = _FAILURE.search(log, at)
        root = int(m[1]) if m else None
    return statuses, root


def _stage(partial: Path, r: int) -> str:
    state = _read_json(partial / f"rank{r}.state")
    return f" ({state['stage']})" if state and state.get("stage") else ""


def _died(partial: Path, r: int, status: int, then: str) -> str:
    """One line for a rank that ended without a result."""
    stage = _stage(partial, r)
    if status > 0:
        return (f"rank {r} exited with status {status} during the replay without a result"
                f"{stage}{then}: the entry's code ended the process (os._exit, exit() in a C "
                "library?); run that rank's code alone")
    name = signal_name(-status)
    dump = ""
    try:
        dump = (partial / f"rank{r}.stacks").read_text(errors="replace")
    except OSError:
        pass
    fatal = where(dump) if "Fatal Python error" in dump else None
    at = f" at {fatal.at}" if fatal else " during the replay"
    why = ("SIGKILL comes from outside the process: the kernel's OOM killer (see dmesg) or a "
           "kill -9" if -status == signal.SIGKILL else
           "a crash in native code (an extension, a kernel, ctypes) at that place"
           if -status in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                          signal.SIGABRT) else f"something sent it {name}")
    return (f"rank {r} was killed by {name}{at}{stage}{then}; {why}; run that "
            "rank's code alone")


def _hang(partial: Path, world: int, timeout: float, finished: set[int],
          stacks: dict[int, Where | None]) -> str:
    """One line for a replay that outlived its deadline, naming the rank that hung: the one still
    running code (or never started) while the others waited."""
    def state(r: int) -> dict | None:
        return _read_json(partial / f"rank{r}.state")

    def said(r: int) -> str:
        if r in finished:
            return f"rank {r} had finished"
        if state(r) is None:
            return f"rank {r} had not started its replay"
        w = stacks.get(r)
        return f"rank {r} {w if w else 'did not say where it was'}{_stage(partial, r)}"

    running = [r for r in range(world) if r not in finished and (
        state(r) is None or (stacks.get(r) is not None and not stacks[r].waiting))]
    if running:
        others = [said(r) for r in range(world) if r not in running]
        who = f"rank {running[0]}" if len(running) == 1 else f"ranks {running}"
        return (f"{who} hung: after {timeout:.0f}s " + "; ".join(said(r) for r in running)
                + (", while " + "; ".join(others) + ", waiting for it" if others else "")
                + "; fix that code, or raise NANBISECT_RANK_TIMEOUT if it is only slow")
    return (f"no rank finished within {timeout:.0f}s: " + "; ".join(said(r) for r in range(world))
            + "; the ranks probably took different control paths (one skipped or added a "
            "collective), or a collective never completed; run those ranks' code alone, or "
            "raise NANBISECT_RANK_TIMEOUT")


# ------------------------------------------------------------------------------------------


def launch(bundle: Bundle, target: str, inject: str | None, partial: Path,
           timeout: float | None = None, entry: str | None = None,
           reference: str | None = None) -> list[RankResult]:
    """Run every rank; return their results, or raise BadInput naming the rank that failed.
    ``partial`` is the run's directory (`run_dir`); ``entry`` overrides every rank's."""
    timeout = rank_timeout() if timeout is None else timeout
    world = bundle.world_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc-per-node={world}", "--max-restarts=0", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", f"--log-dir={partial / 'torchrun'}",
           "-m", "nanbisect.multirank.worker",
           str(bundle.path.resolve()), str(partial), "--target", target,
           "--timeout", str(timeout)]
    if inject:
        cmd += ["--inject", inject]
    if entry:
        cmd += ["--entry", entry]
    if reference:
        cmd += ["--reference", reference]
    log_path = partial / "torchrun.log"
    with open(log_path, "w") as log_file:
        p = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    stacks = None
    try:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            done = [r for r in range(world) if (partial / f"rank{r}.json").is_file()]
            stacks = _stacks(partial, [r for r in range(world) if r not in done])
    finally:
        _kill_run(p, partial)
    log = log_path.read_text(errors="replace")
    results, missing, errors = [], [], {}
    for r in range(world):
        f = partial / f"rank{r}.json"
        if not f.is_file():
            missing.append(r)
            continue
        try:
            res = RankResult.from_json(json.loads(f.read_text()))
        except (OSError, ValueError, KeyError, TypeError):   # cut short (killed, disk full)
            missing.append(r)
            continue
        if res.error is not None:
            errors[r] = res.error
        else:
            results.append(res)
    # a rank that fails makes its peers fail too ("connection closed by peer"): name the cause
    primary = [r for r, e in errors.items() if not any(s in e for s in _PEER_GONE)]
    if primary:
        r = primary[0]
        hint = ("; a collective timed out: the ranks probably took different control paths "
                "(one skipped or added a collective)" if "imed out" in errors[r] else "")
        raise BadInput(f"rank {r} failed during replay: {errors[r]}{hint}")
    if stacks is not None:
        raise BadInput(_hang(partial, world, timeout, {r.rank for r in results} | set(errors),
                             stacks))
    if missing:
        then = (f"; rank(s) {sorted(errors)} then lost their peers" if errors else "")
        statuses, root = exit_statuses(log)
        dead = [r for r in missing if statuses.get(r) not in (None, 0, -signal.SIGTERM)]
        first = root if root in dead else (dead[0] if dead else None)
        if first is not None:
            raise BadInput(_died(partial, first, statuses[first], then))
        tail = " | ".join(line for line in log.strip().splitlines()[-3:])
        raise BadInput(f"rank(s) {missing} ended without a result (launcher exit {p.returncode}"
                       f"{': ' + tail if tail else ''}){then}; run those ranks' code alone")
    if errors:
        r = min(errors)
        raise BadInput(f"rank {r} failed during replay: {errors[r]}")
    return sorted(results, key=lambda r: r.rank)


def parse_ranks(spec: str, world: int) -> list[int]:
    """``--ranks 1,3`` -> [1, 3] (sorted, each once); `BadInput` for anything else.

    >>> parse_ranks("3, 1", 4)
    [1, 3]
    """
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        ranks = []
    if not ranks or any(not 0 <= r < world for r in ranks):
        raise BadInput(f"--ranks {spec!r}: give rank numbers from 0 to {world - 1} separated by "
                       "commas, e.g. --ranks 1 or --ranks 0,3")
    return ranks


def launch_alone(bundle: Bundle, ranks: list[int], target: str, inject: str | None,
                 partial: Path, timeout: float, entry: str | None = None,
                 reference: str | None = None) -> list[RankResult]:
    """Run each rank of ``ranks`` in a process of its own, without the other ranks
    (`multirank.alone`): no process group between them, every collective served what the
    capture recorded. Bounded by ``timeout`` as a lockstep replay is; nothing is left behind
    (the same run directory, janitor and kill as `launch`)."""
    world = bundle.world_size
    base = [sys.executable, "-m", "nanbisect.multirank.worker", str(bundle.path.resolve()),
            str(partial), "--alone", "--target", target, "--timeout", str(timeout)]
    base += ["--inject", inject] if inject else []
    base += ["--entry", entry] if entry else []
    base += ["--reference", reference] if reference else []
    t_dev = devices.parse(target)[0]
    gpus = devices.entry(t_dev).count() if t_dev.type != "cpu" else 0
    procs: dict[int, subprocess.Popen] = {}
    try:
        for i, r in enumerate(ranks):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(i % gpus if gpus else 0)}
            with open(partial / f"rank{r}.log", "w") as log:
                procs[r] = subprocess.Popen(base, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=env)
        deadline = time.monotonic() + timeout
        hung: list[int] = []
        for r, p in procs.items():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(r)
        stacks = _stacks(partial, hung) if hung else {}
    finally:
        for p in procs.values():
            _kill_run(p, partial)
    results, errors = [], {}
    for r in ranks:
        res = None
        try:
            res = RankResult.from_json(json.loads((partial / f"rank{r}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if res is not None and res.error is None:
            results.append(res)
        elif res is not None:
            errors[r] = res.error
        elif r in hung:
            w = stacks.get(r)
            raise BadInput(f"rank {r} hung: after {timeout:.0f}s, replayed alone, it "
                           f"{w if w else 'did not say where it was'}{_stage(partial, r)}; fix "
                           "that code, or raise NANBISECT_RANK_TIMEOUT if it is only slow")
        else:
            raise BadInput(_died(partial, r, procs[r].returncode or 1, " (replayed alone)"))
    if errors:
        r = min(errors)
        raise BadInput(f"rank {r} failed during replay (alone, collectives served as "
                       f"recorded): {errors[r]}")
    return results


def ranks_entry(entry: str | None, bundle: Bundle) -> str | None:
    """``--entry`` as every rank must import it (a file made absolute: the ranks look for it
    from here or from the bundle, as a one-rank replay does); fails before any rank starts."""
    if entry is None:
        return None
    target, func = split_entry(entry)
    if not target.endswith(".py"):
        return entry
    for cand in (Path(target), bundle.path / target):
        if cand.is_file():
            return f"{cand.resolve()}:{func}"
    raise BadInput(f"--entry file '{target}' not found (looked in the working directory and "
                   f"{bundle.path}); pass --entry with the file's path")


def run_multirank(bundle: Bundle, target: str, inject: str | None, out: Path,
                  run_repro_once: bool = True, entry: str | None = None,
                  reference: str | None = None, ranks: list[int] | None = None) -> Report:
    """Replay all ranks (with ``entry``'s Task when given), on the target and, with
    ``reference``, on the reference too, then write one report for the job. With ``ranks``,
    only those, each alone (`launch_alone`)."""
    entry = ranks_entry(entry, bundle)
    timeout = rank_timeout()
    with run_dir() as partial:
        if ranks is None:
            results = launch(bundle, target, inject, partial, timeout, entry, reference)
        else:
            results = launch_alone(bundle, ranks, target, inject, partial, timeout, entry,
                                   reference)
        m = bundle.manifest
        part = bundle.part(0)
        used = entry or resolve_entry(part)
        fidelity = fidelity_check(part, used, None, None, same_setup=False,
                                  override=entry is not None)
        first = results[0].summary
        facts = RunFacts(str(bundle.path), m["entry"], target, reference or "none",
                         {r: info.get("observed") for r, info in m["ranks"].items()},
                         Losses(None, first.loss if first else None,
                                results[0].reference.loss if results[0].reference else None),
                         fidelity)
        report = (job_report(facts, bundle.world_size, m.get("backend"), results)
                  if ranks is None else subset_report(facts, bundle.world_size, results))
        report = report.with_replicas(m.get("replicas"))   # DDP replicas out of sync: a finding
        if fidelity.code_changed:
            notes = ["the code differs from the capture's: " + ", ".join(fidelity.code_changed)
                     + "; every rank ran today's code"]
            if report.verdict == "not-reproduced":
                report = replace(report, classification="code-changed", notes=[
                    *report.notes, *notes, "the replay ran different code from the capture's: "
                    "the edit, not the hardware, is the first suspect; replay with the captured "
                    "code to tell"])
            else:
                report = replace(report, notes=[*report.notes, *notes])
        with staged(out) as tmp:
            own = next((r for r in results if report.culprit is not None
                        and r.rank == report.culprit.rank and r.repro), None)
            if own is not None and report.classification != "communication":
                shutil.copytree(Path(own.repro).parent, tmp / "repro")
                script = tmp / "repro" / "repro.py"
                if not run_repro_once:
                    result = None
                elif Fork.usable(target.split(":")[0], report.culprit.op):
                    result = Fork().submit(script, target).result()   # torch loaded here
                else:
                    result = run_repro(script, target)
                report = replace(report, repro="repro/repro.py", repro_result=result)
                if result is not None and not result.reproduced and inject:
                    report = replace(report, notes=[*report.notes, (
                        f"the repro did not reproduce on {target}: it runs the op without "
                        f"--inject {inject}, which emulated the fault here; run repro/repro.py "
                        "on the device that has the faulty kernel")])
            write_report(report, tmp)
        return report
