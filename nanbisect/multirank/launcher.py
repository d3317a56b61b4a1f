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
from pathlib import Path

from nanbisect.locate.producers import Culprit
from nanbisect.bundle.format import Bundle
from nanbisect.errors import BadInput
from nanbisect.report.model import Report
from nanbisect.report.write import staged, write_report
from nanbisect.report.repro import run_repro

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
           timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
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
        res = json.loads(f.read_text())
        if "error" in res:
            errors[r] = res["error"]
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
    return sorted(results, key=lambda r: r["rank"])


def _where(root: dict) -> str:
    return (f" in {root['module'] or '<root>'} call {root['module_call']}"
            if root.get("module_call") is not None else "")


def run_multirank(bundle: Bundle, target: str, inject: str | None, out: Path,
                  run_repro_once: bool = True) -> Report:
    """Replay all ranks, then write one report for the job."""
    partial = Path(tempfile.mkdtemp(prefix="nanbisect-ranks-"))
    try:
        results = launch(bundle, target, inject, partial)
        return _report(bundle, results, target, out, run_repro_once)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _report(bundle: Bundle, results: list[dict], target: str, out: Path,
            run_repro_once: bool) -> Report:
    m = bundle.manifest
    plan = results[0]["plan"]
    observed = {r: info.get("observed") for r, info in m["ranks"].items()}
    ranks = []
    for res in results:
        s = res["summary"]
        ranks.append({"rank": res["rank"], "phase": s.get("phase"), "loss": s.get("loss"),
                      "reduction_in_bad": s.get("reduce_in_bad"),
                      "reduction_out_bad": s.get("reduce_out_bad"),
                      "buckets": s.get("buckets", []), "module_stats": res.get("module_stats"),
                      "root": res.get("root")})
    common = dict(replay={"original_loss": None, "target_loss": results[0]["summary"].get("loss"),
                          "reference_loss": None}, bundle=str(bundle.path), entry=m["entry"],
                  target=target, reference="none", observed=observed)
    phase, culprit_rank = plan["phase"], plan["rank"]
    notes = [f"replayed with world size {bundle.world_size} ({m.get('backend')})"]
    with staged(out) as tmp:
        repro = result = None
        if phase is None:
            report = Report("not-reproduced" if any(observed.values()) else "clean",
                            "transient" if any(observed.values()) else None, None, None, None,
                            notes=notes, ranks=ranks, **common)
        elif phase == "input":
            report = Report("input-nonfinite", "data", "input", None, None, notes=notes +
                            [f"rank {culprit_rank} holds non-finite values before the step"],
                            ranks=ranks, **common)
        elif phase == "grad-reduce":
            bad = [b for r in ranks for b in r["buckets"] if b["out_nan"] or b["out_inf"]]
            params = bad[0]["params"] if bad else []
            culprit = Culprit("grad-reduce", (params[0].rpartition(".")[0] if params else ""),
                              None, [], [], None, op=None, op_index=None, rank=ranks[0]["rank"],
                              parameter=params[0] if params else None)
            notes.append("every rank's gradients were finite going into the reduction and "
                         "non-finite coming out of it: the collective (or the comm hook around "
                         f"it) is at fault; first bad bucket holds {params[:4]}")
            report = Report("culprit", "communication", "grad-reduce",
                            "nan" if bad and bad[0]["out_nan"] else "inf", culprit, notes=notes,
                            ranks=ranks, **common)
        elif plan.get("through_collective"):
            root = results[culprit_rank]["root"]
            if phase == "backward":   # a collective in backward reduces gradients
                phase = "grad-reduce"
            culprit = Culprit(phase, root["module"] or "", root["module_call"],
                              root["input_dtypes"], root["input_shapes"], None, op=root["op"],
                              op_index=root["op_index"], rank=culprit_rank)
            notes.append(f"on every rank that failed ({[r['rank'] for r in ranks if r['root']]}) "
                         f"the failure traces back to the output of {root['op']}{_where(root)}, "
                         "whose inputs were finite on every rank: no rank computed it, the "
                         "collective (or the code around it) is at fault")
            report = Report("culprit", "communication", phase, results[culprit_rank]["summary"]
                            .get("kind") or "nan", culprit, notes=notes, ranks=ranks, **common)
        else:
            own = results[culprit_rank]
            c = own.get("culprit") or {}
            culprit = Culprit(**c) if c else Culprit(phase, "", None, [], [], None,
                                                     rank=culprit_rank)
            others = [r for r in ranks if r["rank"] != culprit_rank and r["phase"] is not None]
            via_op = [r for r in others if r["root"] and r["root"]["collective"]]
            via_reduce = [r["rank"] for r in others if r not in via_op]
            note = f"rank {culprit_rank} computed the failure locally; "
            if via_op:
                root = via_op[0]["root"]
                note += (f"rank(s) {[r['rank'] for r in via_op]} received it through "
                         f"{root['op']}{_where(root)} (finite inputs, non-finite output there)")
            if via_reduce:
                note += ("; " if via_op else "") + (f"rank(s) {via_reduce} received it through "
                                                    "the gradient reduction")
            if not others:
                note += "the other ranks stayed finite"
            notes.append(note)
            if own.get("repro"):
                src = Path(own["repro"]).parent
                shutil.copytree(src, tmp / "repro")
                repro = "repro/repro.py"
                if run_repro_once:
                    result = run_repro(tmp / "repro" / "repro.py", target)
            report = Report("culprit", "unknown", phase, results[culprit_rank]["summary"]
                            .get("kind") or "nan", culprit, notes=notes, ranks=ranks,
                            context=own.get("context", []), inf_origin=own.get("inf_origin"),
                            repro=repro, repro_result=result, **common)
        write_report(report, tmp)
    return report
