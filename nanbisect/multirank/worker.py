"""One rank of a multi-rank replay; started by `launcher` through torch.distributed.run.

Every rank replays its own part of the bundle, in lockstep with the others (the same passes, each
stopping after the same phase, so the collectives inside the step always match), with the Task of
``--entry`` when the launcher passes one (the user's ``nanbisect run --entry``), else the entry its
part recorded. After the first pass the ranks exchange what they saw and all take the same
decision: which rank computed the failure locally (its own loss, or its own gradients going *into*
the reduction, went bad), or whether every rank's input to the reduction was finite and its output
was not (``grad-reduce``). Each rank writes ``PARTIAL/rank{r}.json``.

What a rank guarantees the launcher, so that it can name the rank that hung or died:
- ``PARTIAL/rank{r}.state`` (JSON: pid, stage) says, from the start, which process this rank is
  and which stage of the replay it reached;
- on SIGUSR1 (the launcher's deadline) faulthandler writes every thread's Python stack to
  ``PARTIAL/rank{r}.stacks``, from C, even while the rank is blocked in a collective or in native
  code; a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) writes it there too, then the
  rank dies of that signal as it would have;
- the rank ends when the launcher does: a thread waits for a shared lock on ``PARTIAL/.lock``,
  which the launcher holds exclusively for the whole run, so the lock is granted only once the
  launcher ended or was killed (even by SIGKILL); then the rank removes PARTIAL and exits (the
  launcher's janitor does the same from outside; this covers a janitor that was killed too);
- a last backstop, in C: faulthandler ends the rank after the timeout plus 60 s whatever it is
  doing (the launcher's own deadline, the timeout, normally ends it first). The process group's
  own timeout is longer than the launcher's deadline, so a hang is diagnosed, not a gloo error.
A Python thread needs the GIL, so native code that holds the GIL forever defeats the lock thread;
the janitor's SIGKILL and the faulthandler backstop do not need it.

Usage (internal): ``python -m nanbisect.multirank.worker BUNDLE PARTIAL --target DEV [--inject F:f]
[--entry ENTRY] [--timeout S]``.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nanbisect import devices, proc
from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.errors import BadInput
from nanbisect.chain import Chain, ReferenceSide, Serving
from nanbisect.multirank.ledger import Ledger
from nanbisect.multirank.sides import (call_stats, finish_rank, rank_reference, rank_replayer,
                                       reference_record, root_of)
from nanbisect.multirank.paths import rank_paths
from nanbisect.multirank.verdict import choose_rank, decide, received_ranks
from nanbisect.records import CallId, Plan, RankResult, RankSummary, json_number
from nanbisect.replay.probe import ProbeTable
from nanbisect.task import load_inject
from nanbisect.util.files import write_atomic
from nanbisect.util.recordjson import dumps
from nanbisect.util.text import raised_at


def _gather(obj):
    """Every rank's ``obj``, in rank order (pickled between our own ranks, never from a file)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _no_stage(stage: str) -> None:
    pass


# where this rank is, for the launcher's error when it hangs (set by `main`)
_stage = _no_stage


def _stage_file(partial: Path, rank: int):
    """A writer of ``PARTIAL/rank{r}.state``: this process's pid and the replay's stage."""
    path = partial / f"rank{rank}.state"

    def write(stage: str) -> None:
        try:
            write_atomic(path, json.dumps({"rank": rank, "pid": os.getpid(), "stage": stage}))
        except OSError:   # PARTIAL is gone: the launcher ended, and so will this rank
            pass

    return write


