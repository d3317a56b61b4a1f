"""A 2-rank DDP task whose replay can be made to fail on one rank, and its training script:

    torchrun --nproc-per-node 2 tests/tasks/mr_faults.py OUT_DIR

trains `task` with nanbisect.Guard on every rank (gloo, CPU) for 3 healthy steps, then captures
step 3 on every rank and prints ``BUNDLE <path>``. Replayed with MR_FAULT set, rank MR_FAULT_RANK
(default 1) does this inside its loss_fn, in pass 1 of the replay:
- hang: writes MR_FAULT_MARK (when set), then sleeps forever (its peer waits in DDP's all-reduce);
- kill: SIGKILLs itself (as the OOM killer would);
- segv: reads address 0 through ctypes (a real segmentation fault in native code);
- exit: os._exit(3) (user code that ends the process).
"""
import ctypes
import gc
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x))).squeeze(-1)


def fault() -> None:
    what = os.environ.get("MR_FAULT")
    if not what or dist.get_rank() != int(os.environ.get("MR_FAULT_RANK", "1")):
        return
    if what == "hang":
        if os.environ.get("MR_FAULT_MARK"):
            Path(os.environ["MR_FAULT_MARK"]).write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "segv":
        ctypes.string_at(0)
    if what == "exit":
        os._exit(3)


def loss_fn(model, batch):
    fault()
    return model(batch).pow(2).mean()


def task():
    torch.manual_seed(0)
    model = DDP(Net())
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=loss_fn)


def batch(step: int):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.rand(6, 4, generator=g)


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    t = task()
    guard = nanbisect.Guard(t, entry=f"{os.path.abspath(__file__)}:task", out=out)
    for step in range(3):
        guard.step(batch(step))
    path = nanbisect.capture(t, batch(3), f"{out}/captured", entry=guard.entry, step=3)
    if dist.get_rank() == 0:
        sys.stdout.write(f"BUNDLE {path}\n")   # one write: ranks' output may interleave
        sys.stdout.flush()
    del t, guard
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
