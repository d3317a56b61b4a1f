"""Rebuild a bundle's step on a device and run it, as often as the bisection needs.

Guarantees: every `Replayer.run` starts from the bundle's pre-step state (parameters, buffers,
optimizer state, RNG), so on the capture device with the same versions the loss equals the
original bit for bit, dropout and other random ops included. A run stops at the first phase whose
values are non-finite and says which phase that was. Not guaranteed: bit-exactness across devices,
thread counts or library versions (that is what the reference comparison is for).
"""
from __future__ import annotations

import math
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from nanbisect.bundle.format import Bundle
from nanbisect.errors import BadInput
from nanbisect.records import BadValue, StepOutcome
from nanbisect.bundle.state import RngState, decode, iter_tensors, local, restore_model, restore_optimizer
from nanbisect.task import Task, load_task

PHASES = ("input", "forward", "backward", "optimizer")


def parse_device(spec: str) -> tuple[torch.device, torch.dtype | None]:
    """``"cuda:1"`` -> (device, None); ``"cpu:float64"`` -> (cpu, torch.float64).

    >>> parse_device("cpu:float64")
    (device(type='cpu'), torch.float64)
    """
    dev, _, dtype_name = spec.partition(":")
    dtype = None
    if dtype_name and not dtype_name.isdigit():
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise BadInput(f"device '{spec}': '{dtype_name}' is not a floating dtype; use e.g. "
                           "cpu:float64")
    else:
        dev = spec
    try:
        device = torch.device(dev)
    except RuntimeError:
        raise BadInput(f"device '{spec}' is not a torch device string; use e.g. cpu, cuda, "
                       "cuda:1") from None
    if device.type == "npu":
        try:  # registers torch.npu
            import torch_npu  # noqa: F401
        except ImportError:
            pass
    if device.type != "cpu":
        mod = getattr(torch, device.type, None)
        ok = mod is not None and hasattr(mod, "is_available") and mod.is_available()
        if ok and device.index is not None and hasattr(mod, "device_count"):
            ok = device.index < mod.device_count()
        if not ok:
            raise BadInput(f"device '{spec}' is not available on this machine; pass --target/"
                           "--reference with a device it has (cpu always works)")
    return device, dtype


def nonfinite(t: torch.Tensor) -> tuple[int, int, int]:
    """(nan, +inf, -inf) counts, read back to the host."""
    if not t.is_floating_point() and not t.is_complex():
        return 0, 0, 0
    s = torch.stack([torch.isnan(t).sum(), torch.isposinf(t).sum(), torch.isneginf(t).sum()])
    n, p, m = s.tolist()
    return int(n), int(p), int(m)


def _scan(where: str, named) -> list[BadValue]:
    out = []
    for name, t in named:
        if isinstance(t, torch.Tensor):
            n, p, m = nonfinite(local(t).detach())
            if n or p or m:
                out.append(BadValue(where, name, n, p, m))
    return out