def replay_rank(bundle_path: Path, partial: Path, target: str, inject: str | None,
                entry: str | None = None,
                reference: tuple[torch.device, torch.dtype | None] | None = None,
                remedies: int = 0, run_top_level: bool = False, *,
                placed: tuple[torch.device, torch.dtype | None]) -> RankResult:
    """This rank's replay in lockstep: ``target`` as said (repros, messages), ``placed`` its
    device and dtype, ``reference`` the reference's (both decoded once by `_replay`)."""
    rank = dist.get_rank()
    top = read_bundle(bundle_path)
    part = top.part(rank)
    _stage("building the task")
    rep, observer = rank_replayer(part, placed, entry, run_top_level=run_top_level)
    model = rep.task.model
    wrap = load_inject(inject) if inject else nullcontext
    # every rank runs the same passes, in step: how collectives are served in lockstep
    chain = Chain(rep, Serving.LOCKSTEP, wrap, progress=lambda key, text: _stage(text))
    side = ref_observer = None
    if reference is not None:
        side, ref_observer = rank_reference(chain, part, reference, rep.entry)
    bad_inputs = chain.bad_inputs()
    # agree before any collective of the step: every rank stops, unless only buffers are bad
    # (the model's, made by an earlier step): then the step runs, so that a collective that
    # hands them on (DDP's buffer broadcast) is seen as the crossing it is
    held = _gather((bool(bad_inputs), all(b.where == "buffer" for b in bad_inputs)))
    if any(b for b, _ in held):
        if not all(only for b, only in held if b):
            summary = RankSummary(rank, "input" if bad_inputs else None, None, None,
                                  input_nonfinite=bad_inputs)
            return RankResult(rank, plan=decide(_gather(summary)), summary=summary)
        rep.carry_buffers = True
    # every collective and comm-hook op with what this rank fed it and got (`ledger`)
    ledger = observer.ledger = Ledger(model, chain.probe.tracker, ddp=isinstance(model, DDP))
    first, table = chain.first_pass(reference=side is not None, watch=ledger)
    observer.active, observer.ledger, ledger.active = False, None, False
    theirs = div = None
    if side is not None:
        chain.reference(side, first)    # before any other pass moves the parameters
        ref_observer.active = False
        theirs, div = reference_record(side, first)
    crossings = ledger.read()
    phase, kind = _first_bad(first.phase, first.kind, crossings)
    if bad_inputs:      # its buffers were bad before the step: that comes first
        phase, kind = "input", bad_inputs[0].kind
    summary = RankSummary(rank, phase, json_number(first.loss), kind,
                          buckets=observer.read(), crossings=crossings,
                          input_nonfinite=bad_inputs)
    _stage("after replay pass 1/3: exchanging what each rank saw")
    everyone = _gather(summary)
    plan = decide(everyone)
    result = RankResult(rank, plan=plan, summary=summary, reference=theirs)
    phase, culprit_rank = plan.phase, plan.rank
    if phase is None and side is not None and not any(
            Manifest.of(top).part_observed.values()):
        return _divergence(chain, side, table, result, div, target, partial)
    if phase not in ("forward", "backward", "optimizer") or culprit_rank is None:
        return result
    # every rank runs the culprit rank's phase and kind: the same passes
    agreed = _Agreement(rank, result, received_ranks(rank_paths(everyone)))
    loc = chain.locate(first, table, agreed, failed=(phase, everyone[culprit_rank].kind or "nan"))
    result = agreed.result
    if loc.through:   # every rank's root is a collective: nobody computed it, it was received
        return result
    if agreed.call is not None:
        result = replace(result, module_stats=call_stats(table, agreed.call))
    if rank != result.plan.rank:
        return result
    # the op check: one op, on this rank alone (no collective)
    return finish_rank(result, chain, loc, side, partial, target, remedies=remedies)


def _first_bad(phase: str | None, kind: str | None, crossings: list) -> tuple:
    """(phase, kind) of this rank's failure: its first pass's, or, where that saw nothing
    while a collective handed this rank NaN/inf, the collective's (an engine that keeps the
    reduced gradients out of ``.grad`` and skips the update itself, DeepSpeed's ZeRO: the
    rank failed where it received them)."""
    if phase is not None:
        return phase, kind
    got = next((c for c in crossings if c.nth is not None and (c.out_nan or c.out_inf)), None)
    if got is None:
        return None, kind
    return got.phase, "nan" if got.out_nan else "inf"


class _Agreement:
    """Between passes 2 and 3 in lockstep: every rank's root op exchanged, the culprit rank
    chosen (`choose_rank`; received through a collective when every root is one), and the
    culprit rank's op sent to every rank, which all catch it (the catch runs the step's
    collectives); the culprit rank also traces the batch rows."""

    def __init__(self, rank: int, result: RankResult, received: set[int]) -> None:
        self.rank, self.result, self.call = rank, result, None
        self.received = received    # ranks pass 1 saw receive it point to point

    def __call__(self, finding):
        roots = _gather(root_of(finding))
        plan = self.result.plan
        culprit_rank, through = choose_rank(roots, plan.rank, self.received)
        self.result = replace(self.result, root=roots[self.rank],
                              plan=replace(plan, rank=culprit_rank, through_collective=through))
        if through:
            return None
        mine = self.rank == culprit_rank
        spec = [(finding.site, CallId(finding.module, finding.module_call))
                if mine and finding is not None else None]
        dist.broadcast_object_list(spec, src=culprit_rank)
        if spec[0] is None:
            return None, mine
        self.call = spec[0][1]
        return spec[0][0], mine


