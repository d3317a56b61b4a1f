"""Tasks and a training script for multi-rank tests; run under torchrun:

    torchrun --nproc-per-node 2 tests/tasks/ddp_train.py FUNC OUT_DIR

trains FUNC's task with nanbisect.Guard on every rank (gloo, CPU) until it fails. Faults:
- comm_corrupt: a DDP comm hook of the user's that corrupts the *reduced* gradients (NaN);
- rank1_nan: rank 1's data makes its forward take sqrt of a negative number;
- rank1_nan_batch: rank 1's batch holds a NaN (the data, not the model);
- crash_on_replay: healthy while training, fails on rank 1 when CRASH_ON_REPLAY=1 (replay);
- tp_rank1_nan: tensor parallel, no DDP: a row-parallel layer whose shard on rank 1 takes sqrt of
  a negative number; its partial sums are all-reduced *inside* the layer, so on every rank the
  same module call has clean inputs and a NaN output: only op level tells rank 1 computed it;
- tp_rank2_nan: the same on 4 ranks, rank 2's shard corrupt (every rank's loss is NaN after the
  all-reduce; only rank 2's input to it was);
- tp_healthy: the same layer with healthy shards; captures step 3 on every rank (replayed with
  DIVERGE_ON_REPLAY=1, rank 1 skips the all-reduce: a different control path). Replayed with
  `--inject tests/tasks/corrupt_allreduce.py:corrupt_allreduce` (an all-reduce that returns NaN
  from finite inputs) it is the collective's fault, seen by every rank;
- fsdp_rank1_backward_nan: FSDP2 (fully_shard), parameters are DTensor shards; a gate whose
  backward takes sqrt of rank 1's negative feature sum: rank 1 computes a NaN gradient, the
  reduce-scatter hands every rank NaN in its shard;
- fsdp_healthy: the same model, healthy; captures step 3. Replayed with `--inject
  tests/tasks/corrupt_allreduce.py:corrupt_reduce_scatter` the reduce-scatter is at fault;
- vq_ema: a VQ-VAE under DDP (broadcast_buffers) whose codebook's moving average is 0/0 for a
  code no vector picked (tests/tasks/vq_buffer.py): the loss stays finite, the NaN sits in a
  buffer; the Guard reads buffers with the step and bundles step 0, the step that made it;
  vq_ema_poisoned: no Guard, rank 0's codebook already holds a NaN row (an earlier step made
  it) and step 0 is captured on every rank: DDP's forward broadcasts it to rank 1;
- ddp_adam_eps0, fsdp_adam_eps0: Adam with eps=0 turns a parameter whose gradient is exactly 0
  into NaN in step 0's update (born in the optimizer): the Guard sees it at step 1's reading and
  every rank rebuilds step 0's pre-state from its snapshot; ddp_adam_eps0_rank1_nosnap: rank 1
  cannot write its snapshot, so no rank keeps one.
"""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vq_buffer  # noqa: E402 - the task file beside this one


class SqrtNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.sqrt(self.fc(x) + x.sum(-1, keepdim=True))).squeeze(-1)


def _task(hook=None):
    marks = os.environ.get("MR_MARK_DIR")
    if marks:   # which processes built the task (a replay of some ranks starts one per rank)
        open(os.path.join(marks, f"rank{dist.get_rank()}-{os.getpid()}"), "w").close()
    torch.manual_seed(0)
    model = DDP(SqrtNet())
    if hook is not None:
        model.register_comm_hook(None, hook)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def _corrupting_allreduce(state, bucket):
    """The user's hook: averages, then (bug) writes NaN into the reduced gradients."""
    buf = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].mul_(float("nan")))


def comm_corrupt():
    return _task(_corrupting_allreduce)


def rank1_nan():
    return _task()


def rank1_nan_batch():
    return _task()


def crash_on_replay():
    if os.environ.get("CRASH_ON_REPLAY") == "1" and dist.get_rank() == 1:
        raise RuntimeError("rank 1 cannot build its model on replay")
    return _task()


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
    """Holds columns [kr, kr+k) of an 8-wide input on rank r (k = 8 / world size); sums partial
    outputs over ranks."""

    def __init__(self, scale: float):
        super().__init__()
        self.k = 8 // dist.get_world_size()          # columns per rank
        self.weight = nn.Parameter(torch.full((self.k,), 0.5))
        self.scale = nn.Parameter(torch.tensor(scale))
        self.group = dist.new_group(list(range(dist.get_world_size())), group_desc="tp")

    def forward(self, h):
        r = dist.get_rank()
        local = h[:, self.k * r:self.k * r + self.k]
        part = torch.sqrt(self.scale * local.abs() + 0.1) * self.weight
        if os.environ.get("EXTRA_COLLECTIVE_ON_REPLAY") == "1":   # a path the capture did not take
            dist.all_reduce(torch.ones(3), group=self.group)
        if os.environ.get("DIVERGE_ON_REPLAY") == "1" and r == 1:
            return part.sum(-1, keepdim=True)      # rank 1 skips the all-reduce: ranks diverge
        return _ReduceFromTP.apply(part.sum(-1, keepdim=True), self.group)


