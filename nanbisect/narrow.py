"""The op-level passes: record the failing phase's ops, trace the failure to its root op, then
catch that op's inputs in one more, narrow replay and write the standalone repro.

Guarantees: op recording runs only over the failing phase (forward until the loss; backward; the
optimizer step), with flags on the device read back once; Python stacks are taken only in the
last pass, and only for the culprit op. The trace starts from what actually failed (the loss, the
non-finite gradients, the non-finite parameters), so NaN that was masked or zeroed on the way
is never blamed.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

from .oprecord import OpRecorder
from .provenance import Root, context, culprit_root, inf_origin, reaches_outside
from .repro import Caught, InputCatcher
from .replay import Replayer, stacked
from .tracker import ModuleTracker


@dataclass(frozen=True)
class OpFinding:
    """The root op of the failure, as recorded."""

    op: str
    op_index: int
    phase: str
    module: str | None
    module_call: int | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    parameter: str | None = None
    context: list[dict] = field(default_factory=list)
    inf_origin: dict | None = None
    total_ops: int = 0
    occurrence: int = 0     # how many calls of the same op came before it in its phase
    recorded: int = 0       # ops recorded (all of the phase, or only the scoped call's)
    scope: tuple[str, int] | None = None   # the module call recording was limited to


def _describe(root: Root) -> dict:
    rec = root.op
    return {"op": rec.op, "op_index": rec.index, "phase": rec.phase, "module": rec.module,
            "module_call": rec.module_call}


def record_ops(rep: Replayer, phase: str, kind: str,
               wrap: Callable[[], ContextManager] = nullcontext,
               scope: tuple[str, int] | None = None) -> OpFinding | None:
    """Second pass: record the ops of ``phase`` and trace the failure back to its root op.

    With ``scope`` (the forward module call that the first pass found producing the failure from
    clean inputs) recording starts when that call starts: the ops before it are not recorded,
    their values enter as outside values with their flags. A root found that way is sound (an op
    on the failure's path with clean inputs and a bad output). When the trace runs into a bad
    outside value instead (the failure came from before the call), finds no root, or the root
    consumed an inf born before the call (``inf_origin`` needs those ops), the whole phase is
    recorded: one more replay. NB: multi-rank replays pass no scope, so that every rank runs the
    same passes.
    """
    if scope is not None and phase == "forward":
        found = _record(rep, phase, kind, wrap, scope)
        if found is not None:
            return found
    return _record(rep, phase, kind, wrap, None)


def _record(rep: Replayer, phase: str, kind: str, wrap, scope) -> OpFinding | None:
    model = rep.task.model
    tracker = ModuleTracker(model, map_nodes=(phase == "backward"))
    started = [scope is None]
    rec = OpRecorder(tracker, phases={phase}, scope=None if scope is None else lambda: started[0])
    handles = _start_at_call(model, scope, started) if scope else []
    try:
        out = rep.run(phase=rec.follow, wrap=lambda: stacked(wrap(), tracker, rec),
                      stop_after=phase)
    finally:
        for h in handles:
            h.remove()
    names = list(model.named_parameters())
    if phase == "forward" and out.loss_tensor is not None:
        rec.mark("loss", out.loss_tensor)
    elif phase == "backward":
        for n, p in names:
            if p.grad is not None:
                rec.mark(n, p.grad)
    elif phase == "optimizer":
        for n, p in names:
            rec.mark(n, p)
    table, marks = rec.read()
    starts = {n: m for n, m in marks.items() if m is not None}
    root = culprit_root(table, list(starts.values()), kind)
    if root is None and phase == "backward":
        # the failed gradients were written outside the recorded ops (e.g. by DDP's reducer
        # after its collective): start from the values that left the recorded backward instead
        root = culprit_root(table, table.leaves(), kind)
    if root is None:
        return None
    if scope and reaches_outside(table, list(starts.values()), kind):
        return None         # part of the failure comes from before the recorded window
    parameter = None
    if phase == "optimizer":
        for n, _ in names:  # the first parameter (model order) whose failure leads to the root
            if n in starts:
                r = culprit_root(table, [starts[n]], kind)
                if r is not None and r.op.pos == root.op.pos:
                    parameter = n
                    break
    module, call = root.op.module, root.op.module_call
    if phase == "optimizer":
        module, call = (parameter or "").rpartition(".")[0], None
    ins = root.op.inputs_for(root.op.outputs[root.output])
    origin = inf_origin(table, root)
    if scope and origin is None and any(i.flags.inf for i in ins):
        return None         # the inf came from before the call: record the whole phase
    return OpFinding(op=root.op.op, op_index=root.op.index, phase=root.op.phase,
                     occurrence=root.op.occurrence,
                     module=module if module is not None else "", module_call=call,
                     input_dtypes=[i.dtype for i in ins], input_shapes=[list(i.shape) for i in ins],
                     parameter=parameter,
                     context=context(table, root), total_ops=table.total_ops,
                     inf_origin=_describe(origin) if origin is not None else None,
                     recorded=len(table.ops), scope=scope)


def _start_at_call(model: torch.nn.Module, scope: tuple[str, int], started: list) -> list:
    """A hook that sets ``started[0]`` when call ``scope`` of its module begins."""
    sub = model.get_submodule(scope[0])
    calls = [0]

    def pre(mod, args):
        if calls[0] == scope[1]:
            started[0] = True
        calls[0] += 1

    return [sub.register_forward_pre_hook(pre)]


def catch_inputs(rep: Replayer, finding: OpFinding,
                 wrap: Callable[[], ContextManager] = nullcontext) -> Caught | None:
    """Last pass: replay up to the culprit's phase and clone the culprit op's arguments."""
    catcher = InputCatcher(finding.op, finding.phase, finding.occurrence)

    def phase(name: str) -> ContextManager:
        catcher.phase = name
        # anomaly mode makes every autograd node remember the forward line that created it
        if name == "forward" and finding.phase == "backward":
            return torch.autograd.set_detect_anomaly(True, check_nan=False)
        return nullcontext()

    rep.run(phase=phase, wrap=lambda: stacked(wrap(), catcher), stop_after=finding.phase)
    c = catcher.caught
    return c if c is not None and c.op == finding.op else None


def repro_imports(op: str, entry: str) -> list[str]:
    """Files the repro must import to have ``op``: the entry file, for non-built-in ops."""
    if op.split(".", 1)[0] in ("aten", "prims", "quantized"):
        return []
    target = entry.rpartition(":")[0]
    return [str(Path(target).resolve())] if target.endswith(".py") else []


@dataclass
class ModuleCaught:
    """A module call's inputs, the module's own state and the RNG state at its start; for a
    backward culprit also the gradient that arrived at each of its outputs (None: no gradient,
    or not a floating tensor), in the order of the output's tensors (lists, tuples, dict values).
    """

    module: str
    call: int
    args: list
    kwargs: dict
    state: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    grad_out: list | None = None


def catch_module_call(rep: Replayer, module: str, call: int,
                      wrap: Callable[[], ContextManager] = nullcontext,
                      backward: bool = False) -> ModuleCaught | None:
    """Replay and clone what the ``call``-th call of ``module`` started from (for ``backward``,
    replay backward too and clone the gradients arriving at the call's outputs)."""
    sub = rep.task.model.get_submodule(module)
    seen, out = [0], []
    grads: list = []

    def pre(mod, args, kwargs):
        if seen[0] == call:
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa
            out.append(ModuleCaught(
                module, call, torch.utils._pytree.tree_map(clone, list(args)),
                torch.utils._pytree.tree_map(clone, dict(kwargs)),
                {k: v.detach().clone() for k, v in mod.state_dict(keep_vars=True).items()},
                {"rng/cpu": torch.get_rng_state()}))
        seen[0] += 1

    def post(mod, args, kwargs, output):
        if seen[0] - 1 != call or not backward:
            return
        leaves = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        grads.extend([None] * len(leaves))
        for i, t in enumerate(leaves):
            if t.is_floating_point() and t.requires_grad:
                def keep(g, i=i):
                    grads[i] = g.detach().clone()
                t.register_hook(keep)

    handles = [sub.register_forward_pre_hook(pre, with_kwargs=True),
               sub.register_forward_hook(post, with_kwargs=True)]
    try:
        rep.run(wrap=wrap, stop_after="backward" if backward else "forward")
    finally:
        for h in handles:
            h.remove()
    if out and backward:
        out[0].grad_out = grads
    return out[0] if out else None
