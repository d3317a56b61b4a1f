"""The multi-rank decisions: which phase and rank to bisect after the first pass (`decide`, the
same on every rank), which rank computed the failure once every rank has traced it to a root op
(`choose_rank`), and the job's report from every rank's result (`job_report`).

Pure functions over the records the ranks exchanged; no torch.distributed, no tensors, no files,
so every verdict can be tested in-process without torchrun.
"""
from __future__ import annotations

from dataclasses import replace

from nanbisect.multirank.paths import (birth, grouped, overflow_words, rank_paths,
                                      received_words)
from nanbisect.records import (BadValue, Crossing, Culprit, OpRef, Plan, RankPath, RankResult,
                               RankRoot, RankSummary, Subset, RunFacts, before_the_step,
                               module_label)
from nanbisect.reference.classify import REPLAY_MISMATCH_NOTE, classify_not_reproduced
from nanbisect.report.model import Report
from nanbisect.util.spec import NONE
from nanbisect.util.text import ranks_text


def decide(summaries: list[RankSummary]) -> Plan:
    """The same plan on every rank, from every rank's first-pass summary.

    >>> ok = RankSummary(0, None, 1.0, None)
    >>> decide([ok, RankSummary(1, "forward", "nan", "nan")])
    Plan(phase='forward', rank=1, through_collective=False)
    """
    bad_input = [s.rank for s in summaries if s.phase == "input"]
    if bad_input:
        return Plan("input", min(bad_input))
    paths = rank_paths(summaries)
    received = received_ranks(paths)

    def phase_of(s: RankSummary) -> str | None:
        p = paths.get(s.rank)      # a pipeline stage that sent on what it made in forward
        return p.phase if p is not None and p.how == "computed" and p.phase else s.phase

    def own(ranks: list[int]) -> list[int]:   # the ranks that did not receive it, if any
        return [r for r in ranks if r not in received] or ranks

    fwd = own([s.rank for s in summaries if phase_of(s) == "forward"])
    if fwd:
        return Plan("forward", min(fwd))
    how, ranks, c = birth(paths)
    if how == "computed" and c is not None and c.phase == "grad-reduce" and not c.collective:
        return Plan("grad-reduce", min(ranks))    # a comm hook's or FSDP reduction's op made it
    local_bwd = own([s.rank for s in summaries if s.reduce_in_bad or (
        phase_of(s) == "backward" and not s.buckets)])
    if local_bwd:
        return Plan("backward", min(local_bwd))
    if any(s.reduce_out_bad for s in summaries):
        return Plan("grad-reduce", None)
    opt = [s.rank for s in summaries if s.phase == "optimizer"]
    if opt:
        return Plan("optimizer", min(opt))
    return Plan(None, None)


def received_ranks(paths: dict[int, RankPath]) -> set[int]:
    """The ranks whose first-pass path (`rank_paths`) shows they received the failure through a
    send and receive (point to point: a pipeline's stages), from whom it is known: not
    candidates to have computed it while a rank that did not receive it is (`decide`,
    `choose_rank`)."""
    return {r for r, p in paths.items()
            if p.how == "received" and p.via is not None and p.via.p2p and p.from_ranks}


def choose_rank(roots: list[RankRoot | None], planned: int,
                received: set[int] = frozenset()) -> tuple[int, bool]:
    """(culprit rank, whether the failure only came out of a collective), the same on every rank.

    A rank whose failure traces back to a computation (not to a collective's output) computed it
    locally; the first such rank is the culprit. When every rank that failed traces it to a
    collective whose inputs were finite, no rank computed it: the collective is at fault.

    >>> mm = RankRoot("aten.sqrt.default", 7, "row", 0, ["float32"], [[4]], collective=False)
    >>> ar = RankRoot("c10d.allreduce_.default", 9, "row", 0, ["float32"], [[4]], True)
    >>> choose_rank([ar, mm], planned=0), choose_rank([ar, ar], planned=0)
    ((1, False), (0, True))
    """
    local = [r for r, root in enumerate(roots) if root is not None and not root.collective]
    local = [r for r in local if r not in received] or local
    if local:
        return local[0], False
    received = [r for r, root in enumerate(roots) if root is not None]
    if received:
        return received[0], True
    return planned, False


