"""A bundle's state tensors read from their files when asked, never all held at once.

A replay restores the pre-step state many times (every pass starts from it). Holding the
bundle's model and optimizer tensors in memory beside the model and optimizer that replay them
doubles the state's footprint; `LazyTensors` instead reads one tensor at a time from its
safetensors file (the page cache keeps it warm), straight into the tensor it restores when that
is a contiguous host tensor of the same dtype (`read_into`: no copy in between), else into a
fresh tensor (one tensor's bytes, freed once copied).

Guarantees: the files' headers were checked when the bundle was read (`bounded.read_header`:
offsets inside the file, sizes that match dtype and shape); a file that shrank or changed its
size since is `BadInput` naming it, never a short tensor. Values read are never cached: each
read is a fresh tensor the caller owns (``fresh``: `state.decode` need not clone them).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from nanbisect import devices
from nanbisect.errors import BadInput
from nanbisect.util.files import read_at

# safetensors' dtype names -> torch's (those `bounded.DTYPE_BITS` admits)
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
          "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
          "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
          "U64": torch.uint64, "C64": torch.complex64, "F8_E5M2": torch.float8_e5m2,
          "F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class _Entry:
    path: Path
    shown: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int          # absolute offsets in the file
    end: int


class LazyTensors(Mapping):
    """name -> tensor, read from the file on each access (see the module's guarantees)."""

    fresh = True

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def add_file(self, path: Path, shown: str, header: dict[str, dict], data_start: int,
                 names: list[str] | None = None) -> None:
        """Serve ``path``'s tensors (only ``names`` when given) from its checked ``header``,
        whose data begins at byte ``data_start``."""
        for name, t in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            b, e = t["data_offsets"]
            self._entries[name] = _Entry(path, shown, DTYPES[t["dtype"]], tuple(t["shape"]),
                                         data_start + b, data_start + e)

    def __getitem__(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        t = torch.empty(e.shape, dtype=e.dtype)
        self._read(e, t)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> torch.Size:
        """Tensor ``name``'s shape, read from the header (no data)."""
        return torch.Size(self._entries[name].shape)

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (any device, dtype, layout of the same shape) with tensor ``name``:
        read straight into it when it is a contiguous host tensor of the same dtype."""
        e = self._entries[name]
        if (devices.on_host(dest.device) and dest.dtype == e.dtype and dest.is_contiguous()
                and tuple(dest.shape) == e.shape and not dest.is_neg() and not dest.is_conj()):
            self._read(e, dest)
        else:
            with torch.no_grad():
                dest.copy_(self[name])

    @staticmethod
    def _read(e: _Entry, dest: torch.Tensor) -> None:
        n = e.end - e.begin
        if n == 0:
            return
        buf = memoryview(dest.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
        try:
            fd = os.open(e.path, os.O_RDONLY)
            try:
                got = read_at(fd, buf, e.begin)
            finally:
                os.close(fd)
        except OSError as err:
            raise BadInput(f"{e.shown} cannot be read ({err.strerror}); copy the whole bundle "
                           "again or re-capture it") from None
        if got != n:
            raise BadInput(f"{e.shown} changed while the replay read it (a tensor ends past "
                           "the file's end); copy the whole bundle again or re-capture it")
        _bump(dest)


def _bump(t: torch.Tensor) -> None:
    """Written behind autograd's back (through NumPy): bump ``t``'s version counter as an
    in-place op would, so that whatever watches it (a tensor autograd saved, a restore that
    skips what no pass changed) sees the write. ``torch.autograd.graph.increment_version``:
    public since torch 2.1."""
    torch.autograd.graph.increment_version(t)


def fill(tensors: Mapping, name: str, dest: torch.Tensor) -> None:
    """``dest`` := ``tensors[name]``, in place, with no copy in between where ``tensors`` reads
    from files (`LazyTensors.read_into`)."""
    if isinstance(tensors, (LazyTensors, Layered)):
        tensors.read_into(name, dest)
    else:
        dest.copy_(tensors[name])


class Layered(Mapping):
    """Several mappings read as one (the first that holds a name wins); ``fresh`` when every
    layer's values are fresh."""

    def __init__(self, *layers: Mapping) -> None:
        self.layers = layers
        self.fresh = all(getattr(m, "fresh", False) for m in layers)

    def __getitem__(self, name: str) -> torch.Tensor:
        for m in self.layers:
            if name in m:
                return m[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for m in self.layers:
            for k in m:
                if k not in seen:
                    seen.add(k)
                    yield k

    def __len__(self) -> int:
        return len(set(self))

    def __contains__(self, name: object) -> bool:
        return any(name in m for m in self.layers)

    def shape(self, name: str) -> torch.Size:
        for m in self.layers:
            if name in m:
                return m.shape(name) if isinstance(m, LazyTensors) else m[name].shape
        raise KeyError(name)

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        for m in self.layers:
            if name in m:
                return fill(m, name, dest)
        raise KeyError(name)
