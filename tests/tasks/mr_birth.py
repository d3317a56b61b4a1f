"""Multi-rank tasks whose non-finite value is born at or inside a communication step; run as

    python -m nanbisect.multirank.spawn --world=N --group -- tests/tasks/mr_birth.py FUNC OUT_DIR

trains FUNC's task with nanbisect.Guard on every rank (gloo, CPU) for 3 steps; the fault fires at
step 1 only (through that step's batch), and rank 0 prints ``BUNDLE path``. Faults:
- hook_cast (2, 4 ranks): DDP with torch's own ``fp16_compress_hook``; at step 1 rank 1's target
  makes its fp32 gradient of ``head.bias`` about 7.4e4 (every other gradient on every rank below
  65504): the hook's cast ``buffer.to(torch.float16)`` on rank 1 makes inf, and the all-reduce
  hands it to every rank;
- hook_sum (2, 4 ranks): the same model with a hook as it shipped before that fix (cast to fp16,
  sum, then divide): every rank's ``head.bias`` gradient is about 4e4, finite in fp16, and the
  fp16 sum in the all-reduce overflows to inf (every other gradient and its sum stay finite);
- tp_fp16 (2, 4 ranks): a Megatron-style MLP in float16, ``mlp.fc1`` column-parallel and
  ``mlp.fc2`` row-parallel (its partial outputs are all-reduced inside its forward, group "tp"),
  then a LayerNorm; at step 1 every rank's partial is finite, their fp16 sum is inf, and the
  LayerNorm makes NaN: the loss is NaN on every rank, born in the forward all-reduce;
- moe_a2a (2, 4 ranks): expert parallelism, one expert per rank; the router's gate weight is
  ``torch.div(score, scores.sum(-1))``; at step 1 rank 1's batch is all padding (zeros), its
  scores are 0 and the division 0/0 = NaN; the gated tokens go to their experts through an
  ``all_to_all_single`` (dispatch), so rank 0's expert input holds rank 1's NaN, and its loss
  (with an auxiliary term on its expert's activations) is NaN in forward;
- fsdp_fp16_reduce (4 ranks): FSDP2 with ``reduce_dtype=torch.float16``; at step 1 every rank's
  fp32 gradient of ``layers.1.fc2.bias`` is about 4e4: finite in fp16 and after FSDP's pre-divide
  by 2, but the reduce-scatter's fp16 sum over 4 ranks (about 8e4) is inf. (On 2 ranks FSDP
  pre-divides by 2 and post-divides by 1: two finite fp16 halves cannot sum past 65504.)
- subgroup_sqrt (4 ranks): rank 2's forward takes sqrt of a negative; ranks 0 and 1 all-reduce a
  statistic over their own pair first, so the world's all-reduce that hands rank 2's NaN to every
  rank is the second collective of the step on ranks 0-1 and the first on ranks 2-3;
- fsdp_fp16_cast (2, 4 ranks): the same model; at step 1 rank 1's fp32 gradient of
  ``layers.1.fc2.bias`` is about 7.4e4 and overflows in FSDP's cast to the fp16 reduce buffer.
"""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect

BATCH = 6


# ---- DDP comm hooks ------------------------------------------------------------------------

