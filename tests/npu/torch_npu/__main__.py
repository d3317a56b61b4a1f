"""``python -m torch_npu``: build the device now (once per torch version and source), say where.

Prints ``emulated npu device: DIRECTORY (built|cached, N.N s)``; exits 1 with the
`_build.NoCompiler` line when no C++ compiler can build it.
"""
import torch_npu  # noqa: F401  (importing it builds or loads the extension)
from torch_npu import _build

how, seconds = _build.LOADED or ("cached", 0.0)
print(f"emulated npu device: {_build.directory()} ({how}, {seconds:.1f} s)")
