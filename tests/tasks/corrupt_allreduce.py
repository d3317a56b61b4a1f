"""--inject files for the multi-rank tests: a faulty all-reduce (and reduce-scatter) on the target.

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


class _CorruptReduceScatter(TorchDispatchMode):
    """FSDP2's gradient reduce-scatter returns NaN in the first element of every shard.

    NB: gloo finishes a reduce-scatter by copying into the output at *every* wait, so the
    collective runs into a scratch buffer here and the (corrupted) result is copied out once.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.c10d._reduce_scatter_base_.default:
            return func(*args, **(kwargs or {}))
        output, rest = args[0], args[1:]
        scratch = torch.empty_like(output)
        _, work = func(scratch, *rest, **(kwargs or {}))
        work.wait()
        output.copy_(scratch)
        output.view(-1)[0] = float("nan")
        return output, work


def corrupt_reduce_scatter():
    return _CorruptReduceScatter()