class HookNet(nn.Module):
    """fc1 -> tanh -> head; fc1 and head.weight start 10x smaller than torch's default, so that a
    far target gives head.bias a large gradient and every other parameter a small one."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc1.weight.mul_(0.1)
            self.fc1.bias.mul_(0.1)
            self.head.weight.mul_(0.1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(x))).squeeze(-1)


def _fp16_sum_hook(state, bucket):
    """The fp16 compress hook as it shipped before pytorch/pytorch#59522: cast, sum in fp16, and
    only then divide (the sum of finite halves can overflow)."""
    t = bucket.buffer().to(torch.float16)
    fut = dist.all_reduce(t, async_op=True).get_future()

    def done(f):
        buf = bucket.buffer()
        buf.copy_(f.value()[0].div_(dist.get_world_size()))
        return buf

    return fut.then(done)


def _hook_task(hook):
    torch.manual_seed(0)
    model = DDP(HookNet())
    model.register_comm_hook(None, hook)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                          loss_fn=lambda m, b: (m(b[:, :4]) - b[:, 4]).pow(2).mean())


def hook_cast():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return _hook_task(fp16_compress_hook)


def hook_sum():
    return _hook_task(_fp16_sum_hook)


# ---- tensor parallel, float16 --------------------------------------------------------------

class _ReduceFromTP(torch.autograd.Function):
    """Megatron's "reduce from the tensor-parallel region": all-reduce forward, identity back."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class RowParallel(nn.Module):
    """Rows [kr, kr+k) of an 8-wide input on rank r (k = 8 / world size), no bias; its forward
    sums the partial outputs over the "tp" group."""

    def __init__(self, full: nn.Linear, group):
        super().__init__()
        k, r = 8 // dist.get_world_size(), dist.get_rank()
        self.weight = nn.Parameter(full.weight.detach()[:, k * r:k * r + k].clone())
        self.group = group

    def forward(self, h):
        return _ReduceFromTP.apply(nn.functional.linear(h, self.weight), self.group)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        k, r = 8 // dist.get_world_size(), dist.get_rank()
        full1, full2 = nn.Linear(4, 8), nn.Linear(8, 4, bias=False)   # equal on every rank
        with torch.no_grad():
            full2.weight.mul_(8.0)   # partials near fp16's range from inputs fp16 can hold
        self.fc1 = nn.Linear(4, k)                                     # column-parallel
        with torch.no_grad():
            self.fc1.weight.copy_(full1.weight[k * r:k * r + k])
            self.fc1.bias.copy_(full1.bias[k * r:k * r + k])
        group = dist.new_group(list(range(dist.get_world_size())), group_desc="tp")
        self.fc2 = RowParallel(full2, group)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.mlp(x))).squeeze(-1)


def tp_fp16():
    torch.manual_seed(0)   # the full layers start equal on every rank
    model = Net().half()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b.half()).float().pow(2).mean())


# ---- mixture of experts, all-to-all --------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, g):
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g.contiguous())
        return out


class MoE(nn.Module):
    """One expert per rank (``experts``, this rank's); a replicated router gives each token a gate
    weight, its chosen expert's score over the sum of its scores. Routing is fixed: token i goes
    to rank i // (tokens / world size), so every rank sends as many tokens to every rank."""

    def __init__(self):
        super().__init__()
        world = dist.get_world_size()
        torch.manual_seed(0)                      # the router is equal on every rank
        self.router = nn.Linear(8, world, bias=False)
        torch.manual_seed(1 + dist.get_rank())    # each rank's own expert
        self.experts = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x):
        world = dist.get_world_size()
        dest = torch.arange(x.shape[0]) // (x.shape[0] // world)
        scores = self.router(x).pow(2)
        gate = torch.div(scores[torch.arange(x.shape[0]), dest], scores.sum(-1))
        received = _AllToAll.apply(x * gate[:, None])          # dispatch
        expert_out = self.experts[0](received)
        return _AllToAll.apply(expert_out), expert_out       # combine


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()

    def forward(self, x):
        return self.moe(x)


def _moe_loss(m, b):
    """The tokens' output, plus an auxiliary term on this rank's expert activations (as a z-loss
    regularises what the expert computed)."""
    y, expert_out = m(b)
    return y.pow(2).mean() + 0.01 * expert_out.pow(2).mean()


def moe_a2a():
    model = MoENet()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=_moe_loss)


