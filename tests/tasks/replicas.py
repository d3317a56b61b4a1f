"""Tasks for the replica tests and bench; run under torchrun:

    torchrun --nproc-per-node N tests/tasks/replicas.py FUNC OUT_DIR

trains FUNC's task with nanbisect.Guard on every rank (gloo, CPU) for three steps, capturing step
3 on every rank with nanbisect.capture when no step failed. ``REPLICAS_WIDTH`` (default 128) sets
the hidden width (the bench makes the model bigger). Tasks:
- ddp_rank1_nan: DDP with AdamW; rank 1's data at step 1 makes its forward take sqrt of a
  negative number (replicas in sync: every rank's model and optimizer state are the same bytes);
- ddp_healthy: the same, healthy (captured at step 3);
- ddp_out_of_sync: the same, healthy, but every odd rank adds 0.25 to ``fc.weight`` after DDP
  has broadcast rank 0's parameters: the averaged gradients keep the difference step after step
  (4 ranks: copies [[0, 2], [1, 3]]);
- fsdp_healthy: the same network sharded with FSDP2 (fully_shard): every rank holds its own
  shard, nothing but AdamW's step counters is the same on two ranks.
"""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect

WIDTH = int(os.environ.get("REPLICAS_WIDTH", "128"))


class SqrtNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):                       # x: (B, 16)
        h = torch.sqrt(self.fc(x) + x.sum(-1, keepdim=True))   # (B, WIDTH): sqrt of < 0 is NaN
        return self.head(h).squeeze(-1)         # (B,)


def _task(model: nn.Module) -> nanbisect.Task:
    return nanbisect.Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def ddp_rank1_nan():
    torch.manual_seed(0)
    return _task(DDP(SqrtNet()))


def ddp_healthy():
    torch.manual_seed(0)
    return _task(DDP(SqrtNet()))


def ddp_out_of_sync():
    torch.manual_seed(0)
    model = DDP(SqrtNet())
    if dist.get_rank() % 2 == 1:
        with torch.no_grad():
            model.module.fc.weight.add_(0.25)   # the bug: after DDP's broadcast, on odd ranks
    return _task(model)


def fsdp_healthy():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = SqrtNet()
    fully_shard(model.fc)
    fully_shard(model.head)
    fully_shard(model)
    return _task(model)


def batch(func: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    x = torch.rand(6, 16, generator=g) + 1.0       # (6, 16), positive: sqrt is fine
    if func == "ddp_rank1_nan" and dist.get_rank() == 1 and step == 1:
        x[2] = -50.0                                 # rank 1's bad sample
    return x


def main():
    func, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    task = globals()[func]()
    guard = nanbisect.Guard(task, entry=f"{os.path.abspath(__file__)}:{func}", out=out)
    path = None
    try:
        for step in range(3):
            guard.step(batch(func, step))
        path = nanbisect.capture(task, batch(func, 3), f"{out}/captured", entry=guard.entry,
                                 step=3)
    except nanbisect.NonFiniteStep as e:
        path = e.bundle
    if dist.get_rank() == 0:   # one write: ranks printing piecewise interleave
        sys.stdout.write(f"BUNDLE {path}\n")
        sys.stdout.flush()
    del task, guard   # FSDP2 holds the process group in cycles: free them while torch lives
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
