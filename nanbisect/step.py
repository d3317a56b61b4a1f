"""The training step a `Task` describes, written once: `Guard.step` runs it, and so does every
replay, so a replay computes what the guarded loop computed.

The order is the AMP recipe's: for each of the ``accumulate`` micro-batches, forward through
``loss_fn`` (under autocast when the Task says so) and backward of the loss divided by
``accumulate`` (scaled by the ``grad_scaler`` when there is one); then, as the optimizer phase,
``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step`` (which skips the update when the gradients
are not finite) and ``scaler.update``, or a plain ``optimizer.step()``. The step is a generator of
`Event`s, one after each micro-batch's forward and backward and one after the optimizer phase, so a
replay can look at the values in between and stop early; ``phase(name)`` wraps each phase's code
(probes, recorders). What it does not know: anything a custom loop does outside these fields (see
`Guard.watch`).

A pipeline stage's step (``Task(schedule=...)`` or ``Task(step_fn=...)``) runs its micro-batches'
forward and backward itself, inside the one "forward" phase context; `op_phase` then tells a
dispatch mode which of the two an op belongs to (the autograd engine runs backward), and the
events after it are one "forward" (its loss: the last stage's, else None) and one "backward".
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from nanbisect import devices
from nanbisect.errors import BadInput
from nanbisect.task import Task
from nanbisect.util import torch_internals as ti


_running = threading.local()      # .pipelined: a pipeline stage's step is running here;
                                  # .backward_began: an op of its backward ran


def op_phase(labelled: str, collective: bool = False, in_module: bool = True) -> str:
    """The phase of the op running now, given the phase the step's contexts say (``labelled``):
    the same, except inside a pipeline stage's step (or any ``step_fn``), where an op the
    autograd engine runs (a backward formula, a gradient hook's send) is "backward", and so is a
    ``collective`` (not a send or receive: what those carry is their own) issued outside any
    module call (``in_module`` False) once the step's backward began: a gradient reduction after
    it (megatron's ``finish_grad_sync``, an average over the stage's replicas).

    >>> op_phase("forward"), op_phase("optimizer")
    ('forward', 'optimizer')
    """
    if labelled != "forward" or not getattr(_running, "pipelined", False):
        return labelled
    if in_stage_backward():
        return "backward"
    if collective and not in_module and getattr(_running, "backward_began", False):
        return "backward"
    return labelled


def in_stage_backward() -> bool:
    """Inside a pipeline stage's step: is the autograd engine running now? Notes that the step's
    backward began (`backward_began`) when it is."""
    if getattr(_running, "pipelined", False) and ti.in_backward():
        _running.backward_began = True
        return True
    return False


def backward_began() -> bool:
    """Inside a pipeline stage's step: has an op of its backward run yet (as far as
    `in_stage_backward` was asked: every dispatch mode of nanbisect's asks, for every op)?"""
    return getattr(_running, "backward_began", False)


def pipelined_running() -> bool:
    """Is a pipeline stage's step running on this thread (its micro-batches are its module
    calls: `nanbisect.replay.tracker.ModuleTracker.micro`)?"""
    return getattr(_running, "pipelined", False)


@dataclass
class Event:
    """Where the step is: after ``phase`` ("forward", "backward", "optimizer") of ``micro``."""

    phase: str
    micro: int
    loss: torch.Tensor | None = None        # forward: this micro-batch's loss_fn output
    total: torch.Tensor | None = None       # the step's loss so far (unscaled, detached)
    grad_norm: torch.Tensor | None = None   # optimizer: total gradient norm before clipping
    skipped: torch.Tensor | None = None     # optimizer: the scaler found inf/NaN (1 = skipped)


def micro_batches(task: Task, batch: Any) -> list:
    """The step's micro-batches: ``[batch]``, or the items of ``batch``: ``accumulate`` of them,
    or fewer for an epoch's last, short window (each loss is still divided by ``accumulate``,
    as Lightning does; a trainer that divides by the window's length records that length)."""
    k = task.accumulate
    if k == 1:
        return [batch]
    if not isinstance(batch, (list, tuple)) or not 1 <= len(batch) <= k:
        what = f"a {type(batch).__name__}" + (f" of {len(batch)}" if hasattr(batch, "__len__")
                                              else "")
        raise BadInput(f"Task(accumulate={k}) needs each step's batch to be a list of {k} "
                       f"micro-batches, got {what}; pass [micro_batch_1, ..., micro_batch_{k}]")
    return list(batch)


def found_inf(scaler, optimizer) -> torch.Tensor:
    """The scaler's verdict on this step's gradients, on the device, without a host sync."""
    if not scaler.is_enabled():
        return torch.zeros(())
    per_device = ti.scaler_found_inf_per_device(scaler, optimizer)
    return torch.stack([v.reshape(()).float() for v in per_device.values()]).sum() \
        if per_device else torch.zeros(())


def add_loss(task: Task, total: torch.Tensor | None, loss: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what backward runs on, the step's loss so far): the micro-batch's loss divided by
    ``accumulate`` (unless ``loss_normalized``), summed detached over the micro-batches in order.
    Integrations that see the micro-batch losses of a trainer's step sum them here too, so the
    loss they record is the one a replay computes."""
    k = task.accumulate
    part = loss / k if k > 1 and not task.loss_normalized else loss
    return part, (part.detach() if total is None else total + part.detach())


def _autocast(task: Task) -> ContextManager:
    if task.autocast is None:
        return nullcontext()
    p = next(task.model.parameters(), None)
    device = p.device.type if p is not None else devices.HOST.type
    return torch.autocast(device, dtype=getattr(torch, task.autocast))


def run_step(task: Task, batch: Any,
             phase: Callable[[str], ContextManager] = lambda name: nullcontext(),
             before_update: Callable[[Any, Any, Any], bool] | None = None
             ) -> Iterator[Event]:
    """Run the step; yield after each micro-batch's forward and backward and after the
    optimizer. The caller zeroes gradients first (``optimizer.zero_grad``) and may stop early.
    ``before_update(total, grad_norm, skipped)`` is called after unscaling and clipping, just
    before the update (the Guard reads the step there): False leaves the update out (neither
    ``scaler.step`` nor ``scaler.update`` nor ``optimizer.step`` runs).

    >>> model = torch.nn.Linear(2, 1)
    >>> task = Task(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...             lambda m, b: m(b).pow(2).mean(), accumulate=2, clip_grad_norm=1.0)
    >>> [(e.phase, e.micro) for e in run_step(task, [torch.ones(3, 2), torch.zeros(3, 2)])]
    [('forward', 0), ('backward', 0), ('forward', 1), ('backward', 1), ('optimizer', 1)]
    """
    if task.pipelined:
        yield from _stage_step(task, batch, phase, before_update)
        return
    mbs = micro_batches(task, batch)
    scaler = task.grad_scaler
    total = None
    for i, mb in enumerate(mbs):
        with phase("forward"), _autocast(task):
            loss = task.loss_fn(task.step_model(), mb)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
            raise BadInput(f"loss_fn returned {type(loss).__name__}{shape}, not a scalar "
                           "tensor; return the loss")
        part, total = add_loss(task, total, loss)
        yield Event("forward", i, loss=loss, total=total)
        with phase("backward"):
            (scaler.scale(part) if scaler is not None else part).backward()
        yield Event("backward", i, total=total)
    yield from _update(task, total, len(mbs) - 1, phase, before_update)


def _stage_step(task: Task, batch: Any, phase: Callable[[str], ContextManager],
                before_update: Callable[[Any, Any, Any], bool] | None) -> Iterator[Event]:
    """A pipeline stage's step: its schedule (or step function) in one "forward" context, the
    ops the autograd engine runs told apart by `op_phase`; then the update."""
    was = getattr(_running, "pipelined", False)
    _running.pipelined, _running.backward_began = True, False
    try:
        with phase("forward"):
            loss = task.stage_step(task.step_model(), batch)
    finally:
        _running.pipelined = was
    if loss is not None and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
        raise BadInput(f"the stage's step returned {type(loss).__name__}, not a scalar tensor "
                       "or None; return the last stage's loss (None on the other stages)")
    total = loss.detach().reshape(()) if loss is not None else None
    yield Event("forward", 0, loss=loss, total=total)
    with phase("backward"):
        pass            # it ran inside the stage's step
    yield Event("backward", 0, total=total)
    yield from _update(task, total, 0, phase, before_update)


def _update(task: Task, total: torch.Tensor | None, micro: int,
            phase: Callable[[str], ContextManager],
            before_update: Callable[[Any, Any, Any], bool] | None) -> Iterator[Event]:
    """The optimizer phase: unscale, clip, the update (see `run_step`)."""
    scaler, opt = task.grad_scaler, task.optimizer
    if opt is None:
        return
    norm = skipped = None
    with phase("optimizer"):
        if scaler is not None:
            scaler.unscale_(opt)
        if task.clip_grad_norm is not None:   # as loops write it: all of the model's parameters
            norm = torch.nn.utils.clip_grad_norm_(task.model.parameters(), task.clip_grad_norm)
            if hasattr(norm, "full_tensor"):   # FSDP2: a DTensor; every rank runs this
                norm = norm.full_tensor()
        if scaler is not None:
            skipped = found_inf(scaler, opt)
        if before_update is not None and not before_update(total, norm, skipped):
            # the update is left out: the Guard stopped the step; an engine's optimizer
            # (``drop_update``) still runs its step, without the update, to stay consistent
            if callable(getattr(opt, "drop_update", None)):
                opt.drop_update()
                opt.step()
        elif scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    yield Event("optimizer", micro, total=total, grad_norm=norm, skipped=skipped)
