"""NaN/inf counts and byte digests of tensors: the one home of each.

Guarantees: `nan_inf_counts` and `nonfinite` read their counts back to the host (a device
synchronisation per call); `surely_finite` one reduction per tensor and one read per device, an
exact "all finite" or "count them"; `nan_inf_on_device` never does (its result stays on the tensor's
device, ready for a collective). Integer and bool tensors count as finite. `tensor_bytes` is the
row-major bytes of a tensor's elements, whatever its strides or device.

Complex tensors count as floating tensors (DESIGN, contract v4), element by element: a complex
element is NaN when its real or imaginary part is NaN; otherwise +inf when a part is +inf, else
-inf when a part is -inf (so each element is counted once). Magnitudes of a complex tensor are
those of its parts (`parts`: ``torch.view_as_real``), never of its modulus: they cannot overflow
where the parts do not, and ``|z| <= sqrt(2) * max(|re|, |im|)``. `cast_floating` casts a complex
tensor to the complex dtype of the asked precision instead of dropping its imaginary part.
Not here, on purpose: `replay.probe`'s per-module statistics (a fused fast path for finite CPU
tensors) and `guard`'s early-out ``isnan().any()`` checks; both answer other questions.
"""
from __future__ import annotations

import torch

from nanbisect.util import torch_internals as ti


def floating(t: torch.Tensor) -> bool:
    """A tensor whose values can be NaN or inf: real floating or complex.

    >>> [floating(torch.ones(1, dtype=d)) for d in (torch.float16, torch.complex64, torch.int64)]
    [True, True, False]
    """
    return t.is_floating_point() or t.is_complex()


_counted = floating


# floating dtypes too narrow for torch's reductions and checks (no aminmax, amax, isinf,
# isfinite, norm kernels on the CPU in 2.13: the float8 formats, float4's packed pairs):
# read through a float32 copy, which keeps every value, NaN and inf included
NARROW = frozenset(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"))
    if d is not None)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a float32 copy of it when its dtype is `NARROW` (what a statistic reads).

    >>> widened(torch.tensor([1.5, float("nan")]).to(torch.float8_e4m3fn)).tolist()
    [1.5, nan]
    """
    return t.float() if t.dtype in NARROW else t


def parts(t: torch.Tensor) -> torch.Tensor:
    """``t`` as real numbers a reduction can read: a complex tensor's ``torch.view_as_real`` (a
    view, one more dimension of size 2: real and imaginary part), a `NARROW` one `widened`,
    any other tensor itself.

    >>> parts(torch.tensor([1 + 2j])).tolist()
    [[1.0, 2.0]]
    >>> parts(torch.ones(2).to(torch.float8_e5m2)).dtype
    torch.float32
    """
    if not t.is_complex():
        return widened(t)
    if t.is_conj() or t.is_neg():     # a lazy conjugate has no real view: materialise it
        t = t.resolve_conj().resolve_neg()
    return torch.view_as_real(t)


def nonfinite_masks(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Element masks (nan, +inf, -inf) of a floating or complex tensor, on its device; each
    element is in at most one (a complex one as the module docstring says).

    >>> [m.tolist() for m in nonfinite_masks(torch.tensor([complex(1, float("nan")),
    ...                                                      complex(float("-inf"), 2), 3j]))]
    [[True, False, False], [False, False, False], [False, True, False]]
    """
    if not t.is_complex():
        t = widened(t)
        return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)
    p = parts(t)
    nan = torch.isnan(p).any(-1)
    pos = torch.isposinf(p).any(-1) & ~nan
    return nan, pos, torch.isneginf(p).any(-1) & ~nan & ~pos


_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64,
               torch.float16: torch.complex32}


