"""A pipeline-parallel job under the Guard: two stages of torch.distributed.pipelining, each a
``Task(schedule=...)`` (docs/guide/multirank.md, "Pipeline parallelism").

    torchrun --nproc-per-node=2 examples/pipeline_train.py gpipe OUT    # or 1f1b
    torchrun --nproc-per-node=4 examples/pipeline_train.py gpipe OUT    # 2 stages x 2 replicas
    nanbisect run OUT/step000002

Stage 0 embeds each position and pools them with a masked mean; stage 1 regresses a value from the
pooled vector. The schedule splits each batch of 8 rows into 4 micro-batches. At step 2, row 5 of
replica 0's batch (micro-batch 2) is all padding: the masked mean divides 0 by 0 in stage 0's
forward, stage 1 receives the NaN, and the Guard writes one bundle for every rank. With 4 ranks
(rank = 2 * replica + stage) each stage's gradients are averaged over its replicas after the
schedule, in a ``step_fn`` around `nanbisect.schedule_step`.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import nanbisect

MICRO_BATCHES = 4


class Pool(nn.Module):
    def forward(self, h, mask):                              # h (B, T, 8), mask (B, T)
        m = mask.unsqueeze(-1)
        return (h * m).sum(1) / m.sum(1)                     # 0/0 for an all-padding row


class Embed(nn.Module):                                      # stage 0
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.pool = Pool()

    def forward(self, x, mask):
        return self.pool(torch.tanh(self.fc(x)), mask)      # (B, 8)


class Head(nn.Module):                                       # stage 1
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, h):
        return self.fc(h).squeeze(-1)                        # (B,)


def _task(kind: str) -> nanbisect.Task:
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    stage, replica = rank % 2, rank // 2
    model = Embed() if stage == 0 else Head()
    pipe_group = replica_group = None
    if world == 4:       # every rank builds every group, in the same order
        pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        pipe_group, replica_group = pipes[replica], replicas[stage]
    # each stage's micro-batch shapes, given: the stage needs no shape exchange with its
    # neighbours, and one stage can be replayed alone (nanbisect run --ranks)
    rows = 8 // MICRO_BATCHES
    ins = ((torch.zeros(rows, 3, 4), torch.ones(rows, 3)) if stage == 0
           else torch.zeros(rows, 8, requires_grad=True))
    outs = torch.zeros(rows, 8, requires_grad=True) if stage == 0 else torch.zeros(rows)
    pipe = PipelineStage(model, stage, 2, torch.device("cpu"), input_args=ins, output_args=outs,
                         group=pipe_group)
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(
        pipe, n_microbatches=MICRO_BATCHES, loss_fn=lambda out, t: (out - t).pow(2).mean())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if replica_group is None:
        return nanbisect.Task(model=model, optimizer=opt, schedule=schedule)

    def replicated(m, batch):       # the schedule, then the replicas' gradient average
        loss = nanbisect.schedule_step(schedule, batch)
        for p in m.parameters():
            dist.all_reduce(p.grad, group=replica_group)
            p.grad /= 2
        return loss

    return nanbisect.Task(model=model, optimizer=opt, step_fn=replicated)


def gpipe() -> nanbisect.Task:
    return _task("gpipe")


def one_f_one_b() -> nanbisect.Task:
    return _task("1f1b")


def batch(step: int) -> dict:
    """Every rank's batch for ``step``: each stage takes what it uses (inputs, target)."""
    replica = dist.get_rank() // 2
    g = torch.Generator().manual_seed(100 * replica + step)
    x, mask = torch.randn(8, 3, 4, generator=g), torch.ones(8, 3)
    mask[:, 2] = 0.0                                         # the last position is padding
    if step == 2 and replica == 0:
        mask[5] = 0.0                                        # row 5 (micro-batch 2): all padding
    return {"inputs": (x, mask), "target": torch.randn(8, generator=g)}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    func = "gpipe" if kind == "gpipe" else "one_f_one_b"
    guard = nanbisect.Guard(globals()[func](), entry=f"{os.path.abspath(__file__)}:{func}",
                            out=out)
    try:
        for step in range(4):
            guard.step(batch(step))
    except nanbisect.NonFiniteStep as e:
        print(f"RANK {dist.get_rank()} BUNDLE {e.bundle}", flush=True)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
