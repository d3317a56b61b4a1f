"""What a Guard holds: the tensors reachable from it that are not the user's own (the tests of
issue 40 and scripts/bench_guard.py count them); and the steps its Keeper snapshots at
(`count_takes`: tests/guard/test_spill.py and the benchmark)."""
from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import torch

import nanbisect


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under ``t``: one count per storage."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def state_storages(task: nanbisect.Task) -> dict[str, dict[int, int]]:
    """The storages of the user's own tensors: parameters, their gradients, buffers, the
    optimizer's state (data pointer -> bytes), by kind."""
    out: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "buffers": {}, "state": {}}
    for p in task.model.parameters():
        out["params"].__setitem__(*_storage(p))
        if p.grad is not None:
            out["grads"].__setitem__(*_storage(p.grad))
    for b in task.model.buffers():
        out["buffers"].__setitem__(*_storage(b))
    for st in task.optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out["state"].__setitem__(*_storage(v))
    return out


def guard_tensors(guard: nanbisect.Guard, user: set[int]) -> dict[int, tuple[str, int, tuple]]:
    """Every tensor storage the Guard holds that is not one of the user's (``user``: data
    pointers): data pointer -> (the attribute path it was first met at, bytes, a shape met
    there). Walks the Guard's attributes (lists, tuples, dicts, deques, objects), not the Task
    nor modules, optimizers and scalers it reaches."""
    skip = (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, nanbisect.Task,
            type, type(sys), type(len), type(lambda: 0), type(guard.step), Path, str, bytes)
    held: dict[int, tuple[str, int, tuple]] = {}
    seen: set[int] = set()
    todo: list = [("guard", guard)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            ptr, n = _storage(obj)
            if ptr not in user and ptr not in held and n:
                held[ptr] = (path, n, tuple(obj.shape))
        elif isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            todo += [(f"{path}.key", k) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple, deque, set, frozenset)):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            fields.update({k: getattr(obj, k) for c in type(obj).__mro__
                           for k in getattr(c, "__slots__", ()) if hasattr(obj, k)})
            todo += [(f"{path}.{k}", v) for k, v in fields.items() if k != "task"]
    return held


def held_bytes(guard: nanbisect.Guard) -> tuple[int, list[tuple[str, int, tuple]]]:
    """(the bytes of every tensor the Guard holds, beyond the user's own; what they are)."""
    user = {ptr for kind in state_storages(guard.task).values() for ptr in kind}
    held = guard_tensors(guard, user)
    return sum(n for _, n, _ in held.values()), sorted(held.values(), key=lambda x: -x[1])


def state_bytes(task: nanbisect.Task) -> int:
    """The bytes of the parameters and the optimizer's state."""
    s = state_storages(task)
    return sum(s["params"].values()) + sum(s["state"].values())


def holds_no_copy(guard: nanbisect.Guard, share: float = 0.10) -> tuple[bool, str]:
    """Issue 40's bar: no tensor the size of the largest parameter (or its moments), and at most
    ``share`` of the parameter + optimizer-state bytes in all. (ok, what it holds)."""
    total, what = held_bytes(guard)
    state = state_bytes(guard.task)
    biggest = max(p.numel() * p.element_size() for p in guard.task.model.parameters())
    ok = total <= share * state and all(n < biggest for _, n, _ in what)
    return ok, f"holds {total} bytes against {state} of state: {what[:4]}"


def count_takes(guard: nanbisect.Guard) -> list[int]:
    """The steps at which ``guard``'s Keeper takes its K-step snapshot, from now on (a list
    that grows as it takes them)."""
    keeper, at = guard._keeper, []
    take = keeper.take

    def counted(step, *a, **kw):
        at.append(step)
        return take(step, *a, **kw)
    keeper.take = counted
    return at
