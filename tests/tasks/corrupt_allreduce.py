"""--inject file for the multi-rank tests: a faulty all-reduce on the target.

Every `c10d.allreduce_` the replay issues returns NaN in its first element, although its inputs
were finite on every rank: the emulated fault of a collective (a bad link, a kernel reading a
buffer before the transfer finished). It waits for the collective before corrupting its output.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _CorruptAllReduce(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d.allreduce_.default:
            tensors, work = out
            work.wait()
            for t in tensors:
                t.view(-1)[0] = float("nan")
        return out


def corrupt_allreduce():
    return _CorruptAllReduce()
