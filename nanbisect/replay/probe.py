"""Module-level probe: per-call statistics of inputs, outputs and gradients, kept on the device.

`ModuleProbe` listens to a `ModuleTracker` (which names each call) for one replayed step. For
each module *call* it records NaN/+inf/-inf counts and the largest finite magnitude of the call's
floating (real or complex) inputs and outputs (forward) and of the gradients flowing into and out
of the call (backward). Statistics stay on the device as small tensors and are read back once, by
`ModuleProbe.read`; `ProbeTable.in_order` gives the calls in forward or backward order.

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

from nanbisect import devices
from nanbisect.bundle.state import iter_tensors, local
from nanbisect.records import CallId, Stats
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import count, floating, nonfinite_masks, parts


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """(nan count, +inf count, -inf count, max |finite|, sum |finite|) as float32 on t's device.

    On the CPU the common case is cheap: a sum of magnitudes is finite exactly when every element
    is (a NaN or an inf makes it non-finite, and magnitudes cannot cancel), and reading a CPU
    scalar is no device synchronisation, so a finite tensor costs one abs, one sum and one amax
    instead of the three counting passes (about 10x less, see docs/BENCHMARKS.md). The sum can
    also overflow on finite values; that falls through to the exact path, which is always right.
    On accelerators everything stays on the device, with no host read.
    A complex tensor counts element by element (`nanbisect.util.tensors.nonfinite_masks`: NaN
    when a part is NaN) and measures its parts: max and sum of ``|re|`` and ``|im|``.
    """
    t = local(t).detach()
    if not t.numel():
        return torch.zeros(5, device=t.device)
    mags = parts(t).abs()
    if devices.on_host(t.device):
        total = mags.sum(dtype=torch.float32)
        if bool(torch.isfinite(total)):
            zero = total.new_zeros(())
            return torch.stack([zero, zero, zero, mags.amax().float(), total])
    finite_abs = mags.nan_to_num(0.0, 0.0, 0.0)
    # NB: not util.tensors.nonfinite: these counts stay on the device, stacked with the stats
    nan, pos, neg = nonfinite_masks(t)
    return torch.stack([count(nan).float(), count(pos).float(), count(neg).float(),
                        finite_abs.amax().float(), finite_abs.sum(dtype=torch.float32)])


def merge_stats(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not ts:
        return torch.zeros(5, device=device)
    s = torch.stack([x.to(device) for x in ts])  # (n, 5)
    return torch.cat([s[:, :3].sum(0), s[:, 3:4].amax(0), s[:, 4:].sum(0)])


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in iter_tensors(obj) if floating(t)]


@dataclass
class _Call:
    """One call while it is being recorded (the frozen `CallStats` is made by `read`)."""

    call: CallId
    parent: CallId | None
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    end: int = -1                    # position in completion (post-)order
    rows: dict[str, int] = field(default_factory=dict)    # "in"/"out" -> row in the stats table
    grad_rows: dict[str, list[int]] = field(default_factory=dict)  # "grad_in"/"grad_out" -> rows
    grad_events: dict[str, int] = field(default_factory=dict)  # side -> first firing order


class ModuleProbe:
    """Record per-call stats for every submodule of ``model`` while used as a context manager.

    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    >>> with ModuleProbe(model) as probe:
    ...     model(torch.ones(1, 2)).sum().backward()
    >>> [(c.call.module, c.output.nan) for c in probe.read().in_order("forward")]
    [('0', 0), ('1', 0), ('', 0)]
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tracker = ModuleTracker(model).listen(self._pre, self._post)
        self.param_names = {p: n for n, p in model.named_parameters()}
        self.calls: dict[CallId, _Call] = {}
        self.param_rows: list[tuple[str, int, int]] = []   # (param name, row, firing order)
        self._stats: list[torch.Tensor] = []
        self._ends = 0
        self._events = 0
        self._handles: list = []
        self._device = next(model.parameters(), torch.zeros(())).device

    # -- recording ------------------------------------------------------------------------
    def __enter__(self) -> "ModuleProbe":
        self.tracker.__enter__()
        for p in self.param_names:
            if p.requires_grad:
                self._handles.append(p.register_hook(partial(self._param_grad, p)))
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _row(self, stats: torch.Tensor) -> int:
        self._stats.append(stats)
        return len(self._stats) - 1

    def _pre(self, call: CallId, module, args, kwargs):
        ins = _floats((args, kwargs))
        c = _Call(call, self.tracker.parents[call],
                  [str(t.dtype).removeprefix("torch.") for t in ins], [list(t.shape) for t in ins])
        c.rows["in"] = self._row(merge_stats([tensor_stats(t) for t in ins], self._device))
        self.calls[call] = c
        if not torch.is_grad_enabled():
            return None
        swap = {}

        def view(t):
            if isinstance(t, torch.Tensor) and floating(t) and t.requires_grad:
                if id(t) not in swap:
                    v = t.view_as(t)
                    v.register_hook(partial(self._grad, call, "grad_in"))
                    swap[id(t)] = v
                return swap[id(t)]
            return t

        return ti.tree_map(view, (args, kwargs))

    def _post(self, call: CallId, module, args, kwargs, output):
        c = self.calls[call]
        c.end, self._ends = self._ends, self._ends + 1
        outs = _floats(output)
        c.rows["out"] = self._row(merge_stats([tensor_stats(t) for t in outs], self._device))
        if torch.is_grad_enabled():
            for t in outs:
                if t.requires_grad:
                    t.register_hook(partial(self._grad, call, "grad_out"))

    def _grad(self, call: CallId, side: str, grad: torch.Tensor):
        c = self.calls[call]
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
        rows = (torch.stack([s.to(self._device) for s in self._stats]).to(devices.HOST).tolist()
                if self._stats else [])

        def stat(i: int) -> Stats:
            n, pi, ni, a, s = rows[i]
            return Stats(int(n), int(pi), int(ni), float(a), float(s))

        def merged(idx: list[int] | None) -> Stats | None:
            if not idx:
                return None
            parts = [stat(i) for i in idx]
            return Stats(sum(p.nan for p in parts), sum(p.posinf for p in parts),
                         sum(p.neginf for p in parts), max(p.absmax for p in parts),
                         sum(p.abssum for p in parts))

        table = [CallStats(c.call, c.parent, c.input_dtypes, c.input_shapes, c.end,
                           c.grad_events.get("grad_in"), stat(c.rows["in"]),
                           stat(c.rows["out"]) if "out" in c.rows else None,
                           merged(c.grad_rows.get("grad_in")), merged(c.grad_rows.get("grad_out")))
                 for c in self.calls.values()]
        params = [ParamGrad(n, stat(r), order, n.rpartition(".")[0])
                  for n, r, order in self.param_rows]
        return ProbeTable(table, params)


