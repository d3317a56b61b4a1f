"""What a rank's replay needs on either launch path (every rank in lockstep, `worker`; some ranks
alone, `alone`): its replayer, set up one way for the target and the reference; its reference
side; the culprit module call's statistics; its root op."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable

from nanbisect import devices
from nanbisect.finish import Evidence, classify_culprit, finish
from nanbisect.multirank.ddp import ReductionObserver, observe_default_hook, observing_comm_hooks
from nanbisect.records import (CallId, Caught, Culprit, Divergence, OpFinding, RankReference,
                               RankResult, RankRoot, Remedy, RowTrace, StageError, Stats,
                               StepOutcome, after_verdict, json_number)
from nanbisect.reference import kernels as registry
from nanbisect.reference.differential import StepState
from nanbisect.reference.side import ReferenceSide, model_dtype
from nanbisect.remedies import not_tried, try_remedies
from nanbisect.replay.probe import CallStats, ProbeTable
from nanbisect.replay.recorder import is_collective
from nanbisect.replay.replayer import Replayer


def call_stats(table: ProbeTable, call: CallId) -> dict[str, Stats | None] | None:
    c = table.get(call)
    if c is None:
        return None
    return {"inputs": c.inputs, "output": c.output, "grad_arriving": c.grad_out,
            "grad_leaving": c.grad_in}


def rank_replayer(part, spec: str, entry: str | None, server=None
                  ) -> tuple[Replayer, ReductionObserver]:
    """This rank's part built on ``spec`` (an accelerator's device taken from LOCAL_RANK), with
    DDP's gradient reductions observed; in lockstep without ``server``, else alone with the
    collectives ``server`` gives (rewound at every restore)."""
    device, dtype = devices.local_device(spec)
    observer = ReductionObserver({}, server=server)
    with observing_comm_hooks(observer):
        rep = Replayer(part, device, dtype, entry=entry)
    model = rep.task.model
    observer.names.update({p: n for n, p in model.named_parameters()})
    observe_default_hook(model, observer)
    rep.lockstep = server is None
    if server is not None:
        rep.restored.append(server.rewind)
    return rep, observer


class RankReferenceSide(ReferenceSide):
    """This rank's replay on the reference (``--reference``): the same part, the same world (or
    the same served collectives), the reference device; random ops draw what this rank's
    target drew. Built before the target's first pass (its task build may run collectives), so the
    target's step it is compared with is given to `run_rank`, not to the constructor."""

    def __init__(self, part, spec: str, entry: str, server=None) -> None:
        registry.load_plugins()
        rep, self.observer = rank_replayer(part, spec, entry, server)
        self.server = server     # a replay without the other ranks: collectives served
        super().__init__(rep, rep.dtype, None, None)

    def run_rank(self, tape, target: Replayer, first: StepOutcome,
                 target_state: StepState) -> tuple[RankReference, Divergence | None]:
        """Replay on the reference; how it ended (for the other ranks), and where a finite
        target step parts from it (a failed target parts from a finite reference trivially:
        only a finite step's divergence is news)."""
        self.target_state, self.target_dtype = target_state, model_dtype(target)
        served = (self.server,) if self.server is not None else ()
        outcome = self.run(tape, served=served, around=(
            self.server.unchecked if self.server is not None else nullcontext))
        self.observer.active = False
        div = self.divergence() if first.phase is None else None
        return RankReference(outcome.phase, json_number(outcome.loss),
                             div.what if div else None,
                             json_number(div.comparison.max_rel) if div else None), div


def finish_rank(result: RankResult, rep: Replayer, phase: str, kind: str,
                finding: OpFinding | None, caught: Caught | None, call: CallStats | None,
                side: RankReferenceSide | None, reference: str, wrap, partial: Path,
                target: str, stage: Callable[[str], None], *, remedies: int = 0,
                rows: RowTrace | None = None, step_wrap=None) -> RankResult:
    """The culprit rank's result: `finish` (culprit, repro under ``PARTIAL/rank{r}/repro``, op
    check on the reference), its classification from the evidence (``reference``: what the
    reference's step says, `Evidence`), ``culprit.samples`` from ``rows``, and with a
    ``remedies`` budget its remedies (`rank_remedies`; ``step_wrap``: what wraps a replay of
    the step, served collectives included)."""
    errors: list[StageError] = []     # the verdict stands: what fails after it is listed
    done = finish(rep, phase, kind, finding=finding, caught=caught, call=call, rank=result.rank,
                  check_on=side.device if side is not None else None, wrap=wrap,
                  repro_dir=partial / f"rank{result.rank}" / "repro", target=target,
                  progress=lambda key, text: stage(text), errors=errors)
    culprit = replace(done.culprit, samples=rows.samples if rows is not None else None)
    result = replace(result, culprit=culprit, errors=errors, remedies=after_verdict(
        errors, "remedies", lambda: rank_remedies(rep, culprit, finding, rows, remedies,
                                                  step_wrap or wrap, stage), []))
    if finding is None:
        return result
    result = replace(result, context=finding.context, inf_origin=finding.inf_origin)
    if done.repro is None:
        return result
    if side is not None:
        classification, notes = classify_culprit(Evidence(reference, side.dtype,
                                                          model_dtype(rep), done.op_check))
        result = replace(result, op_check=done.op_check, classification=classification,
                         classification_notes=notes)
    return replace(result, repro=str(done.repro))


def rank_remedies(rep: Replayer, culprit: Culprit, finding: OpFinding | None,
                  rows: RowTrace | None, budget: int, wrap, stage: Callable[[str], None]
                  ) -> list[Remedy]:
    """The culprit rank's remedies. A rank in lockstep cannot replay its step again without every
    other rank (their collectives would wait for it): none is tried, each is listed as skipped.
    A rank replayed alone replays freely, but the collectives of its step are served as the
    capture recorded them, the failure they carried included: a remedy is judged on what the
    rank computes up to the end of its forward, so only a forward culprit's remedies are
    tried."""
    if budget <= 0:
        return []
    if rep.lockstep:
        return not_tried(culprit, "a rank replayed in lockstep cannot replay its step again "
                                  "without every other rank; replay this rank alone "
                                  f"(--ranks {culprit.rank}) to try them")
    if culprit.phase != "forward":
        return not_tried(culprit, "on a rank replayed alone the collectives after its forward "
                                  "are served as the capture recorded them (the failure "
                                  "included), so only a forward culprit's step can be judged")
    judged = {"judged_on": "this rank's forward; its collectives served as recorded"}
    return [replace(r, detail={**r.detail, **judged}) if r.outcome != "skipped" else r
            for r in try_remedies(rep, culprit, finding, budget=budget, trace=rows, wrap=wrap,
                                  judge="forward", progress=lambda key, text: stage(text))]


def root_of(finding: OpFinding | None) -> RankRoot | None:
    """What one rank's op recording traced its failure to, for the other ranks."""
    if finding is None:
        return None
    return RankRoot(finding.op, finding.op_index, finding.module, finding.module_call,
                    finding.input_dtypes, finding.input_shapes, is_collective(finding.op))
