"""Which module call is running: in forward from a hook-maintained stack, in backward exactly.

`ModuleTracker` is the one place that counts module calls: "the k-th call of module M in this
step" (`CallId`) is what it says, for every pass (the module probe, the op recorder, the scoped
recording start, the module-call catch all listen to it instead of counting for themselves).
During forward it keeps the stack of active calls (dotted name as in ``named_modules()`` plus the
call index within the step). For backward it does not trust a stack (NB:
`torch.utils.module_tracker` keeps stale entries in real models, e.g. GPT-2 dropout modules that
are never popped in backward). Instead, when a module call returns, every autograd node created
inside it, and not inside one of its children, is mapped to that call: the walk starts at the
call's outputs, walks through its children's nodes (a module that works on its input before
handing it to a child owns the nodes before the child's) and stops at the nodes of its inputs
and at nodes mapped to calls outside it. During backward,
`nanbisect.util.torch_internals.current_autograd_node` then names the node whose backward is
running, and the map names its module call. Hooks are always removed on exit.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from nanbisect.bundle.state import iter_tensors
from nanbisect.records import CallId
from nanbisect.util import torch_internals as ti

# enter(call, module, args, kwargs) -> None, or (args, kwargs) to hand the module instead
Enter = Callable[[CallId, torch.nn.Module, tuple, dict], "tuple[tuple, dict] | None"]
# exit(call, module, args, kwargs, output) -> None
Exit = Callable[[CallId, torch.nn.Module, tuple, dict, Any], None]


class ModuleTracker:
    """Track module calls of ``model``; optionally map autograd nodes to the calls that made them.

    ``listen(enter, exit)`` adds callbacks run at the start of every call (after the call is on
    the stack) and at its end (before it leaves the stack).

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    >>> with ModuleTracker(model, map_nodes=True) as t:
    ...     y = model(torch.ones(1, 2))
    >>> t.node_call(y.grad_fn), t.counts
    (CallId(module='1', call=0), {'': 1, '0': 1, '1': 1})
    """

    def __init__(self, model: torch.nn.Module, map_nodes: bool = False) -> None:
        self.names = {m: n for n, m in model.named_modules(remove_duplicate=True)}
        self.map_nodes = map_nodes
        self.stack: list[tuple[CallId, set]] = []
        self.counts: dict[str, int] = {}
        self.node_map: dict[object, CallId] = {}
        self.parents: dict[CallId, CallId | None] = {}
        self._enter: list[Enter] = []
        self._exit: list[Exit] = []
        self._handles: list = []

    def listen(self, enter: Enter | None = None, exit: Exit | None = None) -> "ModuleTracker":
        if enter is not None:
            self._enter.append(enter)
        if exit is not None:
            self._exit.append(exit)
        return self

    def __enter__(self) -> "ModuleTracker":
        for m, name in self.names.items():
            self._handles.append(m.register_forward_pre_hook(partial(self._pre, name),
                                                             with_kwargs=True))
            self._handles.append(m.register_forward_hook(partial(self._post, name),
                                                         with_kwargs=True, always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def current(self) -> CallId | None:
        return self.stack[-1][0] if self.stack else None

    def micro(self, call: CallId) -> int:
        """The micro-batch ``call`` ran in, in a pipeline stage's step: the call index of the
        outermost module call enclosing it (the stage's model runs once per micro-batch)."""
        while self.parents.get(call) is not None:
            call = self.parents[call]
        return call.call

    def node_call(self, node) -> CallId | None:
        return self.node_map.get(node) if node is not None else None

    def within(self, target: CallId, phase: str) -> bool:
        """Is the running op part of module call ``target`` (itself or a call nested in it)?"""
        if phase == "forward":
            return any(call == target for call, _ in self.stack)
        call = self.node_call(ti.current_autograd_node()) if phase == "backward" else None
        while call is not None:
            if call == target:
                return True
            call = self.parents.get(call)
        return False

    def _pre(self, name: str, module, args, kwargs):
        k = self.counts.get(name, 0)
        self.counts[name] = k + 1
        call = CallId(name, k)
        boundary = set()
        if self.map_nodes:
            boundary = {t.grad_fn for _, t in iter_tensors((args, kwargs)) if t.grad_fn is not None}
        self.parents[call] = self.current()
        self.stack.append((call, boundary))
        replaced = None
        for fn in self._enter:
            new = fn(call, module, args, kwargs)
            if new is not None:
                args, kwargs = replaced = new
        return replaced

    def _post(self, name: str, module, args, kwargs, output):
        call, boundary = self.stack[-1]
        try:
            for fn in self._exit:
                fn(call, module, args, kwargs, output)
        finally:
            self.stack.pop()
        if self.map_nodes:
            todo = [t.grad_fn for _, t in iter_tensors(output) if t.grad_fn is not None]
            seen: set = set()
            while todo:
                node = todo.pop()
                if node is None or node in boundary or node in seen:
                    continue
                seen.add(node)
                owner = self.node_map.get(node)
                if owner is None:
                    self.node_map[node] = call
                elif not self._inside(owner, call):
                    continue        # made before this call, elsewhere
                # a child call's nodes: walked through, to this call's own nodes before it
                todo.extend(n for n, _ in node.next_functions)
        return None

    def _inside(self, call: CallId | None, outer: CallId) -> bool:
        """Is ``call`` nested in ``outer`` (a call it made, or one of theirs)?"""
        call = self.parents.get(call) if call is not None else None
        while call is not None:
            if call == outer:
                return True
            call = self.parents.get(call)
        return False
