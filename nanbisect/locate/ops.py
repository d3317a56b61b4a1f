"""The op recording pass: record the failing phase's ops and trace the failure to its root op.

Guarantees: op recording runs only over the failing phase (forward until the loss; backward; the
optimizer step), with flags on the device read back once; no Python stack is taken here (only in
`locate.catch`, for the culprit op). The trace starts from what actually failed (the loss, the
non-finite gradients, the non-finite parameters), so NaN that was masked or zeroed on the way
is never blamed.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

from nanbisect.locate.provenance import context, culprit_root, inf_origin, op_ref, reaches_outside
from nanbisect.records import CallId, OpFinding, OpSite
from nanbisect.replay.recorder import OpRecorder
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.replay.tracker import ModuleTracker


def record_ops(rep: Replayer, phase: str, kind: str,
               wrap: Callable[[], ContextManager] = nullcontext,
               scope: CallId | None = None) -> OpFinding | None:
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


def _record(rep: Replayer, phase: str, kind: str, wrap, scope: CallId | None
            ) -> OpFinding | None:
    model = rep.task.model
    tracker = ModuleTracker(model, map_nodes=(phase == "backward"))
    started = [scope is None]
    if scope is not None:
        def start(call, *_):
            if call == scope:
                started[0] = True
        tracker.listen(enter=start)
    rec = OpRecorder(tracker, phases={phase}, scope=None if scope is None else lambda: started[0])
    out = rep.run(phase=rec.follow, wrap=lambda: stacked(wrap(), tracker, rec), stop_after=phase)
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
    elif phase == "backward":   # the root op wrote a parameter's gradient itself
        parameter = next((n for n, _ in names if starts.get(n) == (root.op.pos, root.output)),
                         None)
    module, call = root.op.module, root.op.module_call
    if phase == "optimizer":
        module, call = (parameter or "").rpartition(".")[0], None
    ins = root.op.inputs_for(root.op.outputs[root.output])
    origin = inf_origin(table, root)
    if scope and origin is None and any(i.flags.inf for i in ins):
        return None         # the inf came from before the call: record the whole phase
    return OpFinding(site=OpSite(root.op.op, root.op.phase, root.op.occurrence),
                     op_index=root.op.index, module=module if module is not None else "",
                     module_call=call, input_dtypes=[i.dtype for i in ins],
                     input_shapes=[list(i.shape) for i in ins], parameter=parameter,
                     context=context(table, root), total_ops=table.total_ops,
                     inf_origin=op_ref(origin) if origin is not None else None,
                     recorded=len(table.ops), scope=scope, micro_batch=root.op.micro)
