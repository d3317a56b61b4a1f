"""The pre-step snapshot a Guard takes so that a failing step can be bundled as it began.

Guarantees: `_Snapshot.take` copies everything an optimizer step or a forward pass may change in
place (parameters, buffers, optimizer state and param-group settings, the GradScaler's scale and
growth tracker), on the tensors' own device; `restore` puts the copies back, and `swap`
exchanges them with the live state (twice: as it was). Not guaranteed: state outside the model,
the optimizer and the scaler (a scheduler's, a data loader's) is not copied.
"""
from __future__ import annotations

import torch

from nanbisect import devices
from nanbisect.bundle.state import local


def _live_scale(scaler) -> torch.Tensor | None:
    """The scaler's scale tensor, on the device; None without an enabled scaler, or before its
    first step (it makes the tensor then, from its initial scale)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return getattr(scaler, "_scale", None)     # NB: private, stable since torch 1.6


class _Snapshot:
    """Pre-step copies of everything an optimizer step or a forward pass may change in place.

    On an accelerator (CUDA, NPU) with an optimizer, the copies of parameters and optimizer
    state (only the optimizer step writes them) are made on a side stream, so they overlap the
    forward and backward passes; the optimizer's step waits for them (a step pre-hook makes the
    current stream wait on the copies' event), and so does every use of the copies (`wait`).
    Buffers (a forward pass may update them: BatchNorm's running statistics) and the
    GradScaler's scale are copied on the current stream before the step, as on the CPU.
    """

    def __init__(self, side_stream: bool = True) -> None:
        self._copies: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []
        self._opt_state: dict = {}
        self._groups: list[dict] = []
        self.scale: torch.Tensor | None = None    # the scaler's scale before the step
        self.side_stream = side_stream
        self._stream = None        # the side stream, made on first use
        self._done = None          # its event: reached when the side copies are complete
        self._hooked: tuple | None = None   # (optimizer, hook handle) that waits for them

    def wait(self) -> None:
        """Make the current stream wait for the side copies (no-op without them)."""
        done, self._done = self._done, None
        if done is not None:
            devices.entry(self._stream.device).wait_event(self._stream.device, done)

    def take(self, model: torch.nn.Module, opt: torch.optim.Optimizer | None,
             scaler=None) -> None:
        self.wait()
        params = [local(p.data) for p in model.parameters()]
        buffers = [local(b) for b in model.buffers()]
        state: list[torch.Tensor] = []
        self._opt_state = {}
        if opt is not None:
            for p, st in opt.state.items():
                self._opt_state[p] = {k: v for k, v in st.items()}
                state += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
            self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        live = params + buffers + state
        scale = _live_scale(scaler)
        if scale is not None:
            live += [scale, scaler._growth_tracker]   # two 1-element tensors
        if [t.shape for t in live] != [t.shape for t in self._copies] or any(
                a.dtype != b.dtype or a.device != b.device for a, b in zip(live, self._copies)):
            self._copies = [torch.empty_like(t) for t in live]
        self._live = live
        # the scale before the step; None: the step is the scaler's first
        self.scale = self._copies[-2] if scale is not None else None
        if not live:
            return
        dev = live[0].device
        dt = devices.entry(dev)
        streams = self.side_stream and opt is not None and dt.has_streams()
        side = list(range(len(params))) + [len(params) + len(buffers) + i
                                           for i in range(len(state))]
        side = [i for i in side if live[i].device == dev]
        if not streams or not side:
            torch._foreach_copy_(self._copies, live)
            return
        if self._stream is None or self._stream.device != dev:
            self._stream = dt.new_stream(dev)
        self._done = dt.side_copy(self._stream, [self._copies[i] for i in side],
                                  [live[i] for i in side])
        chosen = set(side)
        rest = [i for i in range(len(live)) if i not in chosen]
        if rest:
            torch._foreach_copy_([self._copies[i] for i in rest], [live[i] for i in rest])
        if self._hooked is None or self._hooked[0] is not opt:
            if self._hooked is not None:
                self._hooked[1].remove()
            self._hooked = (opt, opt.register_step_pre_hook(lambda *_: self.wait()))

    @torch.no_grad()
    def swap(self, opt: torch.optim.Optimizer | None) -> None:
        """Exchange the live state with the copies (twice: back as it was), one tensor's worth
        of extra memory at a time; the optimizer's state entries and groups too."""
        self.wait()
        for live, copy in zip(self._live, self._copies):
            tmp = live.clone()
            live.copy_(copy)
            copy.copy_(tmp)
        if opt is None:
            return
        state = {p: dict(st) for p, st in opt.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        for p in list(opt.state):
            if p not in self._opt_state:
                del opt.state[p]
        for p, st in self._opt_state.items():
            opt.state[p] = dict(st)
        for g, saved in zip(opt.param_groups, self._groups):
            g.update(saved)
        self._opt_state, self._groups = state, groups

    @torch.no_grad()
    def restore(self, opt: torch.optim.Optimizer | None) -> None:
        self.wait()
        for dst, src in zip(self._live, self._copies):
            dst.copy_(src)
        if opt is not None:
            for p in list(opt.state):
                if p not in self._opt_state:
                    del opt.state[p]  # state created by the failing step itself
            for p, st in self._opt_state.items():
                opt.state[p] = dict(st)
            for g, saved in zip(opt.param_groups, self._groups):
                g.update(saved)

