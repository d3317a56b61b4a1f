"""Module-level probe: per-call statistics of inputs, outputs and gradients, kept on the device.

`ModuleProbe` hooks every submodule of a model for one replayed step. For each module *call* it
records NaN/+inf/-inf counts and the largest finite magnitude of the call's floating inputs and
outputs (forward) and of the gradients flowing into and out of the call (backward). Statistics stay
on the device as small tensors and are read back once, by `ModuleProbe.read`.

How backward is observed: a forward pre-hook hands the module an identity view of each floating
input that requires grad and hooks that view, so the hook sees exactly the gradient *this call*
produced for its input (not the sum over all consumers); a hook on each output sees the gradient
flowing into the call. Parameter gradients are observed by hooks on the parameters.
Not guaranteed: a module that stores its input and uses it outside the call mixes those uses into
its input gradient. Hooks are always removed on exit.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ContextManager

import torch

from nanbisect.bundle.state import iter_tensors, local

def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """(nan count, +inf count, -inf count, max |finite|, sum |finite|) as float32 on t's device.

    On the CPU the common case is cheap: a sum of magnitudes is finite exactly when every element
    is (a NaN or an inf makes it non-finite, and magnitudes cannot cancel), and reading a CPU
    scalar is no device synchronisation, so a finite tensor costs one abs, one sum and one amax
    instead of the three counting passes (about 10x less, see docs/BENCHMARKS.md). The sum can
    also overflow on finite values; that falls through to the exact path, which is always right.
    On accelerators everything stays on the device, with no host read.
    """
    t = local(t).detach()
    if not t.numel():
        return torch.zeros(5, device=t.device)
    mags = t.abs()
    if t.device.type == "cpu":
        total = mags.sum(dtype=torch.float32)
        if bool(torch.isfinite(total)):
            zero = total.new_zeros(())
            return torch.stack([zero, zero, zero, mags.amax().float(), total])
    finite_abs = mags.nan_to_num(0.0, 0.0, 0.0)
    return torch.stack([torch.isnan(t).sum().float(), torch.isposinf(t).sum().float(),
                        torch.isneginf(t).sum().float(), finite_abs.amax().float(),
                        finite_abs.sum(dtype=torch.float32)])


def merge_stats(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not ts:
        return torch.zeros(5, device=device)
    s = torch.stack([x.to(device) for x in ts])  # (n, 5)
    return torch.cat([s[:, :3].sum(0), s[:, 3:4].amax(0), s[:, 4:].sum(0)])


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(obj) if t.is_floating_point()]


@dataclass
class Call:
    """One call of one module during the replayed step (mutable only while recording)."""

    index: int                       # position in start order
    module: str                      # dotted name as in named_modules(); "" = the root
    call: int                        # which call of this module in the step, from 0
    parent: int | None               # index of the enclosing call
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    end: int = -1                    # position in completion (post-)order
    rows: dict[str, int] = field(default_factory=dict)    # "in"/"out" -> row in the stats table
    grad_rows: dict[str, list[int]] = field(default_factory=dict)  # "grad_in"/"grad_out" -> rows
    grad_events: dict[str, int] = field(default_factory=dict)  # side -> first firing order


@dataclass(frozen=True)
class Stats:
    nan: int
    posinf: int
    neginf: int
    absmax: float
    abssum: float = 0.0

    @property
    def inf(self) -> int:
        return self.posinf + self.neginf

    def bad(self, kind: str) -> bool:
        return self.nan > 0 if kind == "nan" else (self.nan + self.inf) > 0


class ModuleProbe:
    """Record per-call stats for every submodule of ``model`` while used as a context manager.

    >>> with ModuleProbe(model) as probe:
    ...     loss = loss_fn(model, batch); loss.backward()
    >>> table = probe.read()
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names = {m: n for n, m in model.named_modules(remove_duplicate=True)}
        self.param_names = {p: n for n, p in model.named_parameters()}
        self.calls: list[Call] = []
        self.param_rows: list[tuple[str, int, int]] = []   # (param name, row, firing order)
        self._stats: list[torch.Tensor] = []
        self._stack: list[int] = []
        self._counts: dict[str, int] = {}
        self._ends = 0
        self._events = 0
        self._handles: list = []
        self._device = next(model.parameters(), torch.zeros(())).device

    # -- recording ------------------------------------------------------------------------
    def __enter__(self) -> "ModuleProbe":
        for m, name in self.names.items():
            self._handles.append(m.register_forward_pre_hook(partial(self._pre, name),
                                                             with_kwargs=True))
            self._handles.append(m.register_forward_hook(partial(self._post, name),
                                                         with_kwargs=True, always_call=True))
        for p in self.param_names:
            if p.requires_grad:
                self._handles.append(p.register_hook(partial(self._param_grad, p)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _row(self, stats: torch.Tensor) -> int:
        self._stats.append(stats)
        return len(self._stats) - 1

    def _pre(self, name: str, module, args, kwargs):
        k = self._counts.get(name, 0)
        self._counts[name] = k + 1
        ins = _floats((args, kwargs))
        c = Call(len(self.calls), name, k, self._stack[-1] if self._stack else None,
                 [str(t.dtype).removeprefix("torch.") for t in ins], [list(t.shape) for t in ins])
        c.rows["in"] = self._row(merge_stats([tensor_stats(t) for t in ins], self._device))
        self.calls.append(c)
        self._stack.append(c.index)
        if not torch.is_grad_enabled():
            return None
        swap = {}

        def view(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                if id(t) not in swap:
                    v = t.view_as(t)
                    v.register_hook(partial(self._grad, c.index, "grad_in"))
                    swap[id(t)] = v
                return swap[id(t)]
            return t

        return torch.utils._pytree.tree_map(view, (args, kwargs))

    def _post(self, name: str, module, args, kwargs, output):
        index = self._stack.pop()
        c = self.calls[index]
        c.end, self._ends = self._ends, self._ends + 1
        outs = _floats(output)
        c.rows["out"] = self._row(merge_stats([tensor_stats(t) for t in outs], self._device))
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(partial(self._grad, index, "grad_out"))
        return None

    def _grad(self, index: int, side: str, grad: torch.Tensor):
        c = self.calls[index]
        c.grad_events.setdefault(side, self._events)
        self._events += 1
        c.grad_rows.setdefault(side, []).append(self._row(tensor_stats(grad)))
        return None

    def _param_grad(self, p: torch.Tensor, grad: torch.Tensor):
        self.param_rows.append((self.param_names[p], self._row(tensor_stats(grad)), self._events))
        self._events += 1
        return None

    # -- reading ---------------------------------------------------------------------------
    def read(self) -> "ProbeTable":
        """Bring every recorded statistic to the host with one transfer."""
        rows = (torch.stack([s.to(self._device) for s in self._stats]).cpu().tolist()
                if self._stats else [])

        def stat(i: int) -> Stats:
            n, pi, ni, a, s = rows[i]
            return Stats(int(n), int(pi), int(ni), float(a), float(s))

        def merged(idx: list[int]) -> Stats:
            parts = [stat(i) for i in idx]
            return Stats(sum(p.nan for p in parts), sum(p.posinf for p in parts),
                         sum(p.neginf for p in parts), max(p.absmax for p in parts),
                         sum(p.abssum for p in parts))

        table = []
        for c in self.calls:
            rec = {"in": stat(c.rows["in"]), "out": stat(c.rows["out"]) if "out" in c.rows else
                   None}
            for side in ("grad_in", "grad_out"):
                idx = c.grad_rows.get(side)
                rec[side] = merged(idx) if idx else None
            table.append(CallStats(c, rec["in"], rec["out"], rec["grad_in"], rec["grad_out"]))
        params = [ParamGrad(n, stat(r), order, n.rpartition(".")[0])
                  for n, r, order in self.param_rows]
        return ProbeTable(table, params)


def probing(probe: "ModuleProbe") -> Callable[[str], ContextManager]:
    """For `Replayer.run`'s ``phase``: the probe around forward and backward, nothing else."""
    return lambda name: probe if name in ("forward", "backward") else nullcontext()


@dataclass(frozen=True)
class CallStats:
    call: Call
    inputs: Stats
    output: Stats | None
    grad_in: Stats | None     # gradient this call produced for its inputs
    grad_out: Stats | None    # gradient that flowed into this call from its outputs


@dataclass(frozen=True)
class ParamGrad:
    name: str
    stats: Stats
    order: int
    module: str


@dataclass(frozen=True)
class ProbeTable:
    calls: list[CallStats]
    params: list[ParamGrad]
