"""The culprit finisher: what every run does once it knows where a failure was born, the same
for a single-process run, a rank replayed in lockstep and a rank replayed alone.

found op (`OpFinding`) + its caught inputs (`Caught`)
  -> the culprit record (`make_culprit`)
  -> repro/ written (`write_repro`), its run started by the caller's ``start_repro`` so that it
     overlaps the next step
  -> the culprit op re-run on the reference from the same inputs (`safe_check`: a re-run that
     raises is ``uncomparable``, never a crash)
  -> the classification, from an explicit `Evidence` record (`classify_culprit`).

What the finisher does not do: find the op (`locate`), catch its inputs (a lockstep rank
catches them on every rank, for the collectives), or wait for the repro's run (the caller
decides what overlaps it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, TypeVar

import torch

from nanbisect.locate.cause import likely_cause
from nanbisect.locate.producers import make_culprit
from nanbisect.records import (Caught, Culprit, OpCheck, OpFinding, ReproResult, StageError,
                               after_verdict)
from nanbisect.reference.classify import Evidence, classify_culprit
from nanbisect.reference.opcheck import safe_check
from nanbisect.replay.probe import CallStats
from nanbisect.replay.replayer import Replayer
from nanbisect.report.repro import repro_imports, write_repro
from nanbisect.util.frames import function_at

__all__ = ["Finished", "finish", "Evidence", "classify_culprit"]

Pending = Callable[[], "ReproResult | None"]
T = TypeVar("T")


@dataclass(frozen=True)
class Finished:
    """What the finisher made of a found op."""

    culprit: Culprit
    repro: Path | None = None          # repro/repro.py, when the op's inputs were caught
    pending: Pending | None = None     # waits for the repro's run (None: not started)
    op_check: OpCheck | None = None    # the op re-run on the reference


def finish(rep: Replayer, phase: str, kind: str, *, finding: OpFinding | None,
           caught: Caught | None, repro_dir: Path, target: str,
           check_on: torch.device | None = None, wrap: Callable[[], ContextManager] | None = None,
           call: CallStats | None = None, parameter: str | None = None, rank: int = 0,
           micro_batch: int | None = None, op_check: OpCheck | None = None,
           start_repro: Callable[[Path, Caught], Pending] | None = None,
           progress: Callable[[str, str], None] = lambda key, text: None,
           errors: list[StageError] | None = None) -> Finished:
    """The culprit of ``finding`` (else of ``call`` / ``parameter``), its repro and, with
    ``check_on`` (the reference device), its op check; ``op_check`` when one was made already
    (an isolated divergence). The culprit is the verdict; writing and starting the repro and
    the op check come after it: with ``errors``, one that raises is listed there
    (`after_verdict`: the report is written without it); without, what it raises goes through.

    >>> from nanbisect.bundle.format import read_bundle
    >>> from nanbisect.locate.ops import record_ops
    >>> from nanbisect.locate.catch import catch_inputs
    >>> import tempfile
    >>> from contextlib import nullcontext
    >>> rep = Replayer(read_bundle("fixtures/bundles/forward_nan_behind_mask"),
    ...                torch.device("cpu"))
    >>> f = record_ops(rep, "forward", "nan", nullcontext)
    >>> done = finish(rep, "forward", "nan", finding=f,
    ...               caught=catch_inputs(rep, f.site, nullcontext),
    ...               repro_dir=Path(tempfile.mkdtemp()), target="cpu",
    ...               check_on=torch.device("cpu"))
    >>> done.culprit.op, done.repro.name, done.op_check.status
    ('aten.sqrt.default', 'repro.py', 'ok')
    """
    def guard(stage: str, fn: Callable[[], T], default: T) -> T:
        return fn() if errors is None else after_verdict(errors, stage, fn, default)

    culprit = make_culprit(rep.task.model, phase, finding=finding, call=call,
                           parameter=parameter, rank=rank, micro_batch=micro_batch,
                           source=caught.source if caught else None,
                           node=caught.node if caught else None)
    site = (culprit.node.forward_source if culprit.node is not None
            and culprit.node.forward_source else culprit.source)
    function = guard("code-site", lambda: function_at(site), None)
    if function is not None:
        culprit = dataclasses.replace(culprit, function=function)
    cause = guard("likely-cause", lambda: likely_cause(culprit, caught, finding,
                                                       rep.task.optimizer), None)
    if cause is not None:
        culprit = dataclasses.replace(culprit, likely_cause=cause)
    if caught is None or finding is None:
        return Finished(culprit, op_check=op_check)

    def repro() -> tuple[Path, Pending | None]:
        # a culprit that surfaced elsewhere is reproduced by what it made (log's -inf, not the
        # NaN its backward made of it)
        script = write_repro(repro_dir, caught, culprit=culprit, kind=finding.born or kind,
                             target=target, imports=repro_imports(caught.op, rep.entry))
        return script, start_repro(script, caught) if start_repro is not None else None

    script, pending = guard("repro", repro, (None, None))
    if check_on is not None and op_check is None:   # in this process, while the repro runs
        progress("op-check", "re-running the culprit op on the reference")
        op_check = guard("op-check", lambda: safe_check(caught, finding.op_index, rep.device,
                                                        check_on, wrap), None)
    return Finished(culprit, script, pending, op_check)