def _where(root: RankRoot) -> str:
    return (f" in {module_label(root.module)} call {root.module_call}"
            if root.module_call is not None else "")


def faithful_or_mismatch(report: Report) -> Report:
    """A culprit found by a replay that does not compute the captured step (its fidelity
    ``mismatch``: `nanbisect.records.Fidelity`) is ``replay-mismatch``, as on one rank."""
    f = report.facts.fidelity
    if report.verdict != "culprit" or f is None or not f.mismatch:
        return report
    return replace(report, classification="replay-mismatch",
                   notes=[*report.notes, REPLAY_MISMATCH_NOTE])


def job_report(facts: RunFacts, world_size: int, backend: str | None,
               results: list[RankResult]) -> Report:
    """One report for the job from every rank's result (sorted by rank); the repro, which only
    the culprit rank wrote, is the launcher's to add. Every rank's result gets its path (how it
    came to hold the failure, `multirank.paths`) and, where a value was born on it or reached
    it through a collective, a root."""
    return faithful_or_mismatch(_job_report(facts, world_size, backend, with_paths(results)))


def with_paths(results: list[RankResult]) -> list[RankResult]:
    """``results`` with each rank's `RankPath`, and a root from its crossing where the op
    recording left none (a comm hook's op, a collective the recorded phase did not reach)."""
    paths = rank_paths([r.summary for r in results])
    out = []
    for r in results:
        p = paths.get(r.rank)
        root, v = r.root, (p.via if p is not None else None)
        if root is None and v is not None:
            root = RankRoot(v.op, None, v.module or (v.unit or ""), v.module_call, v.in_dtypes,
                            v.in_shapes, v.collective and p.how != "computed")
        elif root is not None and v is not None and root.op == v.op and not root.input_dtypes:
            # a root traced through an inf to its collective: what went into it, from the ledger
            root = replace(root, input_dtypes=v.in_dtypes, input_shapes=v.in_shapes)
        summary = r.summary
        if summary is not None and p is not None and p.how == "computed" and p.phase and \
                p.phase != summary.phase:   # a pipeline stage: it sent on what it made earlier
            summary = replace(summary, phase=p.phase)
        out.append(replace(r, path=p, root=root, summary=summary))
    return out


def _job_report(facts: RunFacts, world_size: int, backend: str | None,
                results: list[RankResult]) -> Report:
    plan = results[0].plan
    phase, culprit_rank = plan.phase, plan.rank
    notes = [f"replayed with world size {world_size} ({backend})"] + _reference_notes(
        facts.reference, results)
    common = dict(facts=facts, ranks=results)
    if phase in (None, "input", "grad-reduce"):
        return _no_rank_report(phase, facts, results, notes, common)
    if culprit_rank is None:   # the ranks part from the reference, and no op was isolated
        notes.append("no rank's op could be isolated as the first divergence from the reference "
                     "(every op checked passed alone, or could not be compared)")
        return Report("culprit", "unknown", phase, "mismatch",
                      Culprit.phase_only(phase, rank=None), notes=notes, **common)
    own = {r.rank: r for r in results}[culprit_rank]
    kind = (own.summary.kind if own.summary else None) or (
        "mismatch" if own.reference is not None and own.reference.divergence else "nan")
    if plan.through_collective:
        root = own.root
        if phase == "backward":   # a collective in backward reduces gradients
            phase = "grad-reduce"
        how, ranks, born = birth({r.rank: r.path for r in results if r.path is not None})
        if how == "collective" and born is not None:
            return _born_in_collective(born, ranks, results, notes, born.kind, common,
                                       op_index=root.op_index if root is not None
                                       and root.op == born.op else None)
        culprit = Culprit.of_root(phase, root, culprit_rank)
        notes.append(f"on every rank that failed ({[r.rank for r in results if r.root]}) "
                     f"the failure traces back to the output of {root.op}{_where(root)}, "
                     "whose inputs were finite on every rank: no rank computed it, the "
                     "collective (or the code around it) is at fault")
        return Report("culprit", "communication", phase, kind, culprit, notes=notes, **common)
    culprit = own.culprit or Culprit.phase_only(phase, rank=culprit_rank)
    notes.append(_spread_note(culprit_rank, results))
    notes += own.classification_notes
    return Report("culprit", own.classification or "unknown", phase, kind, culprit, notes=notes,
                  context=own.context, inf_origin=own.inf_origin, op_check=own.op_check,
                  remedies=own.remedies, **common)


