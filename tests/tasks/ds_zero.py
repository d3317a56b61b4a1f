"""DeepSpeed ZeRO-2 on CPU ranks (gloo; DS_ACCELERATOR=cpu) under `nanbisect.Guard.watch`; run as

    DS_ACCELERATOR=cpu python -m nanbisect.multirank.spawn --world=2 --group -- \
        tests/tasks/ds_zero.py OUT_DIR

The engine's loop (``engine.backward``, ``engine.step``) runs inside the watched step; the Task
names the engine's module and its ZeRO optimizer, whose ``state_dict()`` is not torch's format and
whose gradients live in its own partitioned buffers (no ``p.grad``). Step 2's batch is 100 times
larger: ``sqrt(fc(x) + 10)`` takes the root of a negative number. Every rank prints ``RANK r
BUNDLE path`` and ``RANK r MESSAGE text``.
"""
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import nanbisect  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.sqrt(self.fc(x) + 10)).squeeze(-1)     # (B,)


def loss_fn(m, b):
    return m(b).pow(2).mean()


ENGINE = {}


def task():
    import deepspeed

    # NB: DeepSpeed's CPU accelerator JIT-builds a shared-memory all-reduce op with the C++
    # compiler when it starts (a minute, and a file lock that a killed build leaves stale):
    # marked unavailable, it uses gloo's all-reduce, which is what is tested here
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 3,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 2}}
    deepspeed.init_distributed(dist_backend="gloo")
    engine, optimizer, _, _ = deepspeed.initialize(model=Net(), config=config)
    ENGINE["e"] = engine
    return nanbisect.Task(model=engine.module, optimizer=optimizer, loss_fn=loss_fn)


def main():
    out = sys.argv[1]
    import warnings
    warnings.simplefilter("ignore")
    t = task()
    engine, r = ENGINE["e"], dist.get_rank()
    guard = nanbisect.Guard(t, entry=f"{os.path.abspath(__file__)}:task", out=out)
    try:
        for step in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            x = x * (100.0 if step == 2 else 1.0)                            # (B, 4)
            with guard.watch(x) as w:
                loss = loss_fn(engine, x)
                w.loss = loss
                engine.backward(loss)
                engine.step()
        sys.stdout.write(f"RANK {r} DONE\n")
    except nanbisect.NonFiniteStep as e:
        message = str(e).replace("\n", " ")
        sys.stdout.write(f"RANK {r} BUNDLE {e.bundle}\nRANK {r} MESSAGE {message}\n")
    sys.stdout.flush()
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
