"""Megatron-core under the Guard: `megatron_task`, a Task over a megatron model whose step is
megatron's (its data-parallel wrapper's gradient buffers, ``main_grad``, reduced by
``finish_grad_sync``), and `on_cpu`, the shims that let megatron-core run where there is no CUDA
(tests, a CPU replay of a bundle captured on GPUs).

`megatron_task(model, optimizer, loss_fn)`: with a plain megatron model (tensor or sequence
parallel, no data-parallel wrapper) the Task is ``Task(model, optimizer, loss_fn=loss_fn)``.
With megatron's ``DistributedDataParallel`` the step is the one megatron's training loop runs:
``zero_grad_buffer()``, the loss and its backward (the wrapper accumulates each gradient into its
contiguous buffer, ``param.main_grad``, and leaves ``param.grad`` None), ``finish_grad_sync()``
(the data-parallel reduction of the buffers), then each parameter's ``grad`` set to its
``main_grad``, as megatron's FP32 optimizer does, so that a torch optimizer updates from it and the
Guard reads it. Megatron's own optimizers (``get_megatron_optimizer``: mixed precision,
distributed) allocate on CUDA and are not run on CPU ranks; a bundle of theirs replays where CUDA
is. Megatron's process groups are the entry's to build (``initialize_model_parallel`` in the
function that builds the Task, guarded by ``model_parallel_is_initialized()``): a replay runs it
again, in lockstep on the job's backend, alone on torch's fake process group.

megatron-core assumes a GPU in a few places a pipeline-parallel step passes through (0.16.1): its
point-to-point communicator allocates receive buffers on ``torch.cuda.current_device()`` and calls
``torch.cuda.synchronize()`` after a batch of sends and receives; its schedules count tokens in a
tensor made with ``device="cuda"``. Inside ``with on_cpu():`` those calls land on the CPU: every
torch function that is given a CUDA device (by name, by index, as a ``torch.device``) gets the
CPU instead, ``torch.cuda.current_device()`` answers the CPU, ``torch.cuda.synchronize()``
does nothing, and megatron's model-parallel RNG tracker, when none was made yet, is its inference
one (its ``fork()`` switches no CUDA generator). Opt in, around the code that builds the model and
the code that runs it (a loss function, a Task's ``step_fn``, given the model it runs: idle when
that model is on CUDA, as in a replay of the bundle on a GPU), so the Guard and every replay run
it the same way:

    def step(model, batch):
        with on_cpu(model):
            losses = forward_backward_func(forward_step_func=..., model=model, ...)

Guarantees: outside the context torch and ``torch.cuda`` are as they were (the patches are undone
on exit, an exception included; nested uses are counted). Not guaranteed: that a machine with
CUDA runs the same kernels (every tensor made inside lands on the CPU); megatron's own optimizers
and fused kernels (Transformer Engine, Apex) still need a GPU.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

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


def _fork_nothing() -> None:
    """megatron's model-parallel RNG tracker, where none was made yet, made its inference one:
    its ``fork()`` (around attention's dropout) switches no CUDA generator; dropout then draws
    from the CPU's, which the bundle records."""
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    if random is not None:
        random.initialize_rng_tracker(inference_rng_tracker=True)    # no-op once made


@contextmanager
def on_cpu(model: torch.nn.Module | None = None) -> Iterator[None]:
    """megatron-core on CPU ranks (see the module doc). Given the ``model`` the code inside
    runs, nothing is changed when its parameters are on CUDA (a bundle captured on CPU ranks
    and replayed on a GPU: megatron's own CUDA allocations are then where the model is)."""
    p = next(model.parameters(), None) if model is not None else None
    if p is not None and p.device.type == "cuda":
        yield
        return
    global _depth
    with _lock:
        if _depth == 0:
            _fork_nothing()
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


def megatron_task(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]):
    """A `nanbisect.Task` over a megatron model and a torch optimizer (see the module doc);
    ``loss_fn(model, batch)`` returns the step's loss."""
    from nanbisect.task import Task

    if not callable(getattr(model, "finish_grad_sync", None)):
        return Task(model=model, optimizer=optimizer, loss_fn=loss_fn)

    def step(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        """megatron's data-parallel step: the gradients in its buffers, reduced, then read."""
        m.zero_grad_buffer()
        loss = loss_fn(m, batch)
        loss.backward()
        m.finish_grad_sync()
        for p in m.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad
        return loss

    return Task(model=model, optimizer=optimizer, step_fn=step)
