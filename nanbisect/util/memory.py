"""Handing the memory a replay freed back to the system.

glibc keeps what a process frees for its next allocations. A block above its mmap threshold is
a mapping of its own, unmapped when freed; but the threshold rises to the size of each such
block freed (up to 32 MB), so a model whose tensors are a few MB to 32 MB gets them from the
heap after the first frees, and the holes they leave between live blocks stay resident: a
replay of the 101M benchmark model held 2.5 GB that no tensor did (docs/BENCHMARKS.md, "Replay
at the job's size"). `trim` asks glibc to return its free pages (``malloc_trim(0)``); a later
allocation faults them in again, once. Elsewhere (another C library, macOS) it does nothing.

>>> trim() in (True, False)
True
"""
from __future__ import annotations

import ctypes
import ctypes.util

_trim = None      # glibc's malloc_trim, once looked up (False: not here)


def trim() -> bool:
    """Return the process's free heap pages to the system; True when glibc did (it had some)."""
    global _trim
    if _trim is None:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _trim = fn
        except (OSError, AttributeError):
            _trim = False
    return bool(_trim(0)) if _trim else False
