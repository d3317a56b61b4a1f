"""Catch what a culprit started from, in one more narrow replay: the op's arguments (and the RNG
state and user source line at that moment), or the whole module call's inputs and state.

`InputCatcher` replays the step and, at the culprit (the same op, at the same occurrence among
calls of that op in its phase), clones the op's arguments, the RNG state (for dropout,
``rand_like``, ...) and the user source line: the innermost frame outside torch and nanbisect;
for a backward formula, the line in forward that created its autograd node (anomaly mode records
it during this pass only). Python stacks are taken here only, and only for the culprit op.
"""
from __future__ import annotations

import os
import re
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanbisect.bundle.state import local
from nanbisect.locate.ops import OpFinding
from nanbisect.replay.recorder import SKIP
from nanbisect.replay.replayer import Replayer, stacked


_TORCH_DIR = os.path.dirname(torch.__file__)


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nanbisect/


_FRAME = re.compile(r'File "(.+)", line (\d+)')


def _is_user(path: str) -> bool:
    path = os.path.abspath(path)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or path.startswith("<")
                or "/lib/python3" in path and "site-packages" not in path)


def _short(path: str, line: int) -> str:
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{line}"


def user_frame(frames: list[tuple[str, int]]) -> str | None:
    """'file:line' of the innermost frame outside torch, nanbisect and the standard library."""
    for path, line in reversed(frames):
        if _is_user(path):
            return _short(path, line)
    return None


@dataclass
class Caught:
    op: str = ""
    args: Any = None
    kwargs: Any = None
    mutated: list[int] = field(default_factory=list)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str | None = None


class InputCatcher(TorchDispatchMode):
    """Clone the arguments of the ``occurrence``-th call of ``op`` in ``phase``.

    NB: matched by op and occurrence within the phase, not by the step-wide op index: a wrapper
    with per-iteration state (DDP rebuilds its buckets on its second iteration) adds ops between
    replays, which shifts global indices but not the culprit's place among its own kind.
    """

    def __init__(self, op: str, phase: str, occurrence: int) -> None:
        super().__init__()
        self.op, self.target_phase, self.occurrence = op, phase, occurrence
        self.phase = "forward"
        self.seen = 0
        self.caught: Caught | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self.caught is None and self.phase == self.target_phase and func not in SKIP
                and str(func) == self.op):
            if self.seen == self.occurrence:
                self._catch(func, args, kwargs)
            self.seen += 1
        return func(*args, **kwargs)

    def _catch(self, func, args, kwargs) -> None:
        def clone(x):
            if isinstance(x, torch.Tensor):
                return local(x).detach().clone()   # a DTensor's shard: what the kernel ran on
            return None if isinstance(x, torch.Generator) else x

        c = Caught(op=str(func))
        c.args = torch.utils._pytree.tree_map(clone, list(args))
        c.kwargs = torch.utils._pytree.tree_map(clone, dict(kwargs))
        c.mutated = [i for i, a in enumerate(func._schema.arguments[:len(args)])
                     if a.alias_info is not None and a.alias_info.is_write]
        c.rng["rng/cpu"] = torch.get_rng_state()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
                mod = getattr(torch, t.device.type, None)
                if mod is not None and hasattr(mod, "get_rng_state"):
                    c.rng[f"rng/{t.device.type}"] = mod.get_rng_state(t.device)
                break
        stack = [(f.filename, f.lineno) for f in traceback.extract_stack()]
        c.source = user_frame(stack)
        node = torch._C._current_autograd_node()
        if node is not None and c.source is None:  # a backward formula: where forward made it
            tb = (node.metadata or {}).get("traceback_") or []
            frames = [(m.group(1), int(m.group(2))) for line in tb
                      for m in [_FRAME.search(line)] if m]
            c.source = user_frame(frames)
        self.caught = c


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
