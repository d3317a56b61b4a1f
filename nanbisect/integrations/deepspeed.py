"""DeepSpeed under the Guard: `deepspeed_task`, a Task over a DeepSpeed engine whose step is the
engine's (``engine.backward``: the loss scaled as DeepSpeed scales it and the gradients reduced
across the data-parallel ranks, bucketed and partitioned by ZeRO; ``engine.step``: the update),
so that a replay runs DeepSpeed's own gradient reduction, and `init_distributed`, DeepSpeed's
process group start with what a CPU rank needs.

The Task's optimizer is an `EngineOptimizer`: torch's optimizer interface over the engine's.
ZeRO (stages 1 and 2; DeepSpeed's bf16 optimizer) keeps the training's state in a torch
optimizer of its own (``engine.optimizer.optimizer``) whose parameters are this rank's flat
fp32 partitions of the weights (the master copy), not the model's parameters; its
``state_dict()`` is DeepSpeed's checkpoint format (every rank's partition, a loss scaler
object). The `EngineOptimizer`'s ``state_dict()`` is torch's format over that inner optimizer:
its state by index (Adam's moments and step) with, for each partition that is not a model
parameter, the partition itself under ``"master"``, and the loss scaler's numbers under
``"extra"``; ``load_state_dict`` puts each back where it was (the partitions written in
place). A bundle therefore holds this rank's ZeRO state exactly, and a replay restores it
bit for bit (the model's weights come from the bundle's model section, as always).

What the core asks of it: ``zero_grad(set_to_none=...)`` calls the engine's ``zero_grad`` as it
accepts; ``step()`` is ``engine.step()``; a step pre-hook (the Guard's reading in
`Guard.watch`) runs when the loop calls ``engine.step()`` itself, before ZeRO's update; and
``drop_update()`` leaves the next update out the way torch optimizers are left out (the inner
optimizer's partitions get no gradient: no moment, step count or weight changes), while
DeepSpeed's step still runs to its end (its buffers cleared, its counters advanced), so the
engine stays consistent.

Not supported here (said, never silent): ZeRO stage 3 (its parameters hold no data outside
forward, and its optimizer's state belongs to partitions it puts in its groups only while it
steps), ZeRO-Offload's CPU Adam (its own kernel; the inner
optimizer is not a torch one when it is a ``DeepSpeedCPUAdam``, refused) and an engine without
an optimizer. Gradient accumulation inside the engine (``gradient_accumulation_steps`` > 1):
each step's batch is then the list of its micro-batches, each run through ``engine.backward``
and ``engine.step`` as DeepSpeed's loop does (the update at the last).

DeepSpeed itself is imported only by the functions that need it; the core never imports it.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from nanbisect.errors import BadInput

# the numbers of DeepSpeed's loss scaler (static or dynamic) a step changes
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def init_distributed(dist_backend: str = "gloo", **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` as a CPU rank needs it: DeepSpeed's shared-memory
    all-reduce (a C++ op its CPU accelerator compiles when it starts: about 130 s, under a file
    lock a killed build leaves stale) is marked unavailable first, so that the reduction is the
    backend's own (gloo). An accelerator's backend (NCCL) never uses that op: there it only
    starts the process group. Call it in the entry before ``deepspeed.initialize``, also when
    torch.distributed is initialized already (a replay's ranks are): DeepSpeed then takes that
    group, and its own start inside ``initialize`` would build the op."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist_backend, **kwargs)


class EngineOptimizer(torch.optim.Optimizer):
    """torch's optimizer interface over a DeepSpeed engine's optimizer (see the module doc).

    ``param_groups`` and ``state`` are the inner torch optimizer's own (a learning rate set here
    is the one DeepSpeed's update uses)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        outer = engine.optimizer
        if outer is None:
            raise BadInput("deepspeed_task: the engine has no optimizer; give "
                           "deepspeed.initialize an optimizer (or a config 'optimizer' section)")
        inner = outer if isinstance(outer, torch.optim.Optimizer) else getattr(
            outer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or type(inner).__module__.startswith(
                "deepspeed.ops"):
            raise BadInput(f"deepspeed_task: the engine's optimizer {type(outer).__name__} "
                           f"updates through {type(inner).__name__}, not a torch optimizer "
                           "nanbisect can save and restore; use a torch optimizer (e.g. "
                           "'torch_adam': true in the config's optimizer params), without "
                           "ZeRO-Offload")
        self.outer = None if outer is inner else outer      # ZeRO's (or bf16's) wrapper
        self.inner = inner
        torch.optim.Optimizer.__init__(self, [dict(g) for g in inner.param_groups],
                                       dict(inner.defaults))
        self.param_groups, self.state = inner.param_groups, inner.state
        self._drop = False          # the next update is left out (`drop_update`)
        # the step pre-hooks registered here, by handle id (an OrderedDict: a handle holds a
        # weak reference to it)
        self._engine_hooks: OrderedDict = OrderedDict()
        inner.register_step_pre_hook(self._before_inner)
        if self.outer is not None:
            self._wrap_outer_step()
        # what `zero_grad` calls, and whether it takes ``set_to_none`` (read once, not per step)
        self._zero = self.outer if self.outer is not None and callable(
            getattr(self.outer, "zero_grad", None)) else engine
        try:
            self._zero_takes = "set_to_none" in inspect.signature(
                self._zero.zero_grad).parameters
        except (TypeError, ValueError):
            self._zero_takes = False

    # -- what the core calls -----------------------------------------------------------------
    def step(self, closure: Callable | None = None) -> None:     # noqa: ARG002 - torch's API
        """``engine.step()``: DeepSpeed's update (ZeRO's clipping, overflow check, the inner
        optimizer's step, the weights gathered back), its scheduler and counters."""
        self.engine.step()

    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(this optimizer, args, kwargs)`` before each update of the engine, however
        the loop steps it (``engine.step()`` or this optimizer's `step`): before ZeRO's step
        (its overflow check included), else before the inner optimizer's."""
        handle = RemovableHandle(self._engine_hooks)
        self._engine_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's optimizer's ``zero_grad`` (ZeRO's clears its gradient accumulators
        too), with ``set_to_none`` where it takes it, else the engine's own."""
        if self._zero_takes:
            self._zero.zero_grad(set_to_none=set_to_none)
        else:
            self._zero.zero_grad()
        if self._zero is not self.engine:
            self.engine.zero_grad()      # the module's .grad (DeepSpeed's own zero_grad)

    def drop_update(self) -> None:
        """Leave the next update out (the Guard found the step failed): the inner optimizer's
        partitions get no gradient when it steps, so it changes nothing; DeepSpeed's step
        still runs to its end."""
        self._drop = True

    def state_dict(self) -> dict:
        """torch's format over the inner optimizer, with each partition that is not a model
        parameter under its index's ``"master"`` and the loss scaler's numbers in
        ``"extra"``."""
        sd = self.inner.state_dict()
        state = {i: dict(st) for i, st in sd["state"].items()}
        model = {id(p) for p in self.engine.module.parameters()}
        for i, p in enumerate(self._params()):
            if id(p) not in model:
                state.setdefault(i, {})["master"] = p.detach()
        scaler = getattr(self.outer, "loss_scaler", None)
        extra = {"loss_scaler": {k: getattr(scaler, k) for k in _SCALER_FIELDS
                                 if isinstance(getattr(scaler, k, None), (int, float))}} \
            if scaler is not None else {}
        return {"state": state, "param_groups": sd["param_groups"], "extra": extra}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Put back what `state_dict` gave: the partitions in place, the inner optimizer's
        state, the loss scaler's numbers."""
        params = self._params()
        state = {}
        for i, st in state_dict["state"].items():
            st = dict(st)
            master = st.pop("master", None)
            if master is not None:
                p = params[int(i)]
                if tuple(master.shape) != tuple(p.shape):
                    raise ValueError(f"partition {i} has shape {tuple(p.shape)} here, "
                                     f"{tuple(master.shape)} in the state")
                p.copy_(master)
            if st:
                state[i] = st
        self.inner.load_state_dict({"state": state,
                                    "param_groups": state_dict["param_groups"]})
        # NB: load_state_dict rebuilds the groups' dicts: they must stay the inner optimizer's
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        scaler = getattr(self.outer, "loss_scaler", None)
        for k, v in ((state_dict.get("extra") or {}).get("loss_scaler") or {}).items():
            if k in _SCALER_FIELDS and scaler is not None:
                setattr(scaler, k, v)

    # -- inside ------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.inner.param_groups for p in g["params"]]

    def _run_hooks(self) -> None:
        for hook in list(self._engine_hooks.values()):
            hook(self, (), {})

    def _before_inner(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The inner optimizer's step pre-hook: the hooks registered here when there is no
        ZeRO wrapper to run them; then, after `drop_update`, the partitions lose their
        gradients (a torch optimizer skips a parameter without one)."""
        if self.outer is None:
            self._run_hooks()
        if self._drop:
            self._drop = False
            for p in self._params():
                p.grad = None

    def _wrap_outer_step(self) -> None:
        """ZeRO's ``step`` (what ``engine.step()`` calls) runs the step pre-hooks registered
        here first, so the Guard reads a watched step before ZeRO's update; a step that ends
        without the inner optimizer stepping (ZeRO's overflow skip) forgets a
        `drop_update`."""
        outer = self.outer
        original = outer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._run_hooks()
            try:
                return original(*args, **kwargs)
            finally:
                self._drop = False

        outer.step = step


def deepspeed_task(engine: Any, loss_fn: Callable[[Any, Any], torch.Tensor]):
    """A `nanbisect.Task` over a DeepSpeed engine (see the module doc): ``loss_fn(engine,
    batch)`` returns the loss of one micro-batch (called with the engine, as the loop calls it);
    the step is ``engine.backward(loss)`` for each micro-batch and ``engine.step()``. The Task's
    model is the engine's module (the names a report gives are the user's), its optimizer an
    `EngineOptimizer` (one per engine, kept on it)."""
    from nanbisect.task import Task

    stage = int(engine.zero_optimization_stage()) if callable(
        getattr(engine, "zero_optimization_stage", None)) else 0
    if stage >= 3:
        raise BadInput("deepspeed_task: ZeRO stage 3 is not supported: its parameters hold no "
                       "data outside forward (each rank keeps a partition) and its optimizer's "
                       "state belongs to partitions it puts in its groups only while it steps; "
                       "guard the job at stage 1 or 2 (the same model and data reproduce it)")
    opt = getattr(engine, "_nanbisect_optimizer", None)
    if opt is None:
        opt = EngineOptimizer(engine)
        engine._nanbisect_optimizer = opt
    k = int(engine.gradient_accumulation_steps())

    def step(module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Each micro-batch's forward (through the engine) and ``engine.backward``; the
        engine's own steps between them (no update before the boundary); the last micro-batch's
        ``engine.step()`` is the Task's optimizer phase. The loss: the micro-batches' mean."""
        mbs = [batch] if k == 1 else list(batch) if isinstance(batch, (list, tuple)) and \
            len(batch) == k else None
        if mbs is None:
            raise BadInput(f"the engine accumulates {k} micro-batches per step: give each "
                           f"step's batch as a list of {k}")
        total = None
        for j, mb in enumerate(mbs):
            loss = loss_fn(engine, mb)
            engine.backward(loss)
            if j < k - 1:
                engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        return total / k

    return Task(model=engine.module, optimizer=opt, step_fn=step)
