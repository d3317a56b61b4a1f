"""A 2-rank DDP training script whose bundle write fails on one rank (tests/guard/test_parts.py):

    python -m nanbisect.multirank.spawn --world=2 --group -- tests/tasks/write_faults.py OUT_DIR

trains with nanbisect.Guard on every rank (gloo, CPU); rank 1's batch at step 1 makes the forward
take sqrt of a negative number, so step 1 fails and every rank writes its part of the bundle.
``WRITE_FAULT`` makes the write of rank ``WRITE_FAULT_RANK`` (default 1) fail, for its tensor
files under OUT_DIR only (never the rescue directory):
- exit: the rank exits with status 3 while writing (the launcher then sends the other rank
  SIGTERM, as torchrun's agent does);
- enospc: once the other rank's part is in place, the rank fills OUT_DIR's file system (a small
  tmpfs the test mounted), so its own write gets ENOSPC from the kernel (safetensors raises its
  own SafetensorError); the filler is removed after that write failed;
- hang: the rank's write sleeps for an hour.
Every rank prints ``RANK r BUNDLE <path>`` (``None`` when no bundle was written) and ``RANK r
MESSAGE <the NonFiniteStep's message>``, in one write.
"""
import errno
import gc
import glob
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nanbisect
import nanbisect.bundle.writer as writer


class SqrtNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):                                    # x: (B, 4)
        h = torch.sqrt(self.fc(x) + x.sum(-1, keepdim=True))  # (B, 8): sqrt of < 0 is NaN
        return self.head(h).squeeze(-1)                      # (B,)


def task():
    torch.manual_seed(0)
    model = DDP(SqrtNet())
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          loss_fn=lambda m, b: m(b).pow(2).mean())


def batch(step: int):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    x = torch.rand(6, 4, generator=g) + 1.0                   # positive: sqrt is fine
    if dist.get_rank() == 1 and step == 1:
        x[2] = -50.0                                          # rank 1's bad sample
    return x


def _fill(out: str) -> str:
    """Fill ``out``'s file system; the filler's path."""
    filler = os.path.join(out, "filler")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def _fault(out: str):
    """Wrap the writer's save_file so that this rank's write under ``out`` fails as asked."""
    what, me = os.environ.get("WRITE_FAULT"), dist.get_rank()
    if not what or me != int(os.environ.get("WRITE_FAULT_RANK", "1")):
        return
    real, root = writer.save_file, os.path.realpath(out)

    def save_file(tensors, filename, *args, **kwargs):
        if not os.path.realpath(filename).startswith(root + os.sep):
            return real(tensors, filename, *args, **kwargs)      # the rescue: as it is
        if what == "exit":
            os._exit(3)
        if what == "hang":
            time.sleep(3600)
        if what == "enospc":
            other = 1 - me
            t0 = time.monotonic()
            while not glob.glob(os.path.join(out, f".*.tmp-*/rank{other}/manifest.json")):
                assert time.monotonic() - t0 < 120, "the other rank's part never came"
                time.sleep(0.02)
            filler = _fill(out)
            try:
                return real(tensors, filename, *args, **kwargs)
            finally:
                os.remove(filler)
        return real(tensors, filename, *args, **kwargs)

    writer.save_file = save_file


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    t = task()
    guard = nanbisect.Guard(t, entry=f"{os.path.abspath(__file__)}:task", out=out)
    _fault(out)
    said = ""
    try:
        for step in range(3):
            guard.step(batch(step))
    except nanbisect.NonFiniteStep as e:
        said = (f"RANK {dist.get_rank()} BUNDLE {e.bundle}\n"
                f"RANK {dist.get_rank()} MESSAGE {e}\n")
    sys.stdout.write(said)
    sys.stdout.flush()
    del t, guard
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