# ---- FSDP2, fp16 reduce --------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class FSDPNet(nn.Module):
    """Two blocks and a head; ``layers.1`` starts near zero (100x smaller than torch's default) and
    the head's weights are 16: a far target gives ``layers.1.fc2.bias`` 16x ``head.bias``'s
    gradient and every other parameter a small one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.layers[1].parameters():
                p.mul_(0.01)
            self.head.weight.fill_(16.0)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)


def _fsdp_task():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = FSDPNet()
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float16)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                          loss_fn=lambda m, b: (m(b[:, :4]) - b[:, 4]).pow(2).mean())


def fsdp_fp16_reduce():
    if dist.get_world_size() < 4:   # 2 ranks: pre-divide by 2, two finite halves cannot overflow
        raise ValueError("fsdp_fp16_reduce needs 4 ranks or more (use fsdp_fp16_cast)")
    return _fsdp_task()


def fsdp_fp16_cast():
    return _fsdp_task()


# ---- batches and the training loop ---------------------------------------------------------

# step 1's target per task and rank: the residual r = prediction - target is about -target, and
# the planted gradient is 2 * mean(r) (head.bias) or 16 * 2 * mean(r) (layers.1.fc2.bias)
_TARGET = {
    "hook_cast": lambda r: 3.7e4 if r == 1 else None,   # rank 1: head.bias ~ -7.4e4
    "hook_sum": lambda r: 2e4,                          # every rank: head.bias ~ -4e4
    "fsdp_fp16_reduce": lambda r: 1250.0,               # every rank: layers.1.fc2.bias ~ -4e4
    "fsdp_fp16_cast": lambda r: 2312.5 if r == 1 else None,   # rank 1: ~ -7.4e4
}


# tp_fp16's step-1 sample 0 per world size, (scale, direction): found by a search over directions
# for these weights; fc2's partials of output 3 are 29840 and 49184 on 2 ranks (fp16 sum 79024),
# 36992, 6024, 31424 and 0 on 4 ranks (74440); every other output's sum stays finite
_TP_ROW = {2: (18000.0, (1.0, 1.0, -1.0, -1.0)), 4: (40000.0, (0.0, 0.0, -1.0, -0.5))}


# ---- subgroups issuing different numbers of collectives -------------------------------------

class PairStats(nn.Module):
    """A layer whose output is summed over every rank; before that, the ranks of the first pair
    (0, 1) all-reduce a statistic of it over their own group (a metric: detached, finite), so
    the world's all-reduce is their second collective of the step and the other ranks' first."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        r, w = dist.get_rank(), dist.get_world_size()
        pairs = [dist.new_group([p, p + 1], group_desc=f"pair{p}") for p in range(0, w, 2)]
        self.pair, self.counts = pairs[r // 2], r < 2

    def forward(self, x):
        h = torch.sqrt(self.fc(x) + 10.0)        # NaN where a row is far negative
        if self.counts:
            stat = h.detach().abs().mean().reshape(1)
            dist.all_reduce(stat, group=self.pair)
        return _ReduceFromTP.apply(h, None)


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.row = PairStats()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.row(x)).squeeze(-1)


def subgroup_sqrt():
    """4 ranks: rank 2's row makes NaN (sqrt of a negative) at step 1; ranks 0 and 1 issued a
    collective more than ranks 2 and 3 before the world's all-reduce hands it to them."""
    model = PairNet()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def batch(func: str, step: int):
    r = dist.get_rank()
    if func == "subgroup_sqrt":
        x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(100 * r + step)) * 0.1
        if step == 1 and r == 2:
            x[0] = -1e4
        return x
    if func == "tp_fp16":    # tensor parallel: every rank sees the same batch
        g = torch.Generator().manual_seed(step)
        x = torch.rand(BATCH, 4, generator=g)
        if step == 1:   # sample 0: fc2's partials finite, their fp16 sum not (output 3)
            scale, row = _TP_ROW[dist.get_world_size()]
            x[0] = scale * torch.tensor(row)
        return x
    g = torch.Generator().manual_seed(100 * r + step)
    if func == "moe_a2a":
        x = torch.randn(2 * dist.get_world_size(), 8, generator=g)
        if step == 1 and r == 1:
            x.zero_()          # all padding: the router's scores are 0, its gate 0 / 0
        return x
    b = torch.randn(BATCH, 5, generator=g) * 0.5
    target = _TARGET[func](r) if step == 1 else None
    if target is not None:
        b[:, 4] = target
    return b


def _say_bundle(path) -> None:
    """Rank 0 alone reports the bundle, in one write (ranks printing piecewise interleave)."""
    if dist.get_rank() == 0:
        sys.stdout.write(f"BUNDLE {path}\n")
        sys.stdout.flush()


def main():
    func, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    task = globals()[func]()
    guard = nanbisect.Guard(task, entry=f"{os.path.abspath(__file__)}:{func}", out=out)
    try:
        for step in range(3):
            guard.step(batch(func, step))
    except nanbisect.NonFiniteStep as e:
        _say_bundle(e.bundle)
    # FSDP2 modules hold the process group in reference cycles: free them while torch lives
    # (left to interpreter shutdown, the process aborts now and then)
    del task, guard
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
