"""What a rank's replay needs on either launch path (every rank in lockstep, `worker`; some ranks
alone, `alone`): its replayer, set up one way for the target and the reference; its reference
side (the chain's `ReferenceSide`, built on that replayer, its collectives served as the path
serves them); what it writes of that side (`reference_record`); the culprit module call's
statistics; the culprit rank's finish; its root op. The passes are the chain's
(`nanbisect.chain`): nothing here runs one itself."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from nanbisect.chain import Chain, Located, ReferenceSide
from nanbisect.multirank.ddp import ReductionObserver, observe_default_hook, observing_comm_hooks
from nanbisect.records import (CallId, Divergence, OpFinding, RankReference, RankResult,
                               RankRoot, StageError, Stats, StepOutcome, after_verdict,
                               json_number)
from nanbisect.replay.probe import ProbeTable
from nanbisect.replay.recorder import is_collective
from nanbisect.replay.replayer import Replayer


def call_stats(table: ProbeTable, call: CallId) -> dict[str, Stats | None] | None:
    c = table.get(call)
    if c is None:
        return None
    return {"inputs": c.inputs, "output": c.output, "grad_arriving": c.grad_out,
            "grad_leaving": c.grad_in}


def rank_replayer(part, placed: tuple[torch.device, torch.dtype | None], entry: str | None,
                  server=None, run_top_level: bool = False
                  ) -> tuple[Replayer, ReductionObserver]:
    """This rank's part built on ``placed`` (its device and dtype, decoded once by the worker:
    `nanbisect.devices.local_device`), with DDP's gradient reductions observed; in lockstep
    without ``server``, else alone with the collectives ``server`` gives (rewound at every
    restore). ``run_top_level``: `Replayer`'s."""
    device, dtype = placed
    observer = ReductionObserver({}, server=server)
    with observing_comm_hooks(observer):
        rep = Replayer(part, device, dtype, entry=entry, run_top_level=run_top_level)
    model = rep.task.model
    observer.names.update({p: n for n, p in model.named_parameters()})
    observe_default_hook(model, observer)
    rep.lockstep = server is None
    if server is not None:
        rep.restored.append(server.rewind)
    return rep, observer


def rank_reference(chain: Chain, part, placed: tuple[torch.device, torch.dtype | None],
                   entry: str, server=None
                   ) -> tuple[ReferenceSide, ReductionObserver]:
    """This rank's reference side (``--reference``): the same part, the same world (or, with
    ``server``, the same served collectives, its inputs unchecked: the reference's differ), on
    the reference device; with the observer of its DDP reductions (set inactive once its step
    ran). Built before the target's first pass (its task build may run collectives)."""
    observers: list[ReductionObserver] = []

    def build():
        rep, observer = rank_replayer(part, placed, entry, server)
        observers.append(observer)
        return rep

    if server is None:
        side = chain.reference_side(build)
    else:
        side = chain.reference_side(build, served=(server,), around=server.unchecked)
    return side, observers[0]


def reference_record(side: ReferenceSide, first: StepOutcome
                     ) -> tuple[RankReference, Divergence | None]:
    """What this rank's reference step said, for the other ranks and the launcher, and where a
    finite target step parts from it (a failed target parts from a finite reference trivially:
    only a finite step's divergence is news)."""
    outcome = side.outcome
    div = side.divergence() if first.phase is None else None
    return RankReference(outcome.phase, json_number(outcome.loss),
                         div.what if div else None,
                         json_number(div.comparison.max_rel) if div else None), div


def finish_rank(result: RankResult, chain: Chain, loc: Located, side: ReferenceSide | None,
                partial: Path, target: str, *, remedies: int = 0) -> RankResult:
    """The culprit rank's result: the chain's finisher (culprit, repro under
    ``PARTIAL/rank{r}/repro``, op check on the reference), with a reference its classification
    from the evidence (`Chain.classify`: a rank alone's reference was served the capture's
    collectives, so its step proves nothing), ``culprit.samples`` from the traced rows, and with
    a ``remedies`` budget its remedies (`Chain.remedies`: skipped in lockstep, judged on its
    forward alone)."""
    errors: list[StageError] = []     # the verdict stands: what fails after it is listed
    chain.errors = errors
    done, culprit = chain.finish(loc, partial / f"rank{result.rank}" / "repro", target,
                                 rank=result.rank,
                                 check_on=side.device if side is not None else None)
    finding = loc.finding
    tried = after_verdict(errors, "remedies", lambda: chain.remedies(
        culprit, finding, loc.traced, remedies, loc.phase), [])
    result = replace(result, culprit=culprit, errors=errors, remedies=tried)
    if finding is None:
        return result
    result = replace(result, context=finding.context, inf_origin=finding.inf_origin)
    if done.repro is None:
        return result
    if side is not None:
        classification, notes = chain.classify(side, done.op_check)
        result = replace(result, op_check=done.op_check, classification=classification,
                         classification_notes=notes)
    return replace(result, repro=str(done.repro))


def root_of(finding: OpFinding | None) -> RankRoot | None:
    """What one rank's op recording traced its failure to, for the other ranks: the root op,
    or the collective whose inf output a NaN was made of (the inf was born there or came
    through it: the ranks' crossings tell which)."""
    if finding is None:
        return None
    o = finding.inf_origin
    if o is not None and is_collective(o.op):   # a NaN made of an inf a collective gave
        return RankRoot(o.op, o.op_index, o.module or "", o.module_call, [], [], True)
    return RankRoot(finding.op, finding.op_index, finding.module, finding.module_call,
                    finding.input_dtypes, finding.input_shapes, is_collective(finding.op))
