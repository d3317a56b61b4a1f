"""DeepSpeed ZeRO under the Guard on 2 ranks (gloo; DeepSpeed's CPU accelerator where there is no
GPU): a small MLP trained by a DeepSpeed engine (ZeRO stage 1 or 2, fp32 or bf16, Adam), as
`nanbisect.integrations.deepspeed.deepspeed_task` steps it (docs/guide/integrations.md,
"DeepSpeed").

    torchrun --nproc-per-node=2 examples/deepspeed_zero.py zero2 OUT   # zero1, zero2, zero2_bf16
    nanbisect run OUT/step000002

The hidden layer's activation is ``sqrt(h + 10)``. At step 2 rank 1's batch holds values 100
times too large (a corrupt shard of the data): rank 1 takes the root of a negative number in
forward; rank 0's forward stays finite and the NaN reaches it through ZeRO's gradient
reduction in ``engine.backward``.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import nanbisect
from nanbisect.integrations.deepspeed import deepspeed_task, init_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):                                   # x: (B, 8)
        return self.head(torch.sqrt(self.fc(x) + 10.0)).squeeze(-1)      # (B,)


def loss_fn(engine, batch):
    x, y = batch
    return (engine(x.to(engine.module.fc.weight.dtype)).float() - y).pow(2).mean()


def _task(stage: int, bf16: bool = False) -> nanbisect.Task:
    import deepspeed

    init_distributed("gloo")      # also in a replay, whose ranks are in a process group already
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              # buckets sized for this model (DeepSpeed's default, 5e8 elements, is a 2 GB
              # buffer per rank that a CPU replay reads at every op touching it)
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 10 ** 5,
                                    "allgather_bucket_size": 10 ** 5},
              "bf16": {"enabled": bf16},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=Net(), config=config)
    return deepspeed_task(engine, loss_fn)


def zero1() -> nanbisect.Task:
    return _task(1)


def zero2() -> nanbisect.Task:
    return _task(2)


def zero2_bf16() -> nanbisect.Task:
    return _task(2, bf16=True)


def zero1_bf16() -> nanbisect.Task:
    return _task(1, bf16=True)


def zero3() -> nanbisect.Task:
    return _task(3)


def batch(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    if step == 2 and rank == 1:
        x = x * 100.0                  # the corrupt shard
    return x, torch.randn(4, generator=g)


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    t = globals()[kind]()
    rank = dist.get_rank()
    guard = nanbisect.Guard(t, entry=f"{os.path.abspath(__file__)}:{kind}", out=out)
    try:
        for step in range(4):
            guard.step(batch(step, rank))
        print(f"RANK {rank} DONE", flush=True)
    except nanbisect.NonFiniteStep as e:
        print(f"RANK {rank} BUNDLE {e.bundle}", flush=True)
    finally:
        guard.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