def _no_rank_report(phase: str | None, facts: RunFacts, results: list[RankResult],
                    notes: list[str], common: dict) -> Report:
    """The job's report when no rank computed a failure: clean or not reproduced, non-finite
    inputs, or a gradient reduction that made finite gradients non-finite."""
    if phase is None:
        if not any((facts.observed or {}).values()):
            return Report("clean", None, None, None, None, notes=notes, **common)
        classification, why = classify_not_reproduced(facts.fidelity, facts.target)
        return Report("not-reproduced", classification, None, None, None, notes=[
            *notes, f"the manifest records a non-finite step on some rank, but {why}"], **common)
    if phase == "input":
        bad: list[BadValue] = [
            BadValue(b.where, f"rank {r.rank}: {b.name}", b.nan, b.posinf, b.neginf)
            for r in results if r.summary for b in r.summary.input_nonfinite]
        holders = sorted({r.rank for r in results if r.summary and r.summary.input_nonfinite})
        classification, note = before_the_step(
            [b for r in results if r.summary for b in r.summary.input_nonfinite])
        # buffers alone: the step ran, and a collective may have handed them on (DDP's
        # buffer broadcast): the ranks that received them, and from whom
        said = [(r.rank, received_words(r.path)) for r in results
                if r.rank not in holders and r.path is not None and r.path.how == "received"]
        return Report("input-nonfinite", classification, "input", bad[0].kind if bad else None,
                      None, input_nonfinite=bad, notes=notes + [
                          f"{ranks_text(holders)} {'holds' if len(holders) == 1 else 'hold'} "
                          "non-finite values before the step",
                          *grouped(said), *([note] if note else [])], **common)
    how, ranks, born = birth({r.rank: r.path for r in results if r.path is not None})
    if born is not None and how == "collective":
        return _born_in_collective(born, ranks, results, notes, born.kind, common)
    if born is not None and how == "computed":
        return _computed_in_hook(born, ranks, results, notes, common)
    buckets = [b for r in results if r.summary for b in r.summary.buckets if b.out_bad]
    params = buckets[0].params if buckets else []
    culprit = (Culprit.of_parameter("grad-reduce", params[0], rank=results[0].rank) if params
               else Culprit.phase_only("grad-reduce", rank=results[0].rank))
    notes.append("every rank's gradients were finite going into the reduction and "
                 "non-finite coming out of it: the collective (or the comm hook around "
                 f"it) is at fault; first bad bucket holds {params[:4]}")
    return Report("culprit", "communication", "grad-reduce",
                  "nan" if buckets and buckets[0].out_nan else "inf", culprit, notes=notes,
                  **common)


def _spread_note(culprit_rank: int, results: list[RankResult]) -> str:
    """Which rank computed the failure and how each other rank that failed received it: the
    collective, its phase and module, and who fed it (from every rank's crossings), else the
    root its op recording traced."""
    others = [r for r in results if r.rank != culprit_rank and r.summary
              and r.summary.phase is not None]
    said = []
    for r in others:
        if r.path is not None and r.path.how == "received":
            said.append((r.rank, received_words(r.path)))
        elif r.root is not None and r.root.collective:
            said.append((r.rank, f"received it through {r.root.op}{_where(r.root)}"))
        elif r.path is not None and r.path.how == "computed":
            said.append((r.rank, "computed a non-finite value of its own too"))
        else:
            said.append((r.rank, "failed without a collective or comm hook handing it a "
                                 "non-finite value (its failure was not traced)"))
    note = f"rank {culprit_rank} computed the failure locally; "
    return note + ("; ".join(grouped(said)) if said else "the other ranks stayed finite")


