"""Replay a multi-rank bundle with its recorded world size and gather one report.

Guarantees (each one tested with real processes in tests/multirank/test_multirank_faults.py):
- the ranks are started by `nanbisect.multirank.spawn`: torchrun's environment and TCPStore, one
  process group (gloo on CPU, the device seam's backend elsewhere), each rank forked from one
  interpreter that imported torch once (a fresh interpreter per rank where the device seam says
  its extension cannot be forked); every rank runs ``--entry`` when the user gives one (checked
  here before any rank starts), else the entry its part recorded; an entry that is not the
  captured one makes a failure that does not come back ``code-changed``, not ``transient``;
- the whole replay, start-up included, is bounded by ``NANBISECT_RANK_TIMEOUT`` seconds (default
  600). At the deadline every rank still running is asked for its Python stacks (SIGUSR1; the
  worker's faulthandler writes them from C, even from inside a blocked collective), and the error
  names the rank that hung: the one still running code (its own, a library's or nanbisect's)
  while the others waited in a collective or inside torch. When every rank was waiting, it says
  where each one waited (the ranks took different control paths);
- a rank that raises is named with its error; a rank that dies is named with its signal or exit
  status, as the spawner saw it ("rank 1 was killed by SIGSEGV"), with the place
  faulthandler saw for a fatal signal; its peers' "connection closed" errors are not blamed;
- every failure is one line (`BadInput`: exit 2 from the CLI, no traceback);
- nothing is left behind. The run's files (rank results, stacks, the ranks' output) live in one
  private directory PARTIAL (``$TMPDIR/nanbisect-ranks-*``), and every process of the run has
  PARTIAL on its command line: when the replay ends, fails or times out, every such process is
  killed and PARTIAL removed before `launch` returns. When this process is killed instead, even
  by SIGKILL, the kernel releases its exclusive lock on ``PARTIAL/.lock``; a janitor (a small
  Python process without torch, in its own session, started before the ranks) waits for that
  lock, then kills every process of the run and removes PARTIAL, and every rank also waits for it
  and exits. A PARTIAL whose janitor was killed as well is removed by the next run (its lock is
  free). Only a kill in the few milliseconds between creating PARTIAL and starting the janitor
  can leave a directory for that next run to sweep.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from nanbisect import devices, proc
from nanbisect.bundle.format import Bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.errors import BadInput
from nanbisect.multirank.diagnose import (PEER_GONE, ask_stacks, died, exit_statuses, hang,
                                          rank_stage, where)
from nanbisect.multirank.rundir import PREFIX, kill_run, run_dir, sweep
from nanbisect.multirank.verdict import job_report, subset_report
from nanbisect.records import Losses, RankResult, RunFacts, StageError, after_verdict
from nanbisect.reference.compare import step_rtol
from nanbisect.replay.fidelity import check as fidelity_check
from nanbisect.replay.fidelity import tier_notes
from nanbisect.replay.replayer import resolve_entry
from nanbisect.report.model import Report
from nanbisect.report.repro import device_of
from nanbisect.report.prose import rebuild_note
from nanbisect.report.rerun import runner
from nanbisect.report.write import staged, write_report
from nanbisect.task import split_entry
from nanbisect.util.numbers import env
from nanbisect.options import RunOptions
from nanbisect.util.spec import DeviceSpec
from nanbisect.util.text import ranks_text, show
from nanbisect.util.torch_internals import check_torch_version

__all__ = ["PREFIX", "launch", "launch_alone", "rank_timeout", "run_multirank", "sweep",
           "where", "within_world"]


def rank_timeout() -> float:
    """NANBISECT_RANK_TIMEOUT as it is now (seconds, the whole replay)."""
    return env("NANBISECT_RANK_TIMEOUT", 600.0)


def _run_ranks(bundle: Bundle, ranks: list[int], target: DeviceSpec, partial: Path,
               timeout: float, *, alone: bool, per_host: int, inject: str | None,
               entry: str | None, reference: DeviceSpec | None, remedies: int = 0,
               run_top_level: bool = False) -> tuple[int | None, dict | None]:
    """Start ``ranks`` of the run through `nanbisect.multirank.spawn` (forked from one interpreter
    that imported torch, or fresh interpreters where the device seam says its ranks cannot be
    forked), wait at most ``timeout`` and kill whatever is left of the run. Returns the spawner's
    exit status and, when the deadline passed, the stacks of the ranks that had not written a
    result (None when it did not pass)."""
    fork = all(devices.entry(t.type).fork_ranks for t in (target, reference) if t is not None)
    # the devices reach each worker as their text (`DeviceSpec`'s str, which its parse inverts)
    worker = ["--target", str(target), "--timeout", str(timeout)] + (["--alone"] if alone else [])
    worker += ["--inject", inject] if inject else []
    worker += ["--entry", entry] if entry else []
    worker += ["--reference", str(reference)] if reference is not None else []
    worker += ["--remedies", str(remedies)] if remedies else []
    worker += ["--run-top-level"] if run_top_level else []
    cmd = [sys.executable, "-m", "nanbisect.multirank.spawn", f"--world={bundle.world_size}",
           f"--ranks={','.join(map(str, ranks))}", f"--per-host={per_host}",
           f"--statuses={partial / 'statuses.json'}"]
    cmd += [f"--logs={partial}"] if alone else ["--group"]
    cmd += [] if fork else ["--exec"]
    cmd += ["--preload=nanbisect.multirank.worker", "--preload=torch._dynamo", "--",
            "-m", "nanbisect.multirank.worker", str(bundle.path.resolve()), str(partial), *worker]
    stacks = p = None
    try:
        with open(partial / "ranks.log", "w") as log:
            p = _start_spawner(cmd, log.fileno())
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = ask_stacks(partial, [r for r in ranks
                                          if not (partial / f"rank{r}.json").is_file()])
    finally:
        if p is not None:       # on every path once started (an interrupt too)
            kill_run(p, partial)
    return p.returncode, stacks


def _start_spawner(cmd: list[str], log: int):
    """The spawner, in a session of its own: forked from the fork server this process came
    from when there is one (a triage replay, a test's CLI run: torch is imported there already,
    `nanbisect.proc.from_server`), else a fresh interpreter. Has ``pid``, ``wait``, ``poll``."""
    return (proc.from_server(cmd[1:], env=dict(os.environ), cwd=os.getcwd(), stdout=log,
                             stderr=log)
            or proc.start_exec(cmd, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True))


def launch(bundle: Bundle, target: DeviceSpec, inject: str | None, partial: Path,
           timeout: float | None = None, entry: str | None = None,
           reference: DeviceSpec | None = None, remedies: int = 0, run_top_level: bool = False
           ) -> list[RankResult]:
    """Run every rank; return their results, or raise BadInput naming the rank that failed.
    ``partial`` is the run's directory (`run_dir`); ``entry`` overrides every rank's;
    ``run_top_level``: every rank's `Replayer`'s."""
    timeout = rank_timeout() if timeout is None else timeout
    world = bundle.world_size
    code, stacks = _run_ranks(bundle, list(range(world)), target, partial, timeout, alone=False,
                              per_host=world, inject=inject, entry=entry, reference=reference,
                              remedies=remedies, run_top_level=run_top_level)
    log = (partial / "ranks.log").read_text(errors="replace")
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
    primary = [r for r, e in errors.items() if not any(s in e for s in PEER_GONE)]
    if primary:
        r = primary[0]
        hint = ("; a collective timed out: the ranks probably took different control paths "
                "(one skipped or added a collective)" if "imed out" in errors[r] else "")
        raise BadInput(f"rank {r} failed during replay: {errors[r]}{hint}")
    if stacks is not None:
        raise BadInput(hang(partial, world, timeout, {r.rank for r in results} | set(errors),
                            stacks))
    if missing:
        then = (f"; {ranks_text(sorted(errors))} then lost their peers" if errors else "")
        statuses, root = exit_statuses(partial)
        dead = [r for r in missing if statuses.get(r) not in (None, 0, -signal.SIGTERM)]
        first = root if root in dead else (dead[0] if dead else None)
        if first is not None:
            raise BadInput(died(partial, first, statuses[first], then))
        tail = " | ".join(line for line in log.strip().splitlines()[-3:])
        raise BadInput(f"{ranks_text(missing)} ended without a result (launcher exit {code}"
                       f"{': ' + tail if tail else ''}){then}; run those ranks' code alone")
    if errors:
        r = min(errors)
        raise BadInput(f"rank {r} failed during replay: {errors[r]}")
    return sorted(results, key=lambda r: r.rank)


def within_world(ranks: tuple[int, ...], world: int) -> list[int]:
    """``--ranks`` (`RunOptions.ranks`: sorted, each once) checked against the bundle's world
    size; `BadInput` naming the ones it lacks.

    >>> within_world((1, 3), 4)
    [1, 3]
    """
    if ranks[-1] >= world:
        raise BadInput(f"--ranks {show(','.join(map(str, ranks)))}: give rank numbers from 0 to "
                       f"{world - 1} separated by commas, e.g. --ranks 1 or --ranks 0,3")
    return list(ranks)


def launch_alone(bundle: Bundle, ranks: list[int], target: DeviceSpec, inject: str | None,
                 partial: Path, timeout: float, entry: str | None = None,
                 reference: DeviceSpec | None = None, remedies: int = 0,
                 run_top_level: bool = False) -> list[RankResult]:
    """Run each rank of ``ranks`` in a process of its own, without the other ranks
    (`multirank.alone`): no process group between them, every collective served what the
    capture recorded. Bounded by ``timeout`` as a lockstep replay is; nothing is left behind
    (the same run directory, janitor and kill as `launch`)."""
    too_old = check_torch_version("fake-process-group")
    if too_old is not None:
        raise BadInput(f"{too_old}; or replay every rank (without --ranks)")
    per_host = devices.entry(target.type).count()   # the CPU's: 1
    _, stacks = _run_ranks(bundle, ranks, target, partial, timeout, alone=True,
                           per_host=per_host or 1, inject=inject, entry=entry,
                           reference=reference, remedies=remedies,
                           run_top_level=run_top_level)
    hung = list(stacks or {})                # the ranks without a result at the deadline
    statuses, _ = exit_statuses(partial)
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
                           f"{w if w else 'did not say where it was'}"
                           f"{rank_stage(partial, r)}; fix that code, or raise "
                           "NANBISECT_RANK_TIMEOUT if it is only slow")
        else:
            raise BadInput(died(partial, r, statuses.get(r) or 1, " (replayed alone)"))
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


def _worst_loss(view: Manifest, results: list[RankResult]) -> tuple[float | None, object]:
    """(recorded, replayed) loss of the replayed rank whose replay is furthest from what it
    recorded (finite at capture and now); (None, None) when no rank's loss can tell."""
    worst, pair = -1.0, (None, None)
    for r in results:
        then = (view.part_observed.get(str(r.rank)) or {}).get("loss")
        now = r.summary.loss if r.summary is not None else None
        if not isinstance(then, float) or not isinstance(now, float):
            continue
        gap = abs(now - then) / abs(then) if then else abs(now - then)
        if gap > worst:
            worst, pair = gap, (then, now)
    return pair


