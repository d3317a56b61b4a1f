"""Replay a multi-rank bundle with its recorded world size and gather one report.

Guarantees: the ranks are started by torch.distributed's own launcher (``torch.distributed.run``,
gloo on CPU, nccl on CUDA) in a new process session; the whole replay is bounded by a timeout
after which every process of that session is killed; a rank that raises, exits or hangs ends the
run with a one-line error naming the rank (exit 2), and no process is left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from nanbisect.bundle.format import Bundle
from nanbisect.errors import BadInput
from nanbisect.multirank.verdict import job_report
from nanbisect.records import Losses, RankResult, RunFacts
from nanbisect.report.model import Report
from nanbisect.report.repro import run_repro
from nanbisect.report.write import staged, write_report

DEFAULT_TIMEOUT = float(os.environ.get("NANBISECT_RANK_TIMEOUT", "600"))


# errors a rank sees when a peer died or left: consequences, not causes
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def _kill_session(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def launch(bundle: Bundle, target: str, inject: str | None, partial: Path,
           timeout: float = DEFAULT_TIMEOUT) -> list[RankResult]:
    """Run every rank; return their results, or raise BadInput naming the rank that failed."""
    world = bundle.world_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc-per-node={world}", "--max-restarts=0", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", "-m", "nanbisect.multirank.worker",
           str(bundle.path.resolve()), str(partial), "--target", target,
           "--timeout", str(timeout)]
    if inject:
        cmd += ["--inject", inject]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        log, _ = p.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        _kill_session(p)
        log = ""
    _kill_session(p)  # workers that outlived their launcher, if any
    results, missing, errors = [], [], {}
    for r in range(world):
        f = partial / f"rank{r}.json"
        if not f.is_file():
            missing.append(r)
            continue
        res = RankResult.from_json(json.loads(f.read_text()))
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
    if missing:
        tail = " | ".join(line for line in log.strip().splitlines()[-3:]) if log else ""
        then = (f"; rank(s) {sorted(errors)} then lost their peers" if errors else "")
        raise BadInput(f"rank(s) {missing} ended without a result within {timeout:.0f}s "
                       "(crashed, exited, or waited in a collective the other ranks never joined: "
                       f"a different control path){then} (launcher exit {p.returncode}"
                       f"{': ' + tail if tail else ''}); run those ranks' code alone, or raise "
                       "NANBISECT_RANK_TIMEOUT")
    if errors:
        r = min(errors)
        raise BadInput(f"rank {r} failed during replay: {errors[r]}")
    return sorted(results, key=lambda r: r.rank)


def run_multirank(bundle: Bundle, target: str, inject: str | None, out: Path,
                  run_repro_once: bool = True) -> Report:
    """Replay all ranks, then write one report for the job."""
    partial = Path(tempfile.mkdtemp(prefix="nanbisect-ranks-"))
    try:
        results = launch(bundle, target, inject, partial)
        m = bundle.manifest
        first = results[0].summary
        facts = RunFacts(str(bundle.path), m["entry"], target, "none",
                         {r: info.get("observed") for r, info in m["ranks"].items()},
                         Losses(None, first.loss if first else None))
        report = job_report(facts, bundle.world_size, m.get("backend"), results)
        with staged(out) as tmp:
            own = next((r for r in results if report.culprit is not None
                        and r.rank == report.culprit.rank and r.repro), None)
            if own is not None and report.classification == "unknown":
                shutil.copytree(Path(own.repro).parent, tmp / "repro")
                result = run_repro(tmp / "repro" / "repro.py", target) if run_repro_once \
                    else None
                report = replace(report, repro="repro/repro.py", repro_result=result)
            write_report(report, tmp)
        return report
    finally:
        shutil.rmtree(partial, ignore_errors=True)
