"""One rank of a multi-rank bundle replayed without the others (``nanbisect run --ranks R,...``).

The process is rank r of the recorded world size, on torch's fake process group (which
communicates nothing); every collective of the step is served what the capture recorded for this
rank (`multirank.served`). So rank 517 of a 1,000-rank job replays on one machine, in one process,
with the same passes as in lockstep (module statistics, op recording, input catch, repro, and the
reference side with ``--reference``).

What one rank can decide alone:
- it computed the failure: its root op is a computation (its own inputs finite, its output not);
  that is the culprit, as the lockstep replay names it;
- it received the failure: its root is a collective whose output (served, as recorded) was
  non-finite. Who sent it is read from the capture's record: the ranks whose input to that
  collective (to DDP's gradient reduction, for a DDP model) held NaN/inf at capture
  (`RankResult.received_from`; a receive's: the rank whose matching send carried NaN/inf),
  or whose own loss was non-finite. Those ranks are named for the
  next replay; their op is not known until they are replayed.
What it cannot decide: whether a collective corrupted finite inputs. Re-running a collective
needs all its participants' inputs; a subset has only its own, and the others' NaN/inf counts.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from nanbisect.bundle.format import Bundle, read_bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.bundle.tape import RECEIVE, ROLE, SEND, Entry, TapeMismatch, parse
from nanbisect.errors import BadInput
from nanbisect.chain import Chain, Located, Serving
from nanbisect.multirank.sides import (call_stats, finish_rank, rank_reference, rank_replayer,
                                       reference_record, root_of)
from nanbisect.multirank.served import TapeServer
from nanbisect.records import CallId, Plan, RankResult, RankSummary, json_number
from nanbisect.replay.probe import ProbeTable
from nanbisect.replay.replayer import stacked
from nanbisect.task import load_inject

NO_TAPE = ("records no collectives (captured with nanbisect.capture, or by a nanbisect older "
           "than --ranks): replay all ranks (drop --ranks), or capture it with Guard")


def check_tape(bundle: Bundle, ranks: list[int]) -> None:
    """Every rank to replay alone has a recorded tape (`BadInput` before anything starts)."""
    for r in ranks:
        part = bundle.part(r)
        recorded = Manifest.of(part).collectives
        if recorded is None:
            raise BadInput(f"bundle '{bundle.path}': rank {r}'s part {NO_TAPE}")
        parse(recorded, f"bundle '{part.path}'")


def _recorded(top: Bundle, r: int):
    """Rank ``r``'s recorded collectives (unverified: only their NaN/inf counts are read)."""
    other = top.part(r, verify=False)
    return parse(Manifest.of(other).collectives or {"schema": 1, "entries": []},
                 f"bundle '{other.path}'")


def _feeders(top: Bundle, me: int, entry: Entry | None, occurrence: int) -> tuple[list, bool]:
    """(the other participants whose input to the collective held NaN/inf at capture, whether
    ``me``'s own recorded input did). ``entry`` is the collective in ``me``'s tape (its op and
    group, and ``occurrence``: how many same op-and-group collectives came before it), matched in
    each participant's tape by op, group and occurrence (a receive: the n-th send from its sender
    to ``me``, the group being [sender, receiver]); None: DDP's gradient reduction."""
    mine, ddp = _recorded(top, me)
    if entry is None:
        group = (ddp or {}).get("group") or list(range(top.world_size))
    else:
        group = entry.group or list(range(top.world_size))

    def bad_input(entries: list[Entry]) -> bool:
        if entry is None:
            return any(e.in_nan or e.in_inf for e in entries if e.kind == "ddp-bucket")
        if entry.op == RECEIVE:     # a message: the sender's n-th send to this rank
            same = [e for e in entries if e.kind == "p2p" and e.op == SEND
                    and e.group == entry.group]
        else:
            same = [e for e in entries if e.kind == "tape" and e.op == entry.op
                    and e.group == entry.group]
        return len(same) > occurrence and bool(same[occurrence].in_nan or same[occurrence].in_inf)

    feeders = [r for r in group if r != me and r in Manifest.of(top).ranks   # partial: its
               and bad_input(_recorded(top, r)[0])]                               # parts only
    return feeders, bad_input(mine)


def _through(server: TapeServer, root) -> tuple[Entry | None, int]:
    """The served collective the root op is: the first whose recorded output was non-finite
    with the root's op and shapes (an in-place collective reads what it writes), else with its
    op; and its occurrence among same op-and-group collectives."""
    def pick(match) -> int | None:
        return next((i for i, e in enumerate(server.entries)
                     if (e.out_nan or e.out_inf) and match(e)), None)

    i = pick(lambda e: e.op == root.op and e.shapes == root.input_shapes)
    if i is None:
        i = pick(lambda e: e.op == root.op)
    if i is None:
        return None, 0
    e = server.entries[i]
    return e, sum(1 for x in server.entries[:i] if x.op == e.op and x.group == e.group)


