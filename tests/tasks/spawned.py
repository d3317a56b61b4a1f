"""A rank started by `nanbisect.multirank.spawn` (tests/multirank/test_spawn.py): ``spawned.py MODE OUT``.

MODE ``group``: join the process group (``env://``, gloo), all-reduce the rank number, write what
it saw (environment, sum, pid) to OUT/rank<r>.json. ``crash``: rank 1 kills itself with SIGSEGV
after joining; rank 0 blocks in a collective until it is stopped. ``exit3``: rank 1 exits with
status 3 at once, rank 0 sleeps.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

mode, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
if mode == "exit3":
    if rank == 1:
        sys.exit(3)
    time.sleep(120)
dist.init_process_group("gloo")
if mode == "crash" and rank == 1:
    os.kill(os.getpid(), signal.SIGSEGV)
t = torch.tensor([float(rank)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS", "TORCHELASTIC_USE_AGENT_STORE")
(out / f"rank{rank}.json").write_text(json.dumps({
    "env": {k: os.environ.get(k) for k in keys}, "sum": t.item(), "pid": os.getpid(),
    "ppid": os.getppid(), "threads": torch.get_num_threads()}))
dist.destroy_process_group()
print(f"rank {rank} done")
