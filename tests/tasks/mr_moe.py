"""An MoE-like block whose fused op is broken only on the target, for multi-rank ``--reference``.

    torchrun --nproc-per-node 2 tests/tasks/mr_moe.py FUNC OUT_DIR

trains FUNC's task with nanbisect.Guard on every rank (gloo, CPU) for two healthy steps, then
captures step 2 with nanbisect.capture (every rank) and prints ``BUNDLE path``. Tasks:
- moe_ddp: the block in DDP;
- moe_fsdp: the block with FSDP2 (fully_shard on the experts and the router);
- moe_ddp_broken: DDP; rank 1's fused backward kernel is broken while step 2 runs (at capture,
  `rank1_broken`): Guard writes the bundle; a replay without that fault does not reproduce it.

The block routes every token to its top-2 experts (``nbtest::permute``), runs the experts, and
combines their outputs weighted by the router's probabilities with a fused op
(``nbtest::unpermute``, a torch.library custom op with its own backward op,
``nbtest::unpermute_backward``). `broken_unpermute` (``--inject
tests/tasks/mr_moe.py:broken_unpermute``) makes the *backward* fused op return NaN when its
``probs`` input is float32, as the NPU kernel of the real case did (it supports bfloat16 probs
only): a backward NaN, only on the target, on every rank.
"""
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import nanbisect

TOPK = 2


@torch.library.custom_op("nbtest::unpermute", mutates_args=())
def unpermute(expert_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """expert_out [T, K, H] (each token's K experts' outputs), probs [T, K] -> [T, H]."""
    return (expert_out * probs.unsqueeze(-1).to(expert_out.dtype)).sum(1)


@unpermute.register_fake
def _(expert_out, probs):
    return expert_out.new_empty(expert_out.shape[0], expert_out.shape[2])


@torch.library.custom_op("nbtest::unpermute_backward", mutates_args=())
def unpermute_backward(grad: torch.Tensor, expert_out: torch.Tensor,
                       probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g_out = grad.unsqueeze(1) * probs.unsqueeze(-1).to(grad.dtype)
    g_probs = (grad.unsqueeze(1) * expert_out).sum(-1).to(probs.dtype)
    return g_out, g_probs


@unpermute_backward.register_fake
def _(grad, expert_out, probs):
    return torch.empty_like(expert_out), torch.empty_like(probs)


def _setup(ctx, inputs, output):
    expert_out, probs = inputs
    ctx.save_for_backward(expert_out, probs)


def _backward(ctx, grad):
    expert_out, probs = ctx.saved_tensors
    return torch.ops.nbtest.unpermute_backward(grad, expert_out, probs)


unpermute.register_autograd(_backward, setup_context=_setup)


class MoE(nn.Module):
    def __init__(self, hidden: int = 8, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, h):
        probs = torch.softmax(self.router(h).float(), -1)        # fp32 probs (the bug's input)
        top, idx = probs.topk(TOPK, -1)
        outs = torch.stack([self.experts[e](h) for e in range(len(self.experts))], 1)
        picked = outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, h.shape[-1]))   # [T, K, H]
        return torch.ops.nbtest.unpermute(picked, top / top.sum(-1, keepdim=True))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.moe = MoE()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.moe(self.embed(x)))).squeeze(-1)


def _task(model):
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def moe_ddp():
    torch.manual_seed(0)
    return _task(DDP(Net()))


def moe_fsdp():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    for e in model.moe.experts:
        fully_shard(e)
    fully_shard(model.moe.router)
    fully_shard(model)
    return _task(model)


class _BrokenUnpermute(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.nbtest.unpermute_backward.default and args[2].dtype == torch.float32:
            return tuple(torch.full_like(t, float("nan")) for t in out)
        return out


def broken_unpermute():
    """--inject: the target's fused backward kernel returns NaN for float32 probs."""
    return _BrokenUnpermute()


def batch(func: str, step: int):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.rand(6, 4, generator=g)


class _Rank1Broken(_BrokenUnpermute):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if dist.get_rank() != 1:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def rank1_broken():
    """--inject (and, with FUNC moe_ddp_broken, at capture): only rank 1's kernel is broken."""
    return _Rank1Broken()


def moe_ddp_broken():
    return moe_ddp()


def main():
    func, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    task = globals()[func]()
    entry = f"{os.path.abspath(__file__)}:{func}"
    guard = nanbisect.Guard(task, entry=entry, out=out)
    if func == "moe_ddp_broken":   # rank 1's device breaks at step 2: Guard writes the bundle
        try:
            for step in range(3):
                with rank1_broken() if step == 2 else contextlib.nullcontext():
                    guard.step(batch(func, step))
        except nanbisect.NonFiniteStep as e:
            if dist.get_rank() == 0:
                sys.stdout.write(f"BUNDLE {e.bundle}\n")
                sys.stdout.flush()
        del task, guard
        gc.collect()
        dist.destroy_process_group()
        return
    for step in range(2):
        guard.step(batch(func, step))
    path = nanbisect.capture(task, batch(func, 2), f"{out}/captured", entry=entry, step=2)
    if dist.get_rank() == 0:
        sys.stdout.write(f"BUNDLE {path}\n")
        sys.stdout.flush()
    del task, guard
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


class _SkewedUnpermute(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.nbtest.unpermute.default and dist.get_rank() == 1:
            return out * 1.01
        return out


def skewed_unpermute():
    """--inject: rank 1's device computes the fused forward op 1% off (no NaN anywhere)."""
    return _SkewedUnpermute()
