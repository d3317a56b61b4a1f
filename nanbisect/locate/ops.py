"""The op recording pass: record the failing phase's ops and trace the failure to its root op.

Guarantees: op recording runs only over the failing phase (forward until the loss; backward; the
optimizer step), with flags on the device read back once, except for a backward failure that
points to forward (then one more replay records both); no Python stack is taken here (only in
`locate.catch`, for the culprit op). The trace starts from what actually failed (the loss, the
non-finite gradients, the non-finite parameters), so NaN that was masked or zeroed on the way
is never blamed.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, ContextManager

from nanbisect.locate.catch import AheadCatch
from nanbisect.locate.provenance import (Root, context, culprit_root, forward_inf_origin,
                                         forward_op_of, hidden_by, inf_origin, op_ref,
                                         points_to_forward, reaches_outside, surfaced_at)
from nanbisect.records import CallId, Node, OpFinding, OpSite
from nanbisect.replay.recorder import OpRecorder, OpTable
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.replay.tracker import ModuleTracker


def record_ops(rep: Replayer, phase: str, kind: str,
               wrap: Callable[[], ContextManager] = nullcontext,
               scope: CallId | None = None, *, cross_phase: bool = True,
               progress: Callable[[str, str], None] | None = None,
               ahead: AheadCatch | None = None) -> OpFinding | None:
    """Second pass: record the ops of ``phase`` and trace the failure back to its root op.

    With ``scope`` (the forward module call that the first pass found producing the failure from
    clean inputs) recording starts when that call starts: the ops before it are not recorded,
    their values enter as outside values with their flags. A root found that way is sound (an op
    on the failure's path with clean inputs and a bad output). When the trace runs into a bad
    outside value instead (the failure came from before the call), finds no root, or the root
    consumed an inf born before the call (``inf_origin`` needs those ops), the whole phase is
    recorded: one more replay. NB: multi-rank replays pass no scope, so that every rank runs the
    same passes.

    A backward failure that points to forward (`provenance.points_to_forward`: a bad value that
    came from outside the backward ops, an inf from there, or a built-in backward formula that
    made it from finite values) is recorded once more with forward and backward together (with
    ``cross_phase``; announced to ``progress`` as "cross-phase"): the culprit is then where the
    value was born, and ``surfaced`` where it became visible. Other runs pay nothing for it.
    NB: multi-rank replays pass ``cross_phase=False`` (every rank must run the same passes).

    With ``ahead`` (forward or backward, CPU) every recording replay also catches the inputs of
    every root candidate (`AheadCatch`): ``ahead.caught`` then has the root's when the replay
    that found it offered it (the last replay: a cross-phase one records and offers forward's
    ops too).
    """
    if phase == "optimizer":
        ahead = None
    if scope is not None and phase == "forward":
        found = _finding(rep, _record(rep, phase, wrap, scope, kind=kind, ahead=ahead), phase,
                         kind, scope)
        if found is not None:
            return found
    recorded = _record(rep, phase, wrap, None, kind=kind, ahead=ahead)
    if phase == "backward" and cross_phase:
        table, starts, _ = recorded
        if points_to_forward(table, list(starts.values()), _root(table, starts, phase, kind),
                             kind):
            if progress is not None:
                progress("cross-phase", "the backward failure points to forward: recording "
                                        "forward and backward together")
            found = _cross_phase(rep, kind, wrap, _finding(rep, recorded, phase, kind, None),
                                 ahead)
            if found is not None:
                return found
    return _finding(rep, recorded, phase, kind, None)


_Recorded = tuple[OpTable, dict[str, tuple[int, int]], list[str]]


def _record(rep: Replayer, phase: str, wrap, scope: CallId | None,
            phases: set[str] | None = None, *, kind: str = "nan",
            ahead: AheadCatch | None = None) -> _Recorded:
    """Replay with the op recorder over ``phases`` (default: ``phase``) up to the end of
    ``phase``; return the table, the failed values to start from (the loss, the gradients, the
    updated parameters) by name, and the parameters' names in model order. With ``ahead``, its
    catches ride along (the recorder offers it the root candidates of ``kind``)."""
    model = rep.task.model
    both = phases is not None and len(phases) > 1
    tracker = ModuleTracker(model, map_nodes=(phase == "backward"))
    started = [scope is None]
    if scope is not None:
        def start(call, *_):
            if call == scope:
                started[0] = True
        tracker.listen(enter=start)
    rec = OpRecorder(tracker, phases=phases or {phase},
                     scope=None if scope is None else lambda: started[0], nodes=both,
                     born=ahead.on_born if ahead is not None else None, kind=kind)
    if ahead is None:
        out = rep.run(phase=rec.follow, wrap=lambda: stacked(wrap(), tracker, rec),
                      stop_after=phase)
    else:
        def follow(name: str):
            rec.follow(name)
            return ahead.phase(name)
        # the row tracer above the recorder: it sees every op, not the recorder's own
        riders = ahead.riders
        rep.batch_edits.append(ahead.start)
        try:
            out = rep.run(phase=follow, wrap=lambda: stacked(wrap(), tracker, rec, *riders),
                          stop_after=phase)
        finally:
            rep.batch_edits.remove(ahead.start)
    names = list(model.named_parameters())
    if phase == "forward" and out.loss_tensor is not None:
        rec.mark("loss", out.loss_tensor)
    if phase == "forward":     # a buffer the forward made non-finite (a moving average's 0/0)
        buffers = dict(model.named_buffers())
        for b in out.bad:
            if b.where == "buffer" and b.name in buffers:
                rec.mark(f"buffer:{b.name}", buffers[b.name])
    elif phase == "backward":
        for n, p in names:
            if p.grad is not None:
                rec.mark(n, p.grad)
    elif phase == "optimizer":
        for n, p in names:
            rec.mark(n, p)
    table, marks = rec.read()
    return table, {n: m for n, m in marks.items() if m is not None}, [n for n, _ in names]


def _root(table: OpTable, starts: dict[str, tuple[int, int]], phase: str, kind: str
          ) -> Root | None:
    root = culprit_root(table, list(starts.values()), kind)
    if root is None and phase == "backward":
        # the failed gradients were written outside the recorded ops (e.g. by DDP's reducer
        # after its collective): start from the values that left the recorded backward instead
        root = culprit_root(table, [(p, j) for p, j in table.leaves()
                                    if table.ops[p].phase == "backward"], kind)
    return root


def _finding(rep: Replayer, recorded: _Recorded, phase: str, kind: str,
             scope: CallId | None) -> OpFinding | None:
    table, starts, names = recorded
    root = _root(table, starts, phase, kind)
    if root is None:
        return None
    if scope and reaches_outside(table, list(starts.values()), kind):
        return None         # part of the failure comes from before the recorded window
    parameter = None
    if phase == "optimizer":
        for n in names:     # the first parameter (model order) whose failure leads to the root
            if n in starts:
                r = culprit_root(table, [starts[n]], kind)
                if r is not None and r.op.pos == root.op.pos:
                    parameter = n
                    break
    elif phase == "backward":   # the root op wrote a parameter's gradient itself
        parameter = next((n for n in names if starts.get(n) == (root.op.pos, root.output)),
                         None)
    ins = root.op.inputs_for(root.op.outputs[root.output])
    origin = inf_origin(table, root)
    if scope and origin is None and any(i.flags.inf for i in ins):
        return None         # the inf came from before the call: record the whole phase
    return _make(table, root, phase, parameter, origin, scope)


def _make(table: OpTable, root: Root, phase: str, parameter: str | None,
          origin: Root | None, scope: CallId | None, **more) -> OpFinding:
    module, call = root.op.module, root.op.module_call
    if phase == "optimizer":
        module, call = (parameter or "").rpartition(".")[0], None
    ins = root.op.inputs_for(root.op.outputs[root.output])
    return OpFinding(site=OpSite(root.op.op, root.op.phase, root.op.occurrence),
                     op_index=root.op.index, module=module if module is not None else "",
                     module_call=call, input_dtypes=[i.dtype for i in ins],
                     input_shapes=[list(i.shape) for i in ins], parameter=parameter,
                     context=context(table, root), total_ops=table.total_ops,
                     inf_origin=op_ref(origin) if origin is not None else None,
                     origin_site=_site(origin), node=_node(table, root),
                     recorded=len(table.ops), scope=scope, micro_batch=root.op.micro, **more)


def _node(table: OpTable, root: Root) -> Node | None:
    """A backward root's autograd node as recorded: its name, and the forward op that made it
    when forward was recorded in the same table."""
    if root.op.phase != "backward" or root.op.node_name is None:
        return None
    fwd = forward_op_of(table, root.op)
    return Node(root.op.node_name, fwd.op if fwd is not None else None)


def _site(root: Root | None) -> OpSite | None:
    return OpSite(root.op.op, root.op.phase, root.op.occurrence) if root is not None else None


def _cross_phase(rep: Replayer, kind: str, wrap, alone: OpFinding | None,
                 ahead: AheadCatch | None = None) -> OpFinding | None:
    """Record forward and backward in one replay and trace the backward failure across them.

    A root in forward (a NaN saved for backward: ``sqrt`` behind a ``where``, a custom
    Function's saved tensor, a fused op's secondary output) is the culprit, surfaced at the
    first backward op that read it. Else the backward root stands (``alone``, the backward-only
    finding), with the ``inf_origin`` that only forward could tell: the inf its inputs carried,
    or the infinity of the forward op its formula differentiates (``log(0)``, a ``-inf`` mask:
    the rule of birth makes an infinity the start of a NaN's chain, never its culprit). None
    when the combined replay finds no root."""
    recorded = _record(rep, "backward", wrap, None, phases={"forward", "backward"}, kind=kind,
                       ahead=ahead)
    table, starts, names = recorded
    root = _root(table, starts, "backward", kind)
    if root is None:
        return None
    surfaced: Root | None = None
    if root.op.phase == "forward":
        surfaced = surfaced_at(table, list(starts.values()), kind, root)
        if surfaced is None:    # not reached through a backward op: nothing to say it surfaced
            return alone
    phases = ("forward", "backward")
    if surfaced is None:
        origin = inf_origin(table, root) or forward_inf_origin(table, root)
        if alone is not None and alone.op_index == root.op.index:
            return replace(alone, inf_origin=op_ref(origin) if origin is not None
                           else alone.inf_origin,
                           origin_site=_site(origin) if origin is not None
                           else alone.origin_site, node=_node(table, root) or alone.node)
        return _make(table, root, "backward", None, origin, None, phases=phases)
    origin = inf_origin(table, root) or inf_origin(table, surfaced)
    out = root.op.outputs[root.output]
    s_out = surfaced.op.outputs[surfaced.output]
    # the surfaced op alone shows the failure only when its inputs are free of it (log's
    # backward divides 0 by 0; sqrt's multiplies a NaN it was handed)
    shows = not any(i.flags.bad(kind) for i in surfaced.op.inputs_for(s_out))
    return _make(table, root, "backward", None, origin, None, phases=phases,
                 surfaced=op_ref(surfaced), born="nan" if out.flags.nan else "inf",
                 hidden=hidden_by(table, root),
                 surfaced_site=(OpSite(surfaced.op.op, surfaced.op.phase, surfaced.op.occurrence)
                                if shows else None))
