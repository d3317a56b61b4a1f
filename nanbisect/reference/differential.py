"""Differential replay: where do target and reference part ways, without any NaN?

Guarantees: the step is compared at three points (loss, gradients, updated parameters) with
`compare.compare_step`; the first point that diverges names the phase. Module calls are aligned by
(module name, call index), never by op position (op sequences differ across devices: fused
kernels, decompositions), and the first call whose output (forward) or outgoing gradient
(backward) diverges is the suspect. Inside it, every op is isolated on the reference with the
target's own inputs (`isolate.check_op`): the first op that is wrong *given its inputs* is the
culprit; ops after it that only inherit the error pass their own check and are not blamed.
Random ops on the reference return what the target drew (`RandomTape` / `RandomReplay`), so
dropout masks and noise match across devices and dtypes and never look like divergence.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.reference import kernels as registry
from nanbisect.records import CallId, Divergence, OpCheck, OpFinding, OpSite, Stats, StepOutcome
from nanbisect.reference.compare import compare_step, step_rtol
from nanbisect.reference.opcheck import RANDOM_OR_UNINITIALISED, check_op
from nanbisect.replay.recorder import OpRecorder, tensor_args, written_tensors
from nanbisect.replay.probe import CallStats, ProbeTable
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.util import torch_internals as ti


@dataclass(frozen=True)
class StepState:
    """What a replayed step left behind, on the CPU, for comparison."""

    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def step_state(rep: Replayer, outcome: StepOutcome) -> StepState:
    model = rep.task.model
    cpu = lambda t: t.detach().to(devices.HOST, copy=True)  # noqa: E731
    return StepState(cpu(outcome.loss_tensor) if outcome.loss_tensor is not None else None,
                     {n: cpu(p.grad) for n, p in model.named_parameters() if p.grad is not None},
                     {n: cpu(p) for n, p in model.named_parameters()})


def first_divergence(t: StepState, r: StepState, dtype: torch.dtype) -> Divergence | None:
    """The first of loss, gradients, updated parameters where target and reference disagree."""
    if t.loss is not None and r.loss is not None:
        c = compare_step(t.loss, r.loss, dtype)
        if not c.ok:
            return Divergence("forward", "loss", c)
    for phase, prefix, a, b in (("backward", "grad", t.grads, r.grads),
                                ("optimizer", "param", t.params, r.params)):
        for name, x in a.items():
            if name in b:
                c = compare_step(x, b[name], dtype)
                if not c.ok:
                    return Divergence(phase, f"{prefix}:{name}", c)
    return None


def _differs(a: Stats | None, b: Stats | None, rtol: float) -> bool:
    if a is None or b is None:
        return False
    if (a.nan, a.posinf, a.neginf) != (b.nan, b.posinf, b.neginf):
        return True
    for x, y in ((a.absmax, b.absmax), (a.abssum, b.abssum)):
        if abs(x - y) > rtol * max(abs(y), 1e-30):
            return True
    return False


def diverging_call(target: ProbeTable, reference: ProbeTable, phase: str,
                   dtype: torch.dtype) -> CallStats | None:
    """The call to isolate: the first call (execution order; innermost first) whose result
    differs between the sides. When what came into that call differs already (its inputs in
    forward, its outputs' gradient in backward), it only passed the divergence on, which was born
    before it began, in the code of a call enclosing it (between its children: an op a parent's
    ``forward`` runs itself): then the innermost enclosing call whose incoming values agree; None
    (the whole phase) when there is none."""
    rtol = step_rtol(dtype)
    result = (lambda c: c.output) if phase == "forward" else (lambda c: c.grad_in)
    incoming = (lambda c: c.inputs) if phase == "forward" else (lambda c: c.grad_out)
    for c in target.in_order(phase):
        r = reference.get(c.call)
        if r is None or not _differs(result(c), result(r), rtol):
            continue
        if not _differs(incoming(c), incoming(r), rtol):
            return c
        for a in target.ancestors(c):
            ra = reference.get(a.call)
            if ra is not None and incoming(a) is not None and incoming(ra) is not None \
                    and not _differs(incoming(a), incoming(ra), rtol):
                return a        # (a call whose incoming values were not seen says nothing)
        return None
    return None


def isolate_window(rep: Replayer, phase: str, call: CallId | None, ref_device: torch.device,
                   wrap: Callable[[], ContextManager] = nullcontext
                   ) -> tuple[OpFinding | None, OpCheck | None, int, list[OpCheck]]:
    """Record the target's ops inside ``call`` (whole ``phase`` when None), keeping their values,
    and judge each on the reference in order; stop at the first mismatch.

    Returns the first op wrong given its inputs (as a finding) and its check, how many ops were
    checked, and the ops that could not be compared."""
    tracker = ModuleTracker(rep.task.model, map_nodes=(phase == "backward"))
    rec = OpRecorder(tracker, {phase}, keep=(lambda: tracker.within(call, rec.phase))
                     if call is not None else (lambda: True))

    rep.run(phase=rec.follow, wrap=lambda: stacked(wrap(), tracker, rec), stop_after=phase)
    table, _ = rec.read()
    uncomparable, checked = [], 0
    for pos in sorted(rec.kept):
        args, kwargs, outs = rec.kept[pos]
        op = table.ops[pos]
        check = check_op(op.op, op.index, args, kwargs, outs, ref_device)
        checked += 1
        if check.status == "uncomparable":
            uncomparable.append(check)
        elif check.status == "mismatch":
            finding = OpFinding(site=OpSite(op.op, op.phase, op.occurrence), op_index=op.index,
                                module=op.module or "", module_call=op.module_call,
                                input_dtypes=[i.dtype for i in op.inputs],
                                input_shapes=[list(i.shape) for i in op.inputs],
                                total_ops=table.total_ops, recorded=len(table.ops))
            return finding, check, checked, uncomparable
    return None, None, checked, uncomparable


class ReferenceKernels(ti.ObserverMode):
    """On the reference (or a target of another device type than the capture's): an op without
    a kernel there runs its registered reference_impl; ``used`` collects the ops that did."""

    def __init__(self, used: set[str] | None = None, custom_only: bool = False) -> None:
        super().__init__()
        self.used = used if used is not None else set()
        self.custom_only = custom_only     # torch's own ops pass by (a target: they have kernels)

    def wants(self, func) -> bool:
        return not self.custom_only or func.namespace not in ti.BUILTIN_NAMESPACES

    def run(self, call: ti.OpCall):
        out, registered = registry.kernel_or_registered(call.func, call.name, call.args,
                                                        call.kwargs)
        if registered:
            self.used.add(call.name)
        return out


def _random(func) -> bool:
    name = func.overloadpacket.__name__
    return name in RANDOM_OR_UNINITIALISED and not name.startswith(("empty", "new_empty"))


class RandomTape(ti.ObserverMode):
    """On the target: keep (on the CPU) what every random op produced, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[list[torch.Tensor]] = []

    def wants(self, func) -> bool:
        return _random(func)

    def after(self, call: ti.OpCall, out) -> None:
        returned, mutated = written_tensors(call.func, out, call.args, call.kwargs)
        self.values.append([t.detach().to(devices.HOST, copy=True)
                            for t, _ in tensor_args(returned + mutated)])


class RandomReplay(ti.ObserverMode):
    """On the reference: every random op gives what the target's drew (moved, cast), so dropout
    masks and noise match across devices and dtypes and never look like divergence."""

    def __init__(self, tape: RandomTape) -> None:
        super().__init__()
        self.tape = tape
        self.i = 0

    def wants(self, func) -> bool:
        return _random(func) and self.i < len(self.tape.values)

    def after(self, call: ti.OpCall, out) -> None:
        returned, mutated = written_tensors(call.func, out, call.args, call.kwargs)
        mine = [t for t, _ in tensor_args(returned + mutated)]
        theirs = self.tape.values[self.i]
        self.i += 1
        if [t.shape for t in mine] == [t.shape for t in theirs]:
            with torch.no_grad():
                for m, t in zip(mine, theirs):
                    m.copy_(t)
