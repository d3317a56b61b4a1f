"""One rank of a multi-rank replay; started by `launcher` through torch.distributed.run.

Every rank replays its own part of the bundle, in lockstep with the others (the same passes, each
stopping after the same phase, so the collectives inside the step always match). After the first
pass the ranks exchange what they saw and all take the same decision: which rank computed the
failure locally (its own loss, or its own gradients going *into* the reduction, went bad), or
whether every rank's input to the reduction was finite and its output was not (``grad-reduce``).
Each rank writes ``PARTIAL/rank{r}.json``; a watchdog ends the process after the timeout, so a
hung collective never leaves an orphan.

Usage (internal): ``python -m nanbisect.multirank.worker BUNDLE PARTIAL --target DEV [--inject F:f]
[--timeout S]``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import threading
import traceback
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from nanbisect.locate.producers import Culprit, culprit_from_call, forward_producer
from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput
from nanbisect.locate.catch import catch_inputs
from nanbisect.locate.ops import record_ops
from nanbisect.multirank.ddp import ReductionObserver, observe_default_hook, observing_comm_hooks
from nanbisect.multirank.verdict import choose_rank, decide
from nanbisect.replay.recorder import is_collective
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer, parse_device
from nanbisect.report.repro import repro_imports, write_repro
from nanbisect.task import load_inject


def _call_stats(table, module: str, call: int | None) -> dict | None:
    for c in table.calls:
        if (c.call.module, c.call.call) == (module, call):
            pick = lambda s: asdict(s) if s is not None else None  # noqa: E731
            return {"inputs": pick(c.inputs), "output": pick(c.output),
                    "grad_arriving": pick(c.grad_out), "grad_leaving": pick(c.grad_in)}
    return None


def replay_rank(bundle_path: Path, partial: Path, target: str, inject: str | None) -> dict:
    rank = dist.get_rank()
    top = read_bundle(bundle_path)
    part = top.part(rank)
    device, dtype = parse_device(target)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    observer = ReductionObserver({})
    with observing_comm_hooks(observer):
        rep = Replayer(part, device, dtype)
    model = rep.task.model
    observer.names.update({p: n for n, p in model.named_parameters()})
    observe_default_hook(model, observer)
    rep.lockstep = True
    everyone: list = [None] * dist.get_world_size()
    bad_inputs = [b.__dict__ for b in rep.input_faults(rep.restore())]
    dist.all_gather_object(everyone, bad_inputs)   # agree before any collective of the step
    if any(everyone):
        r = min(i for i, b in enumerate(everyone) if b)
        return {"rank": rank, "plan": {"rank": r, "phase": "input"},
                "summary": {"rank": rank, "input_nonfinite": bad_inputs}}
    if inject:
        wrap = load_inject(inject)
    else:
        wrap = nullcontext
    probe = ModuleProbe(model)
    first = rep.run(phase=probing(probe), wrap=wrap)
    buckets = observer.read()
    observer.active = False
    summary = {"rank": rank, "phase": first.phase, "loss": first.loss if first.loss is None or
               first.loss == first.loss else "nan", "kind": first.kind, "buckets": buckets,
               "reduce_in_bad": any(b["in_nan"] or b["in_inf"] for b in buckets),
               "reduce_out_bad": any(b["out_nan"] or b["out_inf"] for b in buckets)}
    dist.all_gather_object(everyone, summary)
    plan = decide(everyone)
    result = {"rank": rank, "summary": summary, "plan": plan, "all": everyone}
    phase, culprit_rank = plan["phase"], plan["rank"]
    if phase in ("forward", "backward", "optimizer") and culprit_rank is not None:
        kind = everyone[culprit_rank]["kind"] or "nan"
        finding = record_ops(rep, phase, kind, wrap)          # every rank: same passes
        roots: list = [None] * dist.get_world_size()
        dist.all_gather_object(roots, _root(finding))
        culprit_rank, through = choose_rank(roots, culprit_rank)
        plan = {**plan, "rank": culprit_rank, "through_collective": through}
        result.update(plan=plan, root=roots[rank], roots=roots)
        if through:   # every rank's root is a collective: nobody computed it, it was received
            return result
        spec = [None]
        if rank == culprit_rank and finding is not None:
            spec = [(finding.module, finding.module_call, finding.occurrence, finding.op)]
        dist.broadcast_object_list(spec, src=culprit_rank)
        caught = None
        if spec[0] is not None:
            caught = catch_inputs(rep, finding, wrap) if rank == culprit_rank and finding \
                else catch_inputs(rep, _Other(spec[0][3], phase, spec[0][2]), wrap)
        table = probe.read()
        if spec[0] is not None:
            result["module_stats"] = _call_stats(table, spec[0][0], spec[0][1])
        if rank == culprit_rank:
            if finding is not None:
                culprit = Culprit(phase, finding.module or "", finding.module_call,
                                  finding.input_dtypes, finding.input_shapes,
                                  caught.source if caught else None, op=finding.op,
                                  op_index=finding.op_index, rank=rank,
                                  parameter=finding.parameter)
                result.update(context=finding.context, inf_origin=finding.inf_origin)
                if caught is not None and caught.op == finding.op:
                    write_repro(partial / f"rank{rank}" / "repro", caught,
                                culprit=culprit.__dict__, kind=kind, target=target,
                                imports=repro_imports(caught.op, rep.entry))
                    result["repro"] = str(partial / f"rank{rank}" / "repro" / "repro.py")
            else:
                call = forward_producer(table, kind) if phase == "forward" else None
                culprit = (culprit_from_call(model, call, phase) if call is not None
                           else Culprit(phase, "", None, [], [], None))
                culprit = Culprit(**{**culprit.__dict__, "rank": rank})
            result["culprit"] = asdict(culprit)
    return result


def _root(finding) -> dict | None:
    """What one rank's op recording traced its failure to, for the other ranks."""
    if finding is None:
        return None
    return {"op": finding.op, "module": finding.module, "module_call": finding.module_call,
            "input_dtypes": finding.input_dtypes, "input_shapes": finding.input_shapes,
            "op_index": finding.op_index, "collective": is_collective(finding.op)}


class _Other:
    """What `catch_inputs` needs on ranks that only keep step with the culprit rank."""

    def __init__(self, op: str, phase: str, occurrence: int) -> None:
        self.op, self.phase, self.occurrence = op, phase, occurrence


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("partial")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--inject", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(a.partial) / f"rank{rank}.json"
    watchdog = threading.Timer(a.timeout, lambda: os._exit(124))
    watchdog.daemon = True
    watchdog.start()
    backend = "gloo" if parse_device(a.target)[0].type == "cpu" else (
        "nccl" if a.target.startswith("cuda") else None)
    try:
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=max(a.timeout - 5, 5)))
        result = replay_rank(Path(a.bundle), Path(a.partial), a.target, a.inject)
        out.write_text(json.dumps(result, default=str))
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which names the rank
        if isinstance(e, BadInput):  # already names the problem and the fix
            msg = str(e)
        else:
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            msg = (f"{type(e).__name__}: {str(e)[:300]}{where}; fix the entry's code for that "
                   "rank or re-capture the bundle")
        out.write_text(json.dumps({"rank": rank, "error": msg}))
        os._exit(1)
    finally:
        watchdog.cancel()
    # The replayed model is garbage now; FSDP2 modules keep the process group in reference
    # cycles, and freeing them at interpreter shutdown can abort the process ("terminate called
    # without an active exception"). Free them while torch is alive; skip shutdown altogether:
    # the result is written.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
