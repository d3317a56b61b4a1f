"""The replay's allocator (`nanbisect.util.memory`): where glibc puts the state's large blocks.

Each check runs in a fresh interpreter: glibc's mmap threshold is the process's, and a fixed
one is for good (pytest's own process keeps its allocator as it is)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a block "in the heap": inside the main arena's [heap] mapping (a block above the threshold is
# a mapping of its own, outside it); every allocation below runs on the main thread
PROBE = r"""
import json, torch
from nanbisect.util import memory

def in_heap(t):
    p = t.data_ptr()
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= p < hi:
                return True
    return False

MB = 1 << 20
out = {}
x = torch.empty(16 * MB // 4)
del x                       # a mapping freed: glibc's threshold moves up past 16 MB
y = torch.empty(16 * MB // 4)
out["default"] = in_heap(y)
del y
memory.trim()               # as a restore does: the free top of the heap handed back
out["not own"] = memory.map_large_state([16 * MB])
memory.own_process()
out["set"] = memory.map_large_state([16 * MB, 4096, 1 * MB])
# NB: larger than the block freed above, so that no free chunk of the heap can serve it
z = torch.empty(24 * MB // 4)
w = torch.empty(8 * MB // 4)
out["state"], out["activation"] = in_heap(z), in_heap(w)
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_state_blocks_are_mapped_in_the_replays_own_process():
    """glibc's moving threshold puts a 16 MB block in the heap once one was freed (its hole
    then stays resident); `map_large_state` in the replay's own process maps such blocks again
    (from the smallest state block up), while an 8 MB block (an activation) stays in the heap;
    outside it (a notebook) nothing changes."""
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if not got["default"]:
        pytest.skip("this C library does not move its mmap threshold as glibc does")
    assert got["not own"] is None and got["set"] == 16 << 20
    assert (got["state"], got["activation"]) == (False, True)
