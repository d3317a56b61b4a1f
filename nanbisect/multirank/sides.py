"""What a rank's replay needs on either launch path (every rank in lockstep, `worker`; some ranks
alone, `alone`): its reference side, the culprit module call's statistics, its root op."""
from __future__ import annotations


import torch

from nanbisect import devices
from nanbisect.multirank.ddp import ReductionObserver, observe_default_hook, observing_comm_hooks
from nanbisect.records import (CallId, OpFinding, RankReference, RankRoot, Stats, StepOutcome,
                               json_number)
from nanbisect.reference import kernels as registry
from nanbisect.reference.differential import (RandomReplay, RandomTape, ReferenceKernels,
                                              first_divergence, step_state)
from nanbisect.replay.probe import ModuleProbe, ProbeTable, probing
from nanbisect.replay.recorder import is_collective
from nanbisect.replay.replayer import Replayer, stacked


def call_stats(table: ProbeTable, call: CallId) -> dict[str, Stats | None] | None:
    c = table.get(call)
    if c is None:
        return None
    return {"inputs": c.inputs, "output": c.output, "grad_arriving": c.grad_out,
            "grad_leaving": c.grad_in}


class ReferenceSide:
    """This rank's replay on the reference (``--reference``): the same part, the same world, the
    reference device; random ops draw what this rank's target drew."""

    def __init__(self, part, spec: str, entry: str, server=None) -> None:
        registry.load_plugins()
        self.device, self.dtype = devices.local_device(spec)
        self.server = server     # a replay without the other ranks: collectives served
        self.observer = ReductionObserver({}, server=server)
        with observing_comm_hooks(self.observer):
            self.rep = Replayer(part, self.device, self.dtype, entry=entry)
        model = self.rep.task.model
        self.observer.names.update({p: n for n, p in model.named_parameters()})
        observe_default_hook(model, self.observer)
        self.rep.lockstep = server is None
        if server is not None:
            self.rep.restored.append(server.rewind)
        self.probe = ModuleProbe(model)

    def run(self, tape: RandomTape) -> StepOutcome:
        served = [self.server] if self.server is not None else []
        if self.server is not None:   # its inputs differ from the capture's by design
            self.server.check_inputs = False
        try:
            return self.rep.run(phase=probing(self.probe), wrap=lambda: stacked(
                *served, ReferenceKernels(), RandomReplay(tape)))
        finally:
            if self.server is not None:
                self.server.check_inputs = True

    def summary(self, outcome: StepOutcome, rep: Replayer, first: StepOutcome,
                target_state=None) -> RankReference:
        """How the reference's step ended, and where a finite target step parts from it."""
        # a target that failed parts from a finite reference trivially: only a finite step's
        # divergence is news
        self.divergence = None
        if first.phase is None:
            t_dtype = next(rep.task.model.parameters(), torch.zeros(())).dtype
            self.divergence = first_divergence(target_state or step_state(rep, first),
                                               step_state(self.rep, outcome), t_dtype)
        div = self.divergence
        return RankReference(outcome.phase, json_number(outcome.loss),
                             div.what if div else None,
                             json_number(div.comparison.max_rel) if div else None)


def root_of(finding: OpFinding | None) -> RankRoot | None:
    """What one rank's op recording traced its failure to, for the other ranks."""
    if finding is None:
        return None
    return RankRoot(finding.op, finding.op_index, finding.module, finding.module_call,
                    finding.input_dtypes, finding.input_shapes, is_collective(finding.op))