def _born_in_collective(c: Crossing, ranks: list[int], results: list[RankResult],
                        notes: list[str], kind: str, common: dict,
                        op_index: int | None = None) -> Report:
    """A collective whose output held NaN/inf though every rank of its group fed it finite
    values: ``communication``, with the dtype and the reduction when a low-precision sum
    overflowed, and the parameters (and FSDP unit) whose slice went bad. ``op_index``: its
    place in the op recording, when that traced the failure to it."""
    culprit = Culprit(c.phase, c.module or (c.unit or ""), c.module_call, c.in_dtypes,
                      c.in_shapes, c.source, op=c.op, op_index=op_index, rank=min(ranks),
                      parameter=c.params[0] if c.params else None)
    group = c.group if c.group is not None else sorted(r.rank for r in results)
    words = (f"{c.where()} gave {ranks_text(ranks)} {'NaN' if c.out_nan else 'inf'} though "
             f"every rank of its group ({', '.join(map(str, group))}) fed it finite values: "
             "the value was born in the collective, no rank computed it")
    if c.overflow:
        words += "; " + overflow_words(c, [r.summary for r in results]) + (
            ": reduce in a wider dtype (float32, bfloat16), or divide before the sum")
    notes.append(words)
    if c.params:
        notes.append(f"the parameters whose slice of its output went bad: "
                     f"{', '.join(c.params[:6])}" + (f" (FSDP unit {c.unit or '(the root)'})"
                                                     if c.unit is not None else ""))
    _receivers(results, ranks, notes)
    origin = (OpRef(c.op, op_index, c.phase, c.module, c.module_call)
              if op_index is not None and not c.out_nan else None)   # where the inf was born
    return Report("culprit", "communication", c.phase, kind, culprit, notes=notes,
                  inf_origin=origin, **common)


def _computed_in_hook(c: Crossing, ranks: list[int], results: list[RankResult],
                      notes: list[str], common: dict) -> Report:
    """An op of a DDP comm hook or of an FSDP2 unit's gradient reduction made NaN/inf from
    finite gradients on some ranks (a cast into float16 that overflows, a division): the lowest
    such rank's op is the culprit, ``communication`` (it is the gradient reduction's code)."""
    own = min(ranks)
    mine = next(p.via for r in results if r.rank == own and (p := r.path) is not None)
    culprit = Culprit("grad-reduce", mine.unit or "", None, mine.in_dtypes, mine.in_shapes,
                      mine.source, op=mine.op, rank=own,
                      parameter=mine.params[0] if mine.params else None)
    by = (f"DDP bucket {mine.bucket}'s comm hook" if mine.bucket is not None else
          f"FSDP unit {mine.unit or '(the root)'}'s gradient reduction")
    words = (f"{ranks_text(ranks)}: {mine.op}, run by {by} "
             f"({mine.source or 'source unknown'}), made {'NaN' if mine.out_nan else 'inf'} "
             "from finite gradients")
    if mine.born and not mine.out_nan and mine.dtype:
        words += (f" (its {mine.dtype} result overflowed; the largest magnitude fed in: "
                  f"{mine.in_absmax:.6g})" if mine.in_absmax is not None else
                  f" (its {mine.dtype} result overflowed)")
    if mine.params:
        words += f"; the parameters whose slice went bad: {', '.join(mine.params[:6])}"
    notes.append(words)
    _receivers(results, ranks, notes)
    return Report("culprit", "communication", "grad-reduce", mine.kind, culprit, notes=notes,
                  **common)


def _receivers(results: list[RankResult], born_on: list[int], notes: list[str]) -> None:
    """A note naming how the ranks that did not make the value received it."""
    said = [(r.rank, received_words(r.path)) for r in results
            if r.rank not in born_on and r.path is not None and r.path.how == "received"]
    if said:
        notes.append("; ".join(grouped(said)))


def _reference_notes(reference: str | None, results: list[RankResult]) -> list[str]:
    """One line per rank on how its step went on the reference, when there was one
    (``reference``: the report's ``facts.reference``, the spec's text: ``none`` for none)."""
    if reference is None or reference == NONE:
        return []
    out = []
    for r in results:
        ref, s = r.reference, r.summary
        if ref is None:
            continue
        how = (f"failed in {ref.phase}" if ref.phase else "stayed finite")
        part = (f"; its target step first parts from it at {ref.divergence} (max rel diff "
                f"{ref.max_rel})" if ref.divergence else "")
        out.append(f"rank {r.rank} on the reference ({reference}): {how}, loss {ref.loss} "
                   f"(target {s.loss if s else None}){part}")
    return out


