"""How a TorchDispatchMode sees a dispatched collective: whether the tape keeps it, what it read
and wrote, its process group, and whether it is one of DDP's own.

Shared by the capture that records a step's collectives (`nanbisect.guard.tape`) and the replay
that serves them (`nanbisect.multirank.tape`), so both see the same collectives the same way.
Guarantees: `taped` answers from the op's name alone (``c10d::*``, ``_c10d_functional::*``, but
not waits and barriers); `wait_collective` returns once the collective's output is written;
`ddp_internal` tells DDP's bucket reductions and bucket rebuilds from every other collective
(DDP's buffer broadcast included). Not guaranteed: a process group torch cannot resolve from the
op's arguments is reported as unknown (None), not guessed.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from nanbisect.bundle.state import local
from nanbisect.replay.recorder import collective_writes, is_collective

_TORCH = str(Path(torch.__file__).parent) + "/"
_DDP_FILE = _TORCH + "nn/parallel/distributed.py"
_ENGINE = _TORCH + "autograd/graph.py"


def _skip(frame) -> bool:
    """Frames between a collective's caller and the mode: other modes, torch's op plumbing."""
    code = frame.f_code
    return code.co_name == "__torch_dispatch__" or code.co_filename.startswith((
        _TORCH + "_ops.py", _TORCH + "utils/_python_dispatch.py", _TORCH + "_dynamo/",
        _TORCH + "_compile.py", _TORCH + "distributed/c10d_logger",
        _TORCH + "distributed/distributed_c10d.py"))


def caller():
    """The frame that called ``__torch_dispatch__``; None on a thread with no Python frame
    (CUDA's autograd device threads, where DDP's reducer issues its bucket reductions)."""
    try:
        return sys._getframe(2)
    except ValueError:
        return None


def ddp_internal(frame, ddp: bool = True) -> str | None:
    """Is the collective being dispatched one of DDP's own (only asked for a DDP model)?
    ``"bucket"``: a gradient bucket's reduction (from DDP's reducer: no Python frame but the
    autograd engine's, or none at all on a device thread; or from a comm hook: a frame below the
    autograd engine holds a GradBucket); ``"rebuild"``: DDP rebuilding its buckets (its first
    iterations only); None: anything else (DDP's buffer broadcast included, which every forward
    repeats)."""
    import torch.distributed as dist

    if not ddp:
        return None
    f = frame
    while f is not None and _skip(f):
        f = f.f_back
    if f is None:
        return "bucket"
    if f.f_code.co_filename == _ENGINE:
        return "bucket"                     # the reducer's own all-reduce (no comm hook)
    if f.f_code.co_filename == _DDP_FILE and f.f_code.co_name == "_pre_forward":
        return "rebuild"
    g = f
    while g is not None and g.f_code.co_filename != _ENGINE:
        if any(isinstance(v, dist.GradBucket) for v in g.f_locals.values()):
            return "bucket"                 # inside a comm hook
        g = g.f_back
    return None


def leaf_tensors(vals: list[Any]) -> list[torch.Tensor]:
    """The tensors anywhere in ``vals`` (a DTensor as its local shard)."""
    return [local(t) for t in torch.utils._pytree.tree_leaves(vals) if isinstance(t, torch.Tensor)]


def group_size(func, args: tuple, kwargs: dict) -> int | None:
    """The size of the process group a collective runs on (None: not found)."""
    pg = process_group(func, args, kwargs)
    return pg.size() if pg is not None else None


def process_group(func, args: tuple, kwargs: dict):
    import torch.distributed as dist

    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(v)
            except (RuntimeError, TypeError, AttributeError):
                continue
        if isinstance(v, str) and func.namespace.endswith("c10d_functional"):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group
                return _resolve_process_group(v)
            except (RuntimeError, KeyError, ValueError):
                continue
    return None


def group_ranks(func, args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks of the process group a collective runs on (None: not found)."""
    import torch.distributed as dist

    pg = process_group(func, args, kwargs)
    try:
        return sorted(dist.get_process_group_ranks(pg)) if pg is not None else None
    except (RuntimeError, ValueError, KeyError):
        return None


def collective_outputs(func, args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """What a collective wrote (c10d: its output arguments; functional: what it returned)."""
    if func.namespace == "c10d":
        return collective_writes(func, args, kwargs)
    return leaf_tensors([out])


def wait_collective(func, out: Any) -> None:
    """Wait until the collective's output is written."""
    for x in torch.utils._pytree.tree_leaves(out):
        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
            x.wait()
    if func.namespace.endswith("c10d_functional"):
        for t in leaf_tensors([out]):
            torch.ops._c10d_functional.wait_tensor(t)


def taped(func) -> bool:
    """Is ``func`` a collective the tape keeps (not a wait, not a barrier)?"""
    name = str(func)
    return is_collective(name) and "wait_tensor" not in name and func._schema.name not in (
        "c10d::barrier", "c10d::monitored_barrier_")