class TPNet(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.row = RowParallel(scale)
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.row(torch.tanh(self.fc(x)))).squeeze(-1)


def _tp_task(scale: float):
    torch.manual_seed(0)   # the replicated layers start equal on every rank
    model = TPNet(scale)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def tp_rank1_nan():
    return _tp_task(-5.0 if dist.get_rank() == 1 else 1.0)   # rank 1's shard is corrupt


def tp_rank2_nan():
    return _tp_task(-5.0 if dist.get_rank() == 2 else 1.0)   # 4 ranks: rank 2's shard


def tp_healthy():
    return _tp_task(1.0)


class _SqrtGrad(torch.autograd.Function):
    """Identity on h; backward scales h's gradient by sqrt of each row's feature sum (a bug:
    negative sums give NaN)."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.save_for_backward(x)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sqrt(x.sum(-1, keepdim=True)), None


class Gate(nn.Module):
    def forward(self, h, x):
        return _SqrtGrad.apply(h, x)


class FSDPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.gate = Gate()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.gate(self.fc(x), x))).sum(-1)


def _fsdp_task():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = FSDPNet()
    fully_shard(model.fc)
    fully_shard(model.head)
    fully_shard(model)
    return nanbisect.Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


class DeadNet(nn.Module):
    """SqrtNet's layers and a parameter the loss uses times zero: its gradient is exactly 0, and
    Adam with eps=0 makes it 0 / 0 = NaN in the first update (finite loss and gradients: a fault
    born in the optimizer, seen by the Guard one step later)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.dead = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x))).squeeze(-1) + 0.0 * self.dead.sum()


def ddp_adam_eps0():
    torch.manual_seed(0)
    model = DDP(DeadNet())
    return nanbisect.Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01,
                                                                  eps=0.0),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def ddp_adam_eps0_rank1_nosnap():
    """ddp_adam_eps0; while training (`main`), rank 1 cannot write its snapshot (its temporary
    directory lies under a regular file): the ranks must agree that no snapshot was taken, or
    they would part."""
    return ddp_adam_eps0()


def fsdp_adam_eps0():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = DeadNet()
    fully_shard(model)
    return nanbisect.Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01,
                                                                  eps=0.0),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def fsdp_rank1_backward_nan():
    return _fsdp_task()


def fsdp_healthy():
    return _fsdp_task()


def vq_ema():
    return vq_buffer.task(ddp=True)


def vq_ema_poisoned():
    return vq_buffer.task(ddp=True)


def batch(func: str, step: int):
    if func.startswith("vq_ema"):
        return vq_buffer.batch(10 * dist.get_rank() + step)
    if func.startswith("tp_"):    # tensor parallel: every rank sees the same batch
        g = torch.Generator().manual_seed(step)
        return torch.rand(6, 4, generator=g) + 1.0
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    x = torch.rand(6, 4, generator=g) + 1.0            # positive: sqrt is fine
    if func in ("rank1_nan", "fsdp_rank1_backward_nan") and dist.get_rank() == 1 and step == 1:
        x[2] = -50.0                                     # rank 1's bad sample
    if func == "rank1_nan_batch" and dist.get_rank() == 1 and step == 1:
        x[3, 1] = float("nan")                           # rank 1's corrupt sample
    return x


def _say_bundle(path) -> None:
    """Rank 0 alone reports the bundle, in one write: torchrun's children may run unbuffered, and
    two ranks printing piecewise interleave ("BUNDLEBUNDLE  /path")."""
    if dist.get_rank() == 0:
        sys.stdout.write(f"BUNDLE {path}\n")
        sys.stdout.flush()


def main():
    func, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if func == "ddp_adam_eps0_rank1_nosnap" and dist.get_rank() == 1:
        import tempfile

        os.makedirs(out, exist_ok=True)
        block = os.path.join(out, "not-a-dir")
        open(block, "w").close()
        tempfile.tempdir = os.path.join(block, "tmp")    # rank 1's snapshot cannot be written
    task = globals()[func]()
    if func == "vq_ema_poisoned":
        if dist.get_rank() == 0:
            task.model.module.vq.embed[5] = float("nan")    # made by an earlier step
        path = nanbisect.capture(task, batch(func, 0), f"{out}/captured",
                                 entry=f"{os.path.abspath(__file__)}:{func}")
        _say_bundle(path)
        dist.destroy_process_group()
        return
    guard = nanbisect.Guard(task, entry=f"{os.path.abspath(__file__)}:{func}", out=out)
    try:
        for step in range(3):
            guard.step(batch(func, step))
        if func in ("crash_on_replay", "tp_healthy", "fsdp_healthy"):  # capture step 3, all ranks
            path = nanbisect.capture(task, batch(func, 3), f"{out}/captured",
                                     entry=guard.entry, step=3)
            _say_bundle(path)
    except nanbisect.NonFiniteStep as e:
        _say_bundle(e.bundle)
    # FSDP2 modules hold the process group (through their device mesh) in reference cycles: left
    # to interpreter shutdown, freeing them aborts the process now and then ("terminate called
    # without an active exception"; 3 of 25 runs pinned to one core). Free them while torch lives.
    del task, guard
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