def subset_report(facts: RunFacts, world_size: int, results: list[RankResult]) -> Report:
    """`_subset_report`, a culprit of a replay that does not compute the captured step made
    ``replay-mismatch``."""
    return faithful_or_mismatch(_subset_report(facts, world_size, results))


def _subset_report(facts: RunFacts, world_size: int, results: list[RankResult]) -> Report:
    """The report of a replay of some ranks alone (``--ranks``), each with the collectives the
    capture recorded for it (`multirank.alone`).

    A replayed rank that computed the failure is the culprit, named as the lockstep replay names
    it. Ranks that only received it name, from the capture's record, the ranks that fed the
    collective non-finite input: the culprit is then the lowest of those (its rank and phase,
    not its op: it was not replayed) and ``subset.next_ranks`` says which ranks to replay. A
    collective that made NaN from finite inputs is ``communication`` only when every rank was
    replayed; a subset cannot re-run it (`subset.decided` false)."""
    replayed = sorted(r.rank for r in results)
    notes = [f"replayed {ranks_text(replayed)} of world size {world_size} alone, each in a "
             "process of its own, every collective served what the capture recorded for that rank"
             + (f" ({world_size - len(replayed)} rank(s) not replayed)"
                if len(replayed) < world_size else "")] + _reference_notes(facts.reference,
                                                                           results)
    for r in results:
        if r.served_inputs_differ:
            notes.append(f"rank {r.rank}: the inputs of collective(s) "
                         f"{r.served_inputs_differ[:5]} differ from the capture's, so what they "
                         "were served is what the capture received, not what this replay would "
                         "have: the replay does not compute the captured step exactly; replay "
                         "all ranks (drop --ranks)")
    common = dict(facts=facts, ranks=results)
    subset = Subset(replayed, world_size)
    bad_input = [r for r in results if r.summary and r.summary.phase == "input"]
    if bad_input:
        bad = [BadValue(b.where, f"rank {r.rank}: {b.name}", b.nan, b.posinf, b.neginf)
               for r in bad_input for b in r.summary.input_nonfinite]
        return Report("input-nonfinite", "data", "input", bad[0].kind, None,
                      input_nonfinite=bad, notes=notes, subset=subset, **common)
    computed = [r for r in results if r.culprit is not None]
    if computed:
        own = computed[0]
        others = [r.rank for r in results if r is not own and r.summary
                  and r.summary.phase is not None]
        notes.append(f"rank {own.rank} computed the failure locally"
                     + (f"; {ranks_text(others)} received it" if others else ""))
        notes += own.classification_notes
        kind = (own.summary.kind if own.summary else None) or "nan"
        return Report("culprit", own.classification or "unknown", own.culprit.phase, kind,
                      own.culprit, notes=notes, context=own.context, inf_origin=own.inf_origin,
                      op_check=own.op_check, subset=subset, remedies=own.remedies, **common)
    received = [r for r in results if r.plan is not None and r.plan.through_collective]
    if received:
        return _received(facts, received, results, subset, notes)
    return _stayed_finite(facts, results, subset, notes)


