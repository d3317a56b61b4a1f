"""The pre-step snapshot a Guard takes so that a failing step can be bundled as it began.

Guarantees: `Snapshot.take` copies everything an optimizer step or a forward pass may change in
place (parameters, buffers, optimizer state and param-group settings, the GradScaler's scale and
growth tracker), on the tensors' own device; `restore` puts the copies back, and `swap` exchanges
them with the live state (twice: as it was). The copies are allocated once and reused while every
live tensor is the same object with the same shape, dtype and device (a parameter's ``.data``
replaced, a buffer or an optimizer state entry re-bound: new copies, as views of one flat buffer
per dtype and device); without a side stream a step's copies are one foreach call. Not
guaranteed: state outside the model, the optimizer and the scaler (a scheduler's, a data
loader's) is not copied.
"""
from __future__ import annotations

import operator

import torch

from nanbisect import devices
from nanbisect.bundle.state import hyper_parameters
from nanbisect.guard.screen import PLAIN_TENSORS, local_each
from nanbisect.util import torch_internals as ti
from nanbisect.util.torch_internals import foreach_copy_


def live_scale(scaler) -> torch.Tensor | None:
    """The scaler's scale tensor, on the device; None without an enabled scaler, or before its
    first step (it makes the tensor then, from its initial scale)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return ti.scaler_tensors(scaler)[0]


def model_tensors(model: torch.nn.Module) -> tuple[list, list]:
    """(``list(model.parameters())``, ``list(model.buffers())``) from one walk of the module
    tree: the same tensors in the same order (each once, where it is first met); a model that
    overrides how its tensors are listed is asked through its own methods."""
    if ti.lists_tensors_its_own_way(type(model)):
        return list(model.parameters()), list(model.buffers())
    params: list = []
    buffers: list = []
    seen_p: set = set()
    seen_b: set = set()
    seen_m: set = set()
    stack = [model]
    while stack:      # depth first, children in order: the order of model.modules()
        mod = stack.pop()
        if mod in seen_m:
            continue
        seen_m.add(mod)
        children, own_params, own_buffers = ti.module_dicts(mod)
        if children:
            stack.extend([m for m in reversed(children.values()) if m is not None])
        for p in own_params.values():
            if p is not None and id(p) not in seen_p:   # NB: a tensor's hash is a Python call
                seen_p.add(id(p))
                params.append(p)
        if own_buffers:
            for b in own_buffers.values():
                if b is not None and id(b) not in seen_b:
                    seen_b.add(id(b))
                    buffers.append(b)
    return params, buffers


_ALIGN = 16     # elements: each view of a flat buffer starts at a multiple (vector loads)


def _flat_like(live: list[torch.Tensor]) -> list[torch.Tensor]:
    """An empty copy of each tensor, contiguous, as views of one flat buffer per dtype and
    device (one destination for the snapshot's copies: cheaper to write than a buffer per
    tensor, docs/BENCHMARKS.md); a tensor of another layout gets its own ``empty_like``."""
    out: list = [None] * len(live)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(live):
        if t.layout != torch.strided or t.is_quantized:
            out[i] = torch.empty_like(t, requires_grad=False)
        else:
            groups.setdefault((t.dtype, t.device), []).append(i)
    for (dtype, device), idx in groups.items():
        starts, at = [], 0
        for i in idx:
            starts.append(at)
            at += -(-live[i].numel() // _ALIGN) * _ALIGN
        flat = torch.empty(at, dtype=dtype, device=device)
        for i, a in zip(idx, starts):
            out[i] = flat[a:a + live[i].numel()].view(live[i].shape)
    return out


class _Copies:
    """Copies of a list of live tensors, kept from one step to the next while they fit."""

    def __init__(self) -> None:
        self.live: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []
        self._meta: list[tuple] = []

    def bind(self, live: list[torch.Tensor], checked: int) -> bool:
        """Point at ``live``; True when that changed what is copied where. Every tensor is
        checked by identity, the first ``checked`` (parameters, buffers: their ``.data`` can be
        replaced in place) also by shape, dtype and device. The copies are kept while each still
        fits its live tensor; else all are made anew, as views of one flat buffer per dtype and
        device (`_flat_like`), the old ones freed first."""
        meta = [(t.shape, t.dtype, t.device) for t in live[:checked]]
        if len(live) == len(self.live) and all(map(operator.is_, live, self.live)) and \
                meta == self._meta:
            return False
        old = self.copies
        if len(old) != len(live) or not all(
                c.shape == t.shape and c.dtype == t.dtype and c.device == t.device
                for c, t in zip(old, live)):
            # NB: dropped before the new are made, so the state is never held twice here
            self.copies = old = []
            self.copies = _flat_like(live)
        self.live, self._meta = live, meta
        return True

    @torch.no_grad()
    def copy(self, idx: list[int] | None = None) -> None:
        src, dst = self.live, self.copies
        if idx is not None:
            src, dst = [src[i] for i in idx], [dst[i] for i in idx]
        if src:
            foreach_copy_(dst, src)

    @torch.no_grad()
    def put_back(self) -> None:
        for dst, src in zip(self.live, self.copies):
            dst.copy_(src)

    @torch.no_grad()
    def swap(self) -> None:
        for live, copy in zip(self.live, self.copies):
            tmp = live.clone()
            live.copy_(copy)
            copy.copy_(tmp)


class Snapshot:
    """Pre-step copies of everything an optimizer step or a forward pass may change in place.

    On an accelerator (CUDA, NPU) with an optimizer, the copies of parameters and optimizer
    state (only the optimizer step writes them) are made on a side stream, so they overlap the
    forward and backward passes; the optimizer's step waits for them (a step pre-hook makes the
    current stream wait on the copies' event), and so does every use of the copies (`wait`).
    Buffers (a forward pass may update them: BatchNorm's running statistics) and the
    GradScaler's scale are copied on the current stream before the step, as on the CPU.
    """

    def __init__(self, side_stream: bool = True) -> None:
        self._early = _Copies()    # buffers, the scaler's scale and growth tracker
        self._late = _Copies()     # parameters, optimizer state
        self._n_params = 0
        self._state_vals: list = []     # the optimizer's state values the last take saw
        self._opt_state: dict = {}
        self._groups: list[dict] = []
        self.scale: torch.Tensor | None = None    # the scaler's scale before the step
        self.side_stream = side_stream
        self._stream = None        # the side stream, made on first use
        self._done = None          # its event: reached when the side copies are complete
        self._hooked: tuple | None = None   # (optimizer, hook handle) that waits for them
        self._state: list[torch.Tensor] = []    # the tensors among ``_state_vals``, local
        self._state_plain = True                # ... all plain tensors (no DTensor)
        self._streams_of: tuple | None = None   # (device entry, device, has it streams)

    @property
    def _live(self) -> list[torch.Tensor]:
        """Every live tensor copied (scripts/bench_guard.py)."""
        return self._late.live + self._early.live

    def wait(self) -> None:
        """Make the current stream wait for the side copies (no-op without them)."""
        done, self._done = self._done, None
        if done is not None:
            devices.entry(self._stream.device).wait_event(self._stream.device, done)

    def take(self, model: torch.nn.Module, opt: torch.optim.Optimizer | None,
             scaler=None, params: list | None = None, buffers: list | None = None) -> None:
        """Copy the pre-step state (``params``, ``buffers``: the model's, when the caller has
        them: `model_tensors`). Without a side stream the copies are one foreach call into the
        copies kept from the last step while every live tensor is the same (`_Copies.bind`)."""
        self.wait()
        self.scale = None       # NB: no reference to old copies while binding (`_Copies.bind`)
        if params is None or buffers is None:
            params, buffers = model_tensors(model)
        ps = local_each(params)
        early = self._bind_early(opt, scaler, buffers)
        self._n_params = len(ps)
        dev = (ps or early or [torch.zeros(())])[0].device
        dt = devices.entry(dev)
        if self._streams_of is None or self._streams_of[0] is not dt or \
                self._streams_of[1] != dev:
            self._streams_of = (dt, dev, dt.has_streams())
        streams = self.side_stream and opt is not None and self._streams_of[2]
        self._bind_late(ps, opt)
        if not streams:
            dst = self._early.copies + self._late.copies
            if dst:
                with torch.no_grad():
                    foreach_copy_(dst, self._early.live + self._late.live)
            return
        late = self._late.live
        side = [i for i, t in enumerate(late) if t.device == dev]
        if self._stream is None or self._stream.device != dev:
            self._stream = dt.new_stream(dev)
        with torch.no_grad():
            self._done = dt.side_copy(self._stream, [self._late.copies[i] for i in side],
                                      [late[i] for i in side]) if side else None
        chosen = set(side)
        self._late.copy([i for i in range(len(late)) if i not in chosen])
        self._early.copy()
        if self._hooked is None or self._hooked[0] is not opt:
            if self._hooked is not None:
                self._hooked[1].remove()
            self._hooked = (opt, opt.register_step_pre_hook(lambda *_: self.wait()))

    @torch.no_grad()
    def take_early(self, opt: torch.optim.Optimizer | None, scaler, buffers: list) -> None:
        """Copy only what a forward pass or the scaler's update changes (buffers, the scaler's
        scale and growth tracker) and the optimizer's groups: the default Guard's per-step copy
        (the update is stopped before it runs, `nanbisect.guard.core`). Drops any parameter
        and optimizer-state copies a `take` made."""
        self.wait()
        self.scale = None
        if self._late.copies:
            self.release()
        if self._bind_early(opt, scaler, buffers):
            foreach_copy_(self._early.copies, self._early.live)

    def _bind_early(self, opt, scaler, buffers: list) -> list:
        """Point the early copies at the buffers and the scaler's scale and growth tracker (two
        1-element tensors), keep the scale before the step (None: the step is the scaler's
        first) and the optimizer's groups; the live tensors early copies are made of."""
        early = local_each(buffers)
        n_buf = len(early)
        scale = live_scale(scaler)
        if scale is not None:
            early += [scale, ti.scaler_tensors(scaler)[1]]
        self._early.bind(early, n_buf)
        self.scale = self._early.copies[-2] if scale is not None else None
        self._groups = hyper_parameters(opt)
        return early

    def early_copies(self, buffers: list) -> dict[int, torch.Tensor]:
        """id of each of ``buffers`` (the ones `take_early` copied, in its order) -> its copy."""
        return {id(b): c for b, c in zip(buffers, self._early.copies)}

    @torch.no_grad()
    def restore_early(self, opt: torch.optim.Optimizer | None) -> None:
        """Put back what `take_early` copied."""
        self._early.put_back()
        if opt is not None:
            for g, saved in zip(opt.param_groups, self._groups):
                g.update(saved)

    @torch.no_grad()
    def swap_early(self, opt: torch.optim.Optimizer | None) -> None:
        """Exchange the live buffers and scale with `take_early`'s copies (twice: as it was)."""
        self._early.swap()

    def release(self) -> None:
        """Drop the parameter and optimizer-state copies (`take` makes them again)."""
        self.wait()
        self._late = _Copies()
        self._state_vals, self._opt_state, self._state = [], {}, []

    def _bind_late(self, ps: list[torch.Tensor], opt: torch.optim.Optimizer | None) -> bool:
        """Point the late copies at the parameters and the optimizer's state tensors; True when
        what is copied where changed."""
        if opt is not None:
            vals = [v for st in opt.state.values() for v in st.values()]
            if len(vals) != len(self._state_vals) or \
                    not all(map(operator.is_, vals, self._state_vals)):
                # state made or re-bound since the last step (its entries are kept for restore)
                self._opt_state = {p: dict(st) for p, st in opt.state.items()}
                self._state_vals = vals
                self._state_plain = all(type(v) in PLAIN_TENSORS for v in vals
                                        if isinstance(v, torch.Tensor))
                self._state = local_each(v for v in vals if isinstance(v, torch.Tensor))
            elif not self._state_plain:
                # NB: a DTensor's local shard is a new tensor object each time it is asked for
                self._state = local_each(v for v in vals if isinstance(v, torch.Tensor))
        else:
            self._opt_state, self._state_vals, self._state = {}, [], []
        return self._late.bind(ps + self._state, len(ps))

    def moved(self) -> bool:
        """Does some parameter differ from its pre-step copy (exact)?"""
        self.wait()
        late = self._late
        return any(not torch.equal(p, c) for p, c in
                   zip(late.live[:self._n_params], late.copies[:self._n_params]))

    @torch.no_grad()
    def swap(self, opt: torch.optim.Optimizer | None) -> None:
        """Exchange the live state with the copies (twice: back as it was), one tensor's worth
        of extra memory at a time; the optimizer's state entries and groups too."""
        self.wait()
        self._early.swap()
        self._late.swap()
        if opt is None:
            return
        groups = hyper_parameters(opt)
        for g, saved in zip(opt.param_groups, self._groups):
            g.update(saved)
        self._groups = groups
        state = {p: dict(st) for p, st in opt.state.items()}
        for p in list(opt.state):
            if p not in self._opt_state:
                del opt.state[p]
        for p, st in self._opt_state.items():
            opt.state[p] = dict(st)
        self._opt_state = state
        self._state_vals = []     # the next take saves the entries again

    @torch.no_grad()
    def restore(self, opt: torch.optim.Optimizer | None) -> None:
        self.wait()
        self._early.put_back()
        self._late.put_back()
        if opt is not None:
            for p in list(opt.state):
                if p not in self._opt_state:
                    del opt.state[p]  # state created by the failing step itself
            for p, st in self._opt_state.items():
                opt.state[p] = dict(st)
            for g, saved in zip(opt.param_groups, self._groups):
                g.update(saved)
