"""How a TorchDispatchMode sees a dispatched collective: whether the tape keeps it, what it read
and wrote, its process group, and whether it is one of DDP's own.

Shared by the capture that records a step's collectives (`nanbisect.guard.retape`) and the replay
that serves them (`nanbisect.multirank.served`), so both see the same collectives the same way.
Guarantees: `taped` answers from the op's name alone (``c10d::*``, ``_c10d_functional::*``, but
not waits and barriers); `wait_collective` returns once the collective's output is written;
`ddp_internal` tells DDP's bucket reductions and bucket rebuilds from every other collective
(DDP's buffer broadcast included). Not guaranteed: a process group torch cannot resolve from the
op's arguments is reported as unknown (None), not guessed.
"""
from __future__ import annotations

from typing import Any

import torch

from nanbisect.bundle.state import local
from nanbisect.replay.recorder import collective_writes, is_collective
from nanbisect.util import torch_internals as ti


def caller():
    """The frame that called the dispatch mode (`nanbisect.util.torch_internals.dispatch_caller`:
    from ``__torch_dispatch__`` or from a hook of an observer mode); None on a thread with no
    Python frame (CUDA's autograd device threads, where DDP's reducer issues its bucket
    reductions)."""
    return ti.dispatch_caller()


def ddp_internal(frame, ddp: bool = True) -> str | None:
    """Is the collective being dispatched one of DDP's own (only asked for a DDP model)?
    ``"bucket"``: a gradient bucket's reduction (from DDP's reducer: no Python frame but the
    autograd engine's, or none at all on a device thread; or from a comm hook: a frame below the
    autograd engine holds a GradBucket); ``"rebuild"``: DDP rebuilding its buckets (its first
    iterations only); None: anything else (DDP's buffer broadcast included, which every forward
    repeats). Recognised from torch's file paths: `nanbisect.util.torch_internals.ddp_origin`."""
    return ti.ddp_origin(frame) if ddp else None


def leaf_tensors(vals: list[Any]) -> list[torch.Tensor]:
    """The tensors anywhere in ``vals`` (a DTensor as its local shard)."""
    return [local(t) for t in ti.tree_leaves(vals) if isinstance(t, torch.Tensor)]


def group_size(func, args: tuple, kwargs: dict) -> int | None:
    """The size of the process group a collective runs on (None: not found)."""
    pg = ti.op_process_group(func, args, kwargs)
    return pg.size() if pg is not None else None


def group_ranks(func, args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks of the process group a collective runs on (None: not found)."""
    import torch.distributed as dist

    pg = ti.op_process_group(func, args, kwargs)
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
    for x in ti.tree_leaves(out):
        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
            x.wait()
    if func.namespace.endswith("c10d_functional"):
        for t in leaf_tensors([out]):
            ti.wait_tensor(t)


def taped(func) -> bool:
    """Is ``func`` a collective the tape keeps (not a wait, not a barrier)?"""
    name = str(func)
    return is_collective(name) and "wait_tensor" not in name and ti.schema_name(func) not in (
        "c10d::barrier", "c10d::monitored_barrier_")