def _received(facts: RunFacts, received: list[RankResult], results: list[RankResult],
              subset: Subset, notes: list[str]) -> Report:
    """`subset_report` when the replayed ranks only received the failure through a collective:
    the capture's record names who fed it (next to replay), contradicts the replay, or says
    that no rank did (communication, decided only with every rank replayed)."""
    replayed, common = subset.replayed, dict(facts=facts, ranks=results)
    first = received[0]
    how = (f"{first.root.op}{_where(first.root)}" if first.root is not None
           else "the gradient reduction")
    fed = {s for r in received for s in (r.received_from or [])}
    senders = sorted(fed - set(replayed))
    kind = (first.summary.kind if first.summary else None) or "nan"
    # the capture says a replayed rank fed it NaN/inf, but replayed, that rank's input is
    # finite: the failure does not come back there (another device, a transient): never
    # blame the collective for it
    contradicted = sorted((fed & set(replayed))
                          | {r.rank for r in received if r.recorded_input_bad})
    if contradicted:
        notes.append(f"{ranks_text([r.rank for r in received])} received the failure "
                     f"through {how} as the capture recorded it, but "
                     f"{ranks_text(contradicted)}, whose input to it held NaN/inf at capture, "
                     "compute finite values in this "
                     f"replay on {facts.target}: the failure does not reproduce there (it "
                     "needs the capture's device, or it was a transient); replay those "
                     "ranks on the capture device")
        return Report("not-reproduced", "unknown", None, None, None, notes=notes,
                      subset=replace(subset, decided=False, why=(
                          f"{ranks_text(contradicted)} fed the collective NaN/inf at "
                          "capture but compute finite values when replayed")), **common)
    if senders:
        s = senders[0]
        # where the sender's failure was at capture: its own loss non-finite -> forward;
        # else the phase the collective ran in (a DDP reduction: backward)
        seen = ((facts.observed or {}).get(str(s)) or {}).get("first")
        phase = "forward" if seen == "loss" else (
            "backward" if first.root is None else (first.plan.phase or "forward"))
        notes.append(f"{ranks_text([r.rank for r in received])} received the failure "
                     f"through {how} (finite inputs here, non-finite output as the capture "
                     f"recorded it); at capture, {ranks_text(senders)} fed it non-finite "
                     "input: "
                     "the failure came from there (computed there, or received there in "
                     f"turn); replay with --ranks {s} to find the op")
        return Report("culprit", "unknown", phase, kind, Culprit.phase_only(phase, rank=s),
                      notes=notes, subset=replace(subset, decided=False, next_ranks=senders,
                                                  why=(f"{ranks_text(senders)} fed the failure "
                                                       "into the collective and were not "
                                                       "replayed: their op is not known")),
                      **common)
    return _nobody_computed(facts, received, results, subset, notes, how, kind)


def _nobody_computed(facts: RunFacts, received: list[RankResult], results: list[RankResult],
                     subset: Subset, notes: list[str], how: str, kind: str) -> Report:
    """`_received` when the capture's record names no rank that fed the collective NaN/inf:
    communication with every rank replayed, else undecided."""
    replayed, world_size, common = subset.replayed, subset.world_size, dict(facts=facts,
                                                                             ranks=results)
    first = received[0]
    phase = ("grad-reduce" if first.root is None or first.plan.phase == "backward"
             else first.plan.phase)
    root = first.root
    culprit = Culprit.of_root(phase, root, first.rank)
    if len(replayed) == world_size and not any(r.served_inputs_differ for r in results):
        notes.append(f"every rank's input to {how} was finite in the replay and its output "
                     "(as the capture recorded it) was not: the collective (or the code "
                     "around it) is at fault")
        return Report("culprit", "communication", phase, kind, culprit, notes=notes,
                      subset=subset, **common)
    notes.append(f"{ranks_text([r.rank for r in received])} received the failure through "
                 f"{how}; "
                 "every other rank's input to it was finite at capture, so no rank computed "
                 "it and the collective (or its comm hook) looks at fault, but a replay of "
                 "some ranks cannot re-run a collective: replay all ranks (drop --ranks) "
                 "to decide")
    return Report("culprit", "unknown", phase, kind, culprit, notes=notes,
                  subset=replace(subset, decided=False, why=(
                      "a faulty collective needs all its participants' inputs: replay all "
                      "ranks")), **common)


def _stayed_finite(facts: RunFacts, results: list[RankResult], subset: Subset,
                   notes: list[str]) -> Report:
    """`subset_report` when no replayed rank failed: clean, or the failure was elsewhere."""
    common = dict(facts=facts, ranks=results)
    failed_at_capture = sorted(int(r) for r, o in (facts.observed or {}).items()
                               if o and o.get("first") in ("loss", "grad", "param"))
    if failed_at_capture:
        others = [r for r in failed_at_capture if r not in subset.replayed]
        notes.append(f"the replayed rank(s) stay finite with the collectives they received at "
                     "capture; the failure was seen at capture on "
                     f"{ranks_text(failed_at_capture)}"
                     + (f": replay with --ranks {others[0]}" if others else ""))
        return Report("not-reproduced", "unknown", None, None, None, notes=notes,
                      subset=replace(subset, decided=False, next_ranks=others, why=(
                          "the replayed ranks stay finite; the failure was seen on other "
                          "ranks")), **common)
    return Report("clean", None, None, None, None, notes=notes, subset=subset, **common)