def _step_tolerance(manifest: dict) -> tuple[str, float]:
    """The step-level tolerance of the parts' dtypes (the widest of them; float32 when the
    manifest names none)."""
    names = Manifest.of(manifest).dtypes
    known = [(d, step_rtol(getattr(torch, d))) for d in names
             if isinstance(getattr(torch, d, None), torch.dtype) and step_rtol(getattr(torch, d))]
    return max(known, key=lambda x: x[1]) if known else ("float32", step_rtol(torch.float32))


def run_multirank(bundle: Bundle, opts: RunOptions, out: Path,
                  placed: tuple[torch.device, torch.dtype | None],
                  ranks: list[int] | None = None) -> Report:
    """Replay all ranks (with ``opts.entry``'s Task when given), on ``opts.target`` and, unless
    ``opts.reference`` is none, on the reference too, then write one report for the job. With
    ``ranks``, only those, each alone (`launch_alone`). ``opts`` come with their devices filled
    in (`nanbisect.pipeline.run_bundle`), ``placed`` the target resolved to torch's device and
    dtype. ``opts.remedies``: the culprit rank's budget of extra replays (`nanbisect.remedies`;
    only a rank replayed alone can replay its step again)."""
    target, inject, run_repro_once = opts.target, opts.inject, opts.run_repro
    reference = None if opts.reference.none else opts.reference
    remedies, run_top_level = opts.remedies, opts.run_top_level
    entry = ranks_entry(opts.entry, bundle)
    timeout = rank_timeout()
    with run_dir() as partial:
        if ranks is None:
            results = launch(bundle, target, inject, partial, timeout, entry, reference,
                             remedies=remedies, run_top_level=run_top_level)
        else:
            results = launch_alone(bundle, ranks, target, inject, partial, timeout, entry,
                                   reference, remedies=remedies, run_top_level=run_top_level)
        view = Manifest.of(bundle)
        part = bundle.part(min(view.ranks))   # rank 0's, unless the bundle is partial
        used = entry or resolve_entry(part)
        original, replayed = _worst_loss(view, results)
        t_dev, t_dtype = placed
        fidelity = fidelity_check(part, used, original, replayed, same_setup=t_dtype is None
                                  and Manifest.of(part.manifest).captured_type == t_dev.type,
                                  override=entry is not None, device=t_dev,
                                  rtol=_step_tolerance(part.manifest),
                                  dtype_changed=t_dtype is not None)
        first = results[0].summary
        facts = RunFacts(str(bundle.path), view.entry, str(target), str(opts.reference),
                         view.part_observed,
                         Losses(original, replayed if original is not None else
                                (first.loss if first else None),
                                results[0].reference.loss if results[0].reference else None,
                                fidelity.bit_exact),
                         fidelity)
        report = (job_report(facts, bundle.world_size, view.backend, results)
                  if ranks is None else subset_report(facts, bundle.world_size, results))
        report = report.with_replicas(view.replicas)   # DDP replicas out of sync: a finding
        # the ranks' stages after their verdicts that failed, each said with its rank
        report = replace(report, errors=[*report.errors, *(
            StageError(e.stage, f"rank {r.rank}: {e.message}") for r in results
            for e in r.errors)])
        report = _noted(report, fidelity, view, str(target))
        with staged(out) as tmp:
            own = next((r for r in results if report.culprit is not None
                        and r.rank == report.culprit.rank and r.repro), None)
            if own is not None and report.classification != "communication":
                errors = list(report.errors)      # the verdict stands: a repro that fails is
                report = after_verdict(           # listed in the report's errors
                    errors, "repro", lambda: _with_repro(report, own, tmp, target, inject,
                                                         run_repro_once), report)
                report = replace(report, errors=errors)
            report = write_report(report, tmp)    # with the renderings that failed in errors
        return report