def _divergence(chain: Chain, side: ReferenceSide, table: ProbeTable, result: RankResult,
                div, target: str, partial: Path) -> RankResult:
    """No rank failed and the bundle records no failure, but some rank's target step parts from
    its reference: every rank isolates its own first diverging module call's ops on the
    reference (one more lockstep pass, the same on every rank); the lowest rank with an op that
    is wrong given its inputs is the culprit."""
    rank = result.rank
    diverged = _gather(div.phase if div is not None else None)
    if not any(diverged):
        return result
    _stage("replay pass 2/3: isolating the ops on the reference")
    if div is not None:
        call, finding, check, _, _ = chain.isolate(div.phase, table, side.probe.read(),
                                                   side.device, side.target_dtype)
    else:   # the step's collectives, in step with the ranks that isolate
        call, finding, check = None, None, None
        chain.rep.run(wrap=chain.wrap)
    found = _gather(finding is not None)
    culprit_rank = next((r for r, f in enumerate(found) if f), None)
    phase = diverged[culprit_rank] if culprit_rank is not None else next(p for p in diverged if p)
    plan = Plan(phase, culprit_rank)
    result = replace(result, plan=plan)
    spec = [finding.site if finding is not None else None]
    caught = None
    if culprit_rank is not None:
        dist.broadcast_object_list(spec, src=culprit_rank)
        caught = chain.catch_diverging(spec[0])
    if rank != culprit_rank:
        return result
    chain.errors = errors = []     # the verdict stands: what fails after it is listed
    done = chain.finish_divergence(phase, finding, caught, call, check,
                                   partial / f"rank{rank}" / "repro", target, rank=rank)
    return replace(result, culprit=done.culprit, op_check=check, errors=errors,
                   classification="device" if check is not None else "unknown",
                   repro=str(done.repro) if done.repro is not None else None)


def _watch_launcher(partial: Path) -> None:
    """Exit, removing PARTIAL, once the launcher let go of its exclusive lock on PARTIAL/.lock:
    it ended, or it was killed (the kernel releases a dead process's locks)."""
    proc.exit_when_free(partial, lambda: shutil.rmtree(partial, ignore_errors=True))


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("partial")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--inject", default=None)
    ap.add_argument("--entry", default=None)
    ap.add_argument("--run-top-level", action="store_true")   # the entry's top level may run
    ap.add_argument("--reference", default=None)
    ap.add_argument("--alone", action="store_true",
                    help="rank $RANK of $WORLD_SIZE without the others: collectives served")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--remedies", type=int, default=0, help="the culprit rank's remedy budget")
    return ap.parse_args()


def _diagnosable(partial: Path, rank: int, timeout: float) -> None:
    """What the launcher needs to name this rank when it hangs or dies: its stacks on SIGUSR1
    and on a fatal signal (faulthandler writes from C: they come out even when this rank is
    blocked in native code), the last backstop, and the stage file."""
    stacks = open(partial / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(stacks, all_threads=True)                      # fatal signals: where
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)    # the launcher's deadline
    faulthandler.dump_traceback_later(timeout + 60, exit=True, file=stacks)   # last backstop
    global _stage
    _stage = _stage_file(partial, rank)


def _replay(a: argparse.Namespace, rank: int, partial: Path, out: Path) -> None:
    """This rank's replay in lockstep with the others, or alone on the fake process group;
    its devices decoded from the argument list's text once, here."""
    placed = devices.local_device(a.target)
    reference = devices.local_device(a.reference) if a.reference else None
    if a.alone:
        # torch's fake process group: rank r of the world, communicating nothing
        from nanbisect.multirank.alone import replay_alone
        from nanbisect.util.torch_internals import every_group_fake, fake_store

        dist.init_process_group("fake", rank=rank, store=fake_store(),
                                world_size=int(os.environ["WORLD_SIZE"]))
        every_group_fake()      # the job's gloo side groups too (megatron-core makes some)
        result = replay_alone(Path(a.bundle), partial, rank, a.target, a.inject, a.entry,
                              reference, stage=_stage, remedies=a.remedies,
                              run_top_level=a.run_top_level, placed=placed)
        out.write_text(dumps(result.to_json()))
        return
    # longer than the launcher's deadline: a hang is the launcher's to diagnose (it asks every
    # rank where it is), not a gloo timeout on the rank that waited for it
    backend = devices.collective_backend([placed[0]] + ([reference[0]] if reference else []))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=a.timeout + 30))
    result = replay_rank(Path(a.bundle), partial, a.target, a.inject, a.entry, reference,
                         remedies=a.remedies, run_top_level=a.run_top_level, placed=placed)
    out.write_text(dumps(result.to_json()))
    _stage("finished, waiting for the other ranks")
    dist.barrier()


def _failed(rank: int, out: Path, e: BaseException) -> None:
    """Report ``e`` to the launcher (which names the rank) and end this rank."""
    if isinstance(e, BadInput):  # already names the problem and the fix
        msg = str(e)
    else:
        where = f" at {at}" if (at := raised_at(e)) else ""
        msg = (f"{type(e).__name__}: {str(e)[:300]}{where}; fix the entry's code for that "
               "rank or re-capture the bundle")
    try:
        out.write_text(dumps(RankResult(rank, error=msg).to_json()))
    finally:
        os._exit(1)


def main() -> None:
    a = _arguments()
    rank = int(os.environ["RANK"])
    partial = Path(a.partial)
    _watch_launcher(partial)
    out = partial / f"rank{rank}.json"
    _diagnosable(partial, rank, a.timeout)
    _stage("starting the process group")
    try:
        _replay(a, rank, partial, out)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which names the rank
        _failed(rank, out, e)
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
