"""Handing the memory a replay freed back to the system.

glibc keeps what a process frees for its next allocations. A block above its mmap threshold is
a mapping of its own, unmapped when freed; but the threshold rises to the size of each such
block freed (up to 32 MB), so a model whose tensors are a few MB to 32 MB gets them from the
heap after the first frees, and the holes they leave between live blocks stay resident: a
replay of the 101M benchmark model held 2.5 GB that no tensor did (docs/BENCHMARKS.md, "Replay
at the job's size"). `trim` asks glibc to return its free pages (``malloc_trim(0)``); a later
allocation faults them in again, once. Elsewhere (another C library, macOS) it does nothing.

`map_large_state` goes to the cause, in a process that is the replay's own (the CLI's: a
notebook's allocator is left as it is): it fixes the threshold at the size of the smallest
large block of the model's state, so that every parameter, gradient and optimizer moment is a
mapping of its own again (returned whole when freed, no hole left in the heap), while the
smaller blocks the passes allocate and free all the time (activations) stay on the heap, where
they are reused without faulting pages in. Measured on the 101M benchmark model, a fixed
threshold between the activations' size and the state blocks' took its replay's peak from 3.75
to 2.9 GB at no measurable cost (a 1 MB threshold: 2.6 GB for 30-40% more time; docs/
BENCHMARKS.md). The rank workers of a multi-rank replay do not tune theirs yet.

>>> trim() in (True, False)
True
"""
from __future__ import annotations

import ctypes
import ctypes.util

_trim = None      # glibc's malloc_trim, once looked up (False: not here)
_mallopt = None   # glibc's mallopt, the same way
_own = False      # may this process's allocator be tuned (`own_process`)?

M_MMAP_THRESHOLD = -3          # mallopt's parameter (malloc.h)
LARGE = 4 << 20                # a state block from this size is worth a mapping of its own
DYNAMIC_MAX = 32 << 20         # glibc's highest moving threshold (64-bit): larger blocks are
                               # always mappings already


def _glibc(name: str, argtypes: list):
    try:
        fn = getattr(ctypes.CDLL(None), name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return False


def trim() -> bool:
    """Return the process's free heap pages to the system; True when glibc did (it had some)."""
    global _trim
    if _trim is None:
        _trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return bool(_trim(0)) if _trim else False


def own_process() -> None:
    """This process is the replay's own (`nanbisect run`'s): `map_large_state` may tune its
    allocator."""
    global _own
    _own = True


def threshold_for(sizes) -> int | None:
    """The mmap threshold that maps every large state block (bytes of each tensor of the state
    in host memory): the smallest block of `LARGE` bytes or more; None when there is none, or
    when it is above `DYNAMIC_MAX` (glibc maps those already).

    >>> threshold_for([16 << 20, 16 << 20, 4096, 64 << 10]) == 16 << 20
    True
    >>> threshold_for([1 << 20, 4096]) is None and threshold_for([64 << 20]) is None
    True
    """
    large = [s for s in sizes if s >= LARGE]
    if not large or min(large) > DYNAMIC_MAX:
        return None
    return min(large)


def map_large_state(sizes) -> int | None:
    """In a process that is the replay's own (`own_process`), under glibc: fix the mmap
    threshold at `threshold_for` ``sizes`` (see the module's text); the threshold set, else
    None (nothing changed)."""
    global _mallopt
    if not _own:
        return None
    t = threshold_for(sizes)
    if t is None:
        return None
    if _mallopt is None:
        _mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    return t if _mallopt and _mallopt(M_MMAP_THRESHOLD, t) == 1 else None
