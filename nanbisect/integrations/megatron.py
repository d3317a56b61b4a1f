"""Megatron-core on CPU ranks: `on_cpu`, the shims that let megatron-core's pipeline schedules
run where there is no CUDA (tests, a CPU replay of a bundle captured on GPUs).

megatron-core assumes a GPU in a few places a pipeline-parallel step passes through (0.16.1): its
point-to-point communicator allocates receive buffers on ``torch.cuda.current_device()`` and calls
``torch.cuda.synchronize()`` after a batch of sends and receives; its schedules count tokens in a
tensor made with ``device="cuda"``. Inside ``with on_cpu():`` those calls land on the CPU: every
torch function that is given a CUDA device (by name, by index, as a ``torch.device``) gets the
CPU instead, ``torch.cuda.current_device()`` answers the CPU and ``torch.cuda.synchronize()``
does nothing. Opt in, around the code that calls megatron's schedule (a Task's ``step_fn``), so
the Guard and every replay run it the same way:

    def step(model, batch):
        with on_cpu():
            losses = forward_backward_func(forward_step_func=..., model=model, ...)

Guarantees: outside the context torch and ``torch.cuda`` are as they were (the patches are undone
on exit, an exception included; nested uses are counted). Not guaranteed: that a machine with
CUDA runs the same kernels (every tensor made inside lands on the CPU); megatron's own optimizers
and fused kernels (Transformer Engine, Apex) still need a GPU.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from nanbisect.devices import HOST as _CPU
_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


def _cpu_device(d: Any) -> Any:
    """``d`` with a CUDA device (a name, an index, a ``torch.device``) made the CPU."""
    if isinstance(d, torch.device):
        return _CPU if d.type == "cuda" else d
    if isinstance(d, str):
        return _CPU if d.split(":")[0] == "cuda" else d
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU            # a bare index names a CUDA device
    return d


class _OnCpu(TorchFunctionMode):
    """Every torch function given a CUDA ``device`` gets the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _cpu_device(kwargs["device"])}
        return func(*args, **kwargs)


@contextmanager
def on_cpu() -> Iterator[None]:
    """megatron-core's pipeline schedules on CPU ranks (see the module doc)."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved.update(current_device=torch.cuda.current_device,
                          synchronize=torch.cuda.synchronize)
            torch.cuda.current_device = lambda: _CPU
            torch.cuda.synchronize = lambda device=None: None
        _depth += 1
    try:
        with _OnCpu():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.current_device = _saved.pop("current_device")
                torch.cuda.synchronize = _saved.pop("synchronize")
