"""NaN/inf counts and byte digests of tensors: the one home of each.

Guarantees: `nan_inf_counts` and `nonfinite` read their counts back to the host (a device
synchronisation per call); `surely_finite` one reduction per tensor and one read per device, an
exact "all finite" or "count them"; `nan_inf_on_device` never does (its result stays on the tensor's
device, ready for a collective). Integer and bool tensors count as finite. `tensor_bytes` is the
row-major bytes of a tensor's elements, whatever its strides or device.
Not here, on purpose: `replay.probe`'s per-module statistics (a fused fast path for finite CPU
tensors) and `guard`'s early-out ``isnan().any()`` checks; both answer other questions.
"""
from __future__ import annotations

import torch


def _counted(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def nan_inf_counts(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(NaN, inf) elements over ``tensors``, complex ones included; read back to the host.

    >>> nan_inf_counts([torch.tensor([float("nan"), float("-inf"), 1.0]), torch.ones(2).long()])
    (1, 1)
    """
    nan = inf = 0
    for t in tensors:
        if _counted(t):
            nan += int(torch.isnan(t).sum())
            inf += int(torch.isinf(t).sum())
    return nan, inf


def nonfinite(t: torch.Tensor) -> tuple[int, int, int]:
    """(nan, +inf, -inf) counts, read back to the host (one synchronisation, not three).

    >>> nonfinite(torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0]))
    (1, 1, 1)
    """
    # NB: torch.isposinf refuses complex tensors; a complex input raises, as it always has
    if not _counted(t):
        return 0, 0, 0
    s = torch.stack([torch.isnan(t).sum(), torch.isposinf(t).sum(), torch.isneginf(t).sum()])
    n, p, m = s.tolist()
    return int(n), int(p), int(m)


# dtypes whose sum (accumulated in at least float32) answers "all finite?" (others: the exact
# count, `nonfinite`)
_SUMMED = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
           torch.float32: torch.float32, torch.float64: torch.float64}


def surely_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor: True when all its elements are certainly finite, from one reduction (a
    sum) per tensor and one host read per device; False means "count them" (`nonfinite`).

    A sum is finite only when every element is (a NaN makes it NaN; an inf makes it inf, or NaN
    beside an inf of the other sign), so True is exact. False may also be a sum of large finite
    values that overflowed (or a dtype not summed here): the caller counts those exactly.
    Integer and bool tensors are finite.

    >>> surely_finite([torch.ones(3), torch.tensor([1.0, float("-inf")]),
    ...                torch.full((2,), 3e38), torch.arange(3)])
    [True, False, False, True]
    """
    out: list[bool] = [not _counted(t) for t in tensors]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        acc = _SUMMED.get(t.dtype)
        if acc is not None:
            by_device.setdefault(t.device, []).append((i, t.sum(dtype=acc)))
    for sums in by_device.values():
        flags = torch.isfinite(torch.stack([s for _, s in sums])).tolist()
        for (i, _), ok in zip(sums, flags):
            out[i] = ok
    return out


def nan_inf_on_device(t: torch.Tensor) -> torch.Tensor:
    """float32 ``[nan, inf]`` counts of ``t``, left on its device (no synchronisation).

    >>> nan_inf_on_device(torch.tensor([float("nan"), 1.0])).tolist()
    [1.0, 0.0]
    """
    # NB: not nan_inf_counts: this one runs inside a DDP comm hook, where a host read would
    # synchronise every bucket's reduction
    return torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()]).float()


def tensor_bytes(t: torch.Tensor):
    """The bytes of ``t``'s elements in row-major order (a NumPy uint8 array; ``b""`` when
    empty), copied to the CPU when it lives elsewhere.

    >>> bytes(tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)))
    b'\\x01\\x00\\x02\\x00'
    """
    flat = t.detach().to("cpu").reshape(-1)     # (N,): 0-dim tensors and any strides too
    return flat.view(torch.uint8).numpy() if flat.numel() else b""