def _noted(report: Report, fidelity, view: Manifest, target: str) -> Report:
    """``report`` with the run's notes: the fidelity tier's, a rebuilt pre-state's, and code
    that changed since the capture (which makes a failure that did not come back
    ``code-changed``)."""
    notes = tier_notes(fidelity, target)
    rebuilt = next((n for n in (rebuild_note(observed) for _, observed
                                in sorted(view.part_observed.items())) if n), None)
    if rebuilt:     # the Guard rebuilt the failing step's pre-state (every rank did)
        notes.insert(0, rebuilt)
    if fidelity.code_changed:
        notes.insert(0, "the code differs from the capture's: "
                     + ", ".join(fidelity.code_changed) + "; every rank ran today's code")
        if report.verdict == "not-reproduced" and report.classification != "code-changed":
            report = replace(report, classification="code-changed", notes=[
                *report.notes, "the replay ran different code from the capture's: the "
                "edit, not the hardware, is the first suspect; replay with the captured "
                "code to tell"])     # --ranks: its own reasons came first
    return replace(report, notes=[*report.notes, *notes])


def _with_repro(report: Report, own: RankResult, tmp: Path, target: DeviceSpec,
                inject: str | None, run_repro_once: bool) -> Report:
    """``report`` with the culprit rank's repro copied into the report and run once."""
    shutil.copytree(Path(own.repro).parent, tmp / "repro")
    script = tmp / "repro" / "repro.py"
    if not run_repro_once:
        result = None
    else:     # a fork of this process (torch loaded) or of its fork server
        started = runner(target.type, report.culprit.op)
        with proc.reaped(started):     # an interrupt ends the run (`_Pending.close`)
            result = started.submit(script, device_of(target)).result()
    report = replace(report, repro="repro/repro.py", repro_result=result)
    if result is not None and not result.reproduced and inject:
        report = replace(report, notes=[*report.notes, (
            f"the repro did not reproduce on {target}: it runs the op without --inject "
            f"{inject}, which emulated the fault here; run repro/repro.py on the device that "
            "has the faulty kernel")])
    return report