def replay_alone(bundle_path: Path, partial: Path, rank: int, target: str, inject: str | None,
                 entry: str | None = None,
                 reference: tuple[torch.device, torch.dtype | None] | None = None,
                 stage=lambda s: None, remedies: int = 0, run_top_level: bool = False, *,
                 placed: tuple[torch.device, torch.dtype | None]) -> RankResult:
    top = read_bundle(bundle_path, verify=False)   # the launcher verified this rank's part
    part = top.part(rank)
    recorded = Manifest.of(part).collectives
    if recorded is None:
        raise BadInput(f"bundle '{top.path}': rank {rank}'s part {NO_TAPE}")
    server = TapeServer(recorded, part.tensors(ROLE), where=f"bundle '{part.path}'")
    stage("building the task")
    rep, observer = rank_replayer(part, placed, entry, server, run_top_level)
    inject_wrap = load_inject(inject) if inject else nullcontext
    # served collectives underneath everything else: the recorder sees their output as theirs;
    # a single op re-run alone (the op check) gets the injection only
    chain = Chain(rep, Serving.SERVED, lambda: stacked(server, inject_wrap()),
                  op_wrap=inject_wrap, progress=lambda key, text: stage(text))
    side = ref_observer = None
    if reference is not None:
        side, ref_observer = rank_reference(chain, part, reference, rep.entry, server=server)
    bad = chain.bad_inputs()
    if bad:
        summary = RankSummary(rank, "input", None, None, input_nonfinite=bad)
        return RankResult(rank, plan=Plan("input", rank), summary=summary)
    first, table = chain.first_pass(reference=side is not None)
    observer.active = False
    theirs = None
    if side is not None:
        chain.reference(side, first)
        ref_observer.active = False
        theirs, _ = reference_record(side, first)
    summary = RankSummary(rank, first.phase, json_number(first.loss), first.kind,
                          buckets=observer.read())
    result = RankResult(rank, summary=summary, reference=theirs,
                        served_inputs_differ=list(server.served_inputs_differ))
    phase = first.phase
    if phase is None:
        if server.i < len(server.entries):   # the whole step ran: every recorded one is due
            raise TapeMismatch(f"the replayed step issued {server.i} of the "
                               f"{len(server.entries)} collectives the capture recorded")
        return replace(result, plan=Plan(None, None))
    if phase == "backward" and summary.buckets and not summary.reduce_in_bad:
        # finite going into DDP's reduction, not coming out: received through it
        feeders, mine_bad = _feeders(top, rank, None, 0)
        return replace(result, plan=Plan("grad-reduce", None, through_collective=True),
                       received_from=feeders, recorded_input_bad=mine_bad)
    result, loc = _locate(chain, top, server, first, table, result)
    if loc is None:
        return result
    # NB: the reference is served the capture's collectives, non-finite ones included, so its
    # step failing proves nothing here: only the op, re-run from the same inputs, does
    # (`Chain.classify` of a rank alone)
    result = finish_rank(result, chain, loc, side, partial, target, remedies=remedies)
    made = result.culprit.phase if result.culprit is not None else None
    if made and made != phase:    # a pipeline stage: it sent on what it made earlier
        result = replace(result, summary=replace(result.summary, phase=made))
    return result


def _locate(chain: Chain, top: Bundle, server: TapeServer, first, table: ProbeTable,
            result: RankResult) -> tuple[RankResult, "Located | None"]:
    """Passes 2 and 3 on a rank alone: a root that is a served collective means the failure
    was received (its senders read from the capture's record: no `Located`); else this rank
    computed it."""
    rank, phase = result.rank, first.phase

    def agree(finding):   # a root that is a served collective: received, not computed here
        root = root_of(finding)
        return None if root is not None and root.collective else (
            finding.site if finding is not None else None, True)

    loc = chain.locate(first, table, agree)
    finding = loc.finding
    result = replace(result, root=root_of(finding))
    if loc.through:
        entry, occurrence = _through(server, result.root)
        feeders, mine_bad = (_feeders(top, rank, entry, occurrence) if entry is not None
                             else ([], False))
        return replace(result, plan=Plan(phase, None, through_collective=True),
                       received_from=feeders, recorded_input_bad=mine_bad), None
    result = replace(result, plan=Plan(phase, rank))
    if finding is not None:
        result = replace(result, module_stats=call_stats(
            table, CallId(finding.module, finding.module_call)))
    return result, loc
