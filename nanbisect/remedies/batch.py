"""A batch's rows: how many (`row_count`), the batch without some (`drop_rows`), and what
identifies each in the data pipeline (`identify`: the batch's own per-row fields, a digest).

A row is an index along dim 0 of the batch's tensors. A tensor whose dim 0 is the row count
loses the dropped rows; so does a list or tuple of that many plain values (ids, paths, texts: the
batch's own fields); everything else (a scalar, a tensor of another size, a list of tensors) is
kept as it is.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from nanbisect import devices

from nanbisect.bundle.state import iter_tensors

PLAIN = (str, int, float, bool, type(None))


def row_count(batch: Any) -> int | None:
    """dim 0 of the batch's first tensor with one (None: no such tensor).

    >>> row_count({"x": torch.zeros(16, 8), "ids": ["a"] * 16})
    16
    """
    return next((t.shape[0] for _, t in iter_tensors(batch) if t.dim() >= 1), None)


def _per_row(v: Any, rows: int) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == rows and all(isinstance(x, PLAIN)
                                                                    for x in v)


def drop_rows(batch: Any, drop: list[int], rows: int) -> Any:
    """``batch`` without rows ``drop`` (of ``rows``).

    >>> b = drop_rows({"x": torch.arange(4), "ids": ["a", "b", "c", "d"]}, [1, 2], 4)
    >>> b["x"].tolist(), b["ids"]
    ([0, 3], ['a', 'd'])
    """
    gone = set(drop)
    keep = [i for i in range(rows) if i not in gone]

    def edit(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.dim() >= 1 and v.shape[0] == rows:
                return v.index_select(0, torch.tensor(keep, dtype=torch.long, device=v.device))
            return v
        if _per_row(v, rows):
            return type(v)(x for i, x in enumerate(v) if i not in gone)
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(edit(x) for x in v)
        if isinstance(v, dict):
            return {k: edit(x) for k, x in v.items()}
        return v

    return edit(batch)


def _fields(batch: Any, rows: int, path: str = "") -> list[tuple[str, list]]:
    """The batch's per-row plain fields, by path (``id``, ``meta.path``, ``[2]``)."""
    if _per_row(batch, rows):
        return [(path or "batch", list(batch))]
    if isinstance(batch, dict):
        return [f for k, v in batch.items()
                for f in _fields(v, rows, f"{path}.{k}" if path else str(k))]
    if isinstance(batch, (list, tuple)):
        return [f for i, v in enumerate(batch) for f in _fields(v, rows, f"{path}[{i}]")]
    return []


def identify(batch: Any, which: list[int], rows: int, limit: int = 32) -> list[dict]:
    """For each row in ``which`` (the first ``limit``): its index, the batch's own per-row
    fields, and a sha256 (16 hex digits) of its values in every row-aligned tensor, so the data
    pipeline can be searched for it.

    >>> identify({"x": torch.zeros(2, 3), "id": ["u7", "u9"]}, [1], 2)[0]["fields"]
    {'id': 'u9'}
    """
    fields = _fields(batch, rows)
    tensors = [(p, t) for p, t in iter_tensors(batch) if t.dim() >= 1 and t.shape[0] == rows]
    out = []
    for r in which[:limit]:
        h = hashlib.sha256()
        for p, t in tensors:
            row = t[r].detach().to(devices.HOST).contiguous()
            h.update(f"{p}:{row.dtype}:{tuple(row.shape)}:".encode())
            h.update(row.reshape(-1).view(torch.uint8).numpy().tobytes())
        out.append({"row": r, "sha256": h.hexdigest()[:16],
                    "fields": {p: v[r] for p, v in fields}})
    return out
