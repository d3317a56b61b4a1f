"""An emulated Ascend NPU for nanbisect's tests: ``import torch_npu`` gives torch an ``npu`` device.

It plugs into torch the way the real ``torch_npu`` does, through PrivateUse1: the backend renamed
``npu``, a device module registered as ``torch.npu``, ``Tensor.npu()``/``is_npu`` generated, and
a C++ extension (csrc/, built once per torch version: `_build`) registering the device's
allocator, guard, generators, hooks, pinned host memory, views, copies, random kernels, autocast
and a boxed CPU fallback. Device memory is host memory and every op but the device-only ones
(`torch_npu.ops`) runs the CPU's kernel, so a step on ``npu:0`` is bit-identical to one on the
CPU, except where a device-only kernel differs: that is what the tests plant.

Two devices (``npu:0``, ``npu:1``). Not emulated: asynchrony (everything completes at once;
streams and events exist and do nothing), memory limits, HCCL collectives.

Never on the path of a real installation: tests put ``tests/npu`` on ``sys.path`` (and on
``PYTHONPATH`` for the processes they start) only.
"""
from __future__ import annotations

import atexit
import time
import warnings

import torch

from torch_npu import _build

__version__ = "0.0+emulated"

_C = _build.load()

if torch._C._get_privateuse1_backend_name() != "npu":
    torch.utils.rename_privateuse1_backend("npu")

from torch_npu import npu  # noqa: E402  (after the rename: it names the device "npu")

torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True,
                                                     for_packed_sequence=True, for_storage=True)

# the CPU fallback hands some ops an out tensor the CPU kernel resizes: emulation noise, not the
# user's (e.g. mse_loss's mean)
warnings.filterwarnings("ignore", message="An output with one or more elements was resized",
                        category=UserWarning)

from torch_npu import ops  # noqa: E402,F401  (the device-only kernels: torch.ops.npu.*)


@atexit.register
def _let_device_threads_finish() -> None:
    """Give the autograd engine's device threads the GIL once before the interpreter ends.

    Each releases its finished backward's last reference on its own thread, which drops a
    Python object and so waits for the GIL; one still waiting when finalisation starts is ended
    by the interpreter inside a C++ destructor: std::terminate, exit code 134 (torch's own race;
    a real device's threads have it too). A short sleep hands them the GIL first."""
    time.sleep(0.05)
from torch_npu.ops import npu_fast_gelu, npu_moe_unpermute  # noqa: E402,F401