class Replayer:
    """A bundle's task, built once and restored to the pre-step state before each run.

    >>> from nanbisect.bundle.format import read_bundle
    >>> r = Replayer(read_bundle("fixtures/bundles/healthy"), torch.device("cpu"))
    >>> r.run().loss == r.run().loss     # each run from the same pre-step state and RNG
    True
    """

    def __init__(self, bundle: Bundle, device: torch.device, dtype: torch.dtype | None = None,
                 task: Task | None = None, entry: str | None = None) -> None:
        self.bundle, self.device, self.dtype = bundle, device, dtype
        m = bundle.manifest
        self.entry = entry or resolve_entry(bundle)
        self.task = task or load_task(self.entry, [bundle.path])
        self.tensors = bundle.all_tensors()
        # NB: under torch.distributed every rank must run every collective of the step, so a
        # lockstep replay never stops early; it runs the whole step and reports its first failure
        self.lockstep = False
        self.rng = RngState.decode(m["rng"], self.tensors)
        where = f"bundle '{bundle.path}'"
        if (m.get("optimizer") is None) != (self.task.optimizer is None):
            raise BadInput(f"{where}: the bundle {'has no' if m.get('optimizer') is None else 'has'}"
                           " optimizer state but the entry's Task "
                           f"{'has' if self.task.optimizer is not None else 'has no'} optimizer; "
                           "replay with the code that captured it")
        if dtype is not None:
            self.task.model.to(device=device, dtype=dtype)
        else:
            self.task.model.to(device)
        self._where = where

    def restore(self) -> Any:
        """Reset model, optimizer and RNG to the pre-step state; return the batch on the device."""
        restore_model(self.task.model, self.bundle.manifest["model"], self.tensors, self._where)
        if self.task.optimizer is not None:
            restore_optimizer(self.task.optimizer, self.bundle.manifest["optimizer"],
                              self.tensors, self._where)
            self.task.optimizer.zero_grad(set_to_none=True)
        batch = decode(self.bundle.manifest["batch"], self.tensors, self.device)
        if self.dtype is not None:
            batch = torch.utils._pytree.tree_map(
                lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t, batch)
        self.task.model.zero_grad(set_to_none=True)
        self.rng.set()
        return batch

    def input_faults(self, batch: Any) -> list[BadValue]:
        """Non-finite values present before the step runs. ``-inf`` in a batch is allowed (masks)."""
        model, opt = self.task.model, self.task.optimizer
        bad = [b for b in _scan("batch", iter_tensors(batch)) if b.nan or b.posinf]
        bad += _scan("parameter", model.named_parameters())
        bad += _scan("buffer", ((n, b) for n, b in model.named_buffers() if b.is_floating_point()))
        if opt is not None:
            names = {p: n for n, p in model.named_parameters()}
            bad += _scan("optimizer", ((f"{names.get(p, '?')}.{k}", v) for p, st in
                                       opt.state.items() for k, v in st.items()
                                       if isinstance(v, torch.Tensor) and v.is_floating_point()))
        return bad

    def run(self, *, phase: Callable[[str], ContextManager] = lambda name: nullcontext(),
            wrap: Callable[[], ContextManager] = nullcontext, stop_after: str = "optimizer"
            ) -> StepOutcome:
        """Replay the step: input checks, forward, backward, optimizer step, in that order.

        ``phase(name)`` gives a context manager around each of "forward", "backward" and
        "optimizer" (probes, recorders); ``wrap()`` one around the whole step (fault injection,
        op counting); ``stop_after`` ends the run after that phase.
        """
        batch = self.restore()
        bad = self.input_faults(batch)
        if bad:
            return StepOutcome(None, "input", bad)
        task = self.task
        failed: StepOutcome | None = None   # the first failure, when running in lockstep
        with wrap():
            with phase("forward"):
                loss = task.loss_fn(task.model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise BadInput(f"entry '{self.entry}': loss_fn returned "
                               f"{type(loss).__name__}, not a scalar tensor; return the loss")
            loss_v = float(local(loss).detach().float().item())
            kept = loss.detach()
            if not math.isfinite(loss_v):
                failed = StepOutcome(loss_v, "forward", _scan("loss", [("loss", kept)]), kept)
                if not self.lockstep:
                    return failed
            if stop_after == "forward" and not self.lockstep:
                return StepOutcome(loss_v, None, loss_tensor=kept)
            with phase("backward"):
                loss.backward()
            grads = _scan("grad", ((n, p.grad) for n, p in task.model.named_parameters()
                                   if p.grad is not None))
            if grads and failed is None:
                failed = StepOutcome(loss_v, "backward", grads, kept)
                if not self.lockstep:
                    return failed
            if (stop_after == "backward" and not self.lockstep) or task.optimizer is None:
                return failed or StepOutcome(loss_v, None, loss_tensor=kept)
            with phase("optimizer"):
                task.optimizer.step()
        params = _scan("parameter", task.model.named_parameters())
        if failed is not None:
            return failed
        return StepOutcome(loss_v, "optimizer" if params else None, params, kept)


def stacked(*cms: ContextManager) -> ExitStack:
    """Enter ``cms`` in order (the last entered is innermost) as one context manager."""
    es = ExitStack()
    for cm in cms:
        es.enter_context(cm)
    return es


def resolve_entry(bundle: Bundle) -> str:
    """The bundle's entry with its file found next to the bundle, here, or where it was."""
    m = bundle.manifest
    target, _, func = m["entry"].rpartition(":")
    if not target.endswith(".py"):
        return m["entry"]
    rel = m.get("entry_file_from_bundle")
    for cand in ([bundle.path / rel] if rel else []) + [Path(target)] + (
            [Path(m["entry_file"])] if m.get("entry_file") else []):
        if cand.is_file():
            return f"{cand.resolve()}:{func}"
    return m["entry"]