def probing(probe: "ModuleProbe") -> Callable[[str], ContextManager]:
    """For `Replayer.run`'s ``phase``: the probe around forward and backward, nothing else."""
    return lambda name: probe if name in ("forward", "backward") else nullcontext()


@dataclass(frozen=True)
class CallStats:
    """One module call of the step and the statistics of its four sides."""

    call: CallId
    parent: CallId | None            # the enclosing call
    input_dtypes: list[str]
    input_shapes: list[list[int]]
    end: int                         # position in completion order (forward execution order)
    grad_in_order: int | None        # when its input gradient was computed (backward order)
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
    calls: list[CallStats]           # in start order
    params: list[ParamGrad]

    def get(self, call: CallId) -> CallStats | None:
        return next((c for c in self.calls if c.call == call), None)

    def ancestors(self, c: CallStats) -> list[CallStats]:
        """The calls enclosing ``c``, innermost first."""
        by_id = {x.call: x for x in self.calls}
        out, p = [], c.parent
        while p is not None:
            out.append(by_id[p])
            p = by_id[p].parent
        return out

    def in_order(self, phase: str) -> list[CallStats]:
        """The calls in the order ``phase`` finished them: forward by completion; backward by
        when each produced the gradient for its inputs (calls that produced none are left out);
        no module calls in other phases."""
        if phase == "forward":
            return sorted(self.calls, key=lambda c: c.end)
        if phase == "backward":
            return sorted((c for c in self.calls if c.grad_in_order is not None),
                          key=lambda c: c.grad_in_order)
        return []