def cast_floating(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` at ``dtype`` when it is real floating; a complex ``t`` at the complex dtype of that
    precision (kept as it is when there is none: bfloat16); anything else unchanged. NB:
    ``Module.to(dtype)`` and ``Tensor.to(dtype)`` drop a complex tensor's imaginary part.

    >>> cast_floating(torch.tensor([1 + 2j]), torch.float64).dtype
    torch.complex128
    >>> cast_floating(torch.ones(1), torch.float64).dtype, cast_floating(torch.ones(1).long(),
    ...                                                                  torch.float64).dtype
    (torch.float64, torch.int64)
    """
    if dtype is None:
        return t
    if t.is_floating_point():
        return t.to(dtype)
    if t.is_complex():
        if dtype.is_complex:
            return t.to(dtype)
        return t.to(_COMPLEX_OF[dtype]) if dtype in _COMPLEX_OF else t
    return t


def count(mask: torch.Tensor) -> torch.Tensor:
    """The true elements of a bool mask, as a 0-d int64 tensor on its device:
    ``count_nonzero`` (on the CPU about 25x faster than ``mask.sum()``, which widens every
    element to int64: 0.4 against 10 ms for 4M elements on the Xeon), or the sum every backend
    has where a device has no ``count_nonzero`` kernel.

    >>> int(count(torch.tensor([True, False, True])))
    2
    """
    try:
        return torch.count_nonzero(mask)
    except (NotImplementedError, RuntimeError):
        return mask.sum()


def nan_inf_counts(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(NaN, inf) elements over ``tensors``, complex ones included; read back to the host.

    >>> nan_inf_counts([torch.tensor([float("nan"), float("-inf"), 1.0]), torch.ones(2).long()])
    (1, 1)
    """
    nan = inf = 0
    for t in tensors:
        if _counted(t):
            n, p, m = nonfinite_masks(t)
            nan += int(count(n))
            inf += int(count(p)) + int(count(m))
    return nan, inf


def nonfinite(t: torch.Tensor) -> tuple[int, int, int]:
    """(nan, +inf, -inf) counts, read back to the host (one synchronisation, not three).

    >>> nonfinite(torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0]))
    (1, 1, 1)
    >>> nonfinite(torch.tensor([complex(float("inf"), float("nan")), complex(0, float("inf"))]))
    (1, 1, 0)
    """
    if not _counted(t):
        return 0, 0, 0
    s = torch.stack([count(m) for m in nonfinite_masks(t)])
    n, p, m = s.tolist()
    return int(n), int(p), int(m)


# dtypes whose sum (accumulated in at least float32) answers "all finite?" (others: the exact
# count, `nonfinite`)
_SUMMED = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
           torch.float32: torch.float32, torch.float64: torch.float64,
           torch.complex64: torch.complex64, torch.complex128: torch.complex128}


def finite_absmax(t: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of a real, non-empty tensor, left on its device (0 when no
    element is finite).

    >>> finite_absmax(torch.tensor([-3.0, float("inf"), float("nan"), 2.0])).item()
    3.0
    """
    t = widened(t)
    return torch.where(torch.isfinite(t), t.abs(), 0).amax()


def all_surely_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every element of every tensor is certainly finite (`fused_finite`).

    >>> all_surely_finite([torch.ones(3), torch.arange(3)]), all_surely_finite(
    ...     [torch.ones(2), torch.tensor([1.0, float("nan")])])
    (True, False)
    """
    return all(fused_finite(tensors))


def fused_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor: True when all its elements are certainly finite, from one fused norm per
    device and dtype (``torch._foreach_norm``, accumulated in at least float32) and one host
    read per device. A norm is finite only when every element is, so True is exact; False may
    also be a norm of large finite values that overflowed, or a dtype not normed here (complex,
    float8): the caller counts those (`nonfinite`). Integer and bool tensors are finite. So a
    failed step counts only its bad tensors, not all of them.

    >>> fused_finite([torch.ones(3), torch.tensor([1.0, float("nan")]), torch.arange(3),
    ...               torch.tensor([1j])])
    [True, False, True, False]
    """
    out: list[bool] = [not _counted(t) for t in tensors]
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if _counted(t) and not t.is_complex() and t.dtype in _SUMMED:
            groups.setdefault((t.device, t.dtype), []).append(i)
    by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for (device, dtype), idx in groups.items():
        acc = _SUMMED[dtype]
        norms = ti.foreach_norm([tensors[i] for i in idx], 2, dtype=acc if acc != dtype else None)
        by_device.setdefault(device, []).append((idx, torch.isfinite(torch.stack(norms))))
    for parts_ in by_device.values():
        flags = torch.cat([f for _, f in parts_]).tolist()
        for i, ok in zip((i for idx, _ in parts_ for i in idx), flags):
            out[i] = ok
    return out


def surely_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor: True when all its elements are certainly finite, from one reduction (a
    sum) per tensor and one host read per device; False means "count them" (`nonfinite`).

    A sum is finite only when every element is (a NaN makes it NaN; an inf makes it inf, or NaN
    beside an inf of the other sign; a complex sum is that, part by part), so True is exact.
    False may also be a sum of large finite values that overflowed (or a dtype not summed here):
    the caller counts those exactly.
    Integer and bool tensors are finite.

    >>> surely_finite([torch.ones(3), torch.tensor([1.0, float("-inf")]),
    ...                torch.full((2,), 3e38), torch.arange(3), torch.tensor([1j, float("nan")])])
    [True, False, False, True, False]
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
    if t.is_complex():
        n, p, m = nonfinite_masks(t)
        return torch.stack([count(n), count(p) + count(m)]).float()
    return torch.stack([count(torch.isnan(t)), count(torch.isinf(t))]).float()


def tensor_bytes(t: torch.Tensor):
    """The bytes of ``t``'s elements in row-major order (a NumPy uint8 array; ``b""`` when
    empty), copied to the CPU when it lives elsewhere.

    >>> bytes(tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)))
    b'\\x01\\x00\\x02\\x00'
    """
    flat = t.detach().to("cpu").reshape(-1)     # (N,): 0-dim tensors and any strides too
    return flat.view(torch.uint8).numpy() if flat.numel() else b""
