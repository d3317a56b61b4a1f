"""Pipelined and stalled jobs under the Guard, on 2 gloo ranks; run as

    python -m nanbisect.multirank.spawn --world=2 -- tests/tasks/pipelined.py FUNC OUT_DIR

(or under torchrun). Each trains FUNC's task with `nanbisect.Guard.step` for 4 steps; step 2's
batch is 100 times larger, so stage 1's ``sqrt(h + 10)`` takes the root of a negative number.
Every rank prints ``RANK r BUNDLE path`` and ``RANK r MESSAGE text`` for the `NonFiniteStep` it
got (``RANK r DONE`` when none came).
- p2p: two stages passing activations with ``dist.send``/``dist.recv`` and gradients back with
  ``isend``/``irecv`` (a backward hook on the received activation sends its gradient);
- p2p_rerun_diverges: the same, except that rank 1 skips its receive when the step is run again
  (the Guard's re-run that records the step's communication): rank 0's send never meets;
- gpipe / one_f_one_b: ``torch.distributed.pipelining``'s ScheduleGPipe / Schedule1F1B over the
  same two stages, 2 micro-batches (the schedule runs forward and backward itself);
- peer_hangs: a plain replicated model; at step 2 rank 1 hangs in its own code (a long sleep)
  before the Guard's agreement: rank 0 must not wait for it past NANBISECT_RANK_TIMEOUT.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import nanbisect


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return self.fc(x)                                    # (B, 8)


class Stage1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, h):
        return self.fc(torch.sqrt(h + 10)).squeeze(-1)      # (B,): NaN where h < -10


CALLS = {"n": 0}


def _first_stage_loss(m, x):
    out = m(x)                                               # (B, 8)
    dist.send(out.detach().contiguous(), 1)
    g = torch.empty_like(out)
    dist.irecv(g, 1).wait()
    return (out * g).sum()                                   # its backward applies stage 1's grad


def _last_stage_loss(m, x):
    CALLS["n"] += 1
    h = torch.empty(x.shape[0], 8)
    if os.environ.get("PP_FUNC") == "p2p_rerun_diverges" and CALLS["n"] > 3:
        h.zero_()           # the Guard's re-run of step 2: this rank receives nothing
    else:
        dist.recv(h, 0)
    h.requires_grad_()
    h.register_hook(lambda g: dist.isend(g.contiguous(), 0).wait() and None)
    return m(h).pow(2).mean()


def p2p():
    torch.manual_seed(0)
    first = dist.get_rank() == 0
    m = Stage0() if first else Stage1()
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=_first_stage_loss if first else _last_stage_loss)


p2p_rerun_diverges = p2p
SCHEDULE = {}


def _schedule_loss(m, x):
    """One step of the schedule (forward and backward of every micro-batch); the value is the
    mean loss on the last stage, and a zero-gradient term keeps run_step's backward a no-op."""
    if dist.get_rank() == 0:
        SCHEDULE["s"].step(x)
        value = torch.zeros(())
    else:
        losses = []
        SCHEDULE["s"].step(target=torch.zeros(x.shape[0]), losses=losses)
        value = torch.stack([v.detach() for v in losses]).mean()
    return value + 0.0 * sum(p.sum() for p in m.parameters())


def _scheduled(kind):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    r = dist.get_rank()
    m = Stage0() if r == 0 else Stage1()
    stage = PipelineStage(m, r, 2, torch.device("cpu"))
    schedule = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    SCHEDULE["s"] = schedule(stage, n_microbatches=2, loss_fn=lambda out, t: out.pow(2).mean())
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=_schedule_loss)


def gpipe():
    return _scheduled("gpipe")


def one_f_one_b():
    return _scheduled("1f1b")


def _hang_then_loss(m, x):
    if dist.get_rank() == 1 and x.abs().max() > 50:
        time.sleep(float(os.environ.get("PP_HANG", "60")))
        sys.stdout.write(f"RANK 1 WOKE {time.time()}\n")      # when it came back
        sys.stdout.flush()
    return m(x).pow(2).mean()


def peer_hangs():
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=_hang_then_loss)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 4, generator=g) * (100.0 if step == 2 else 1.0)     # (B, 4)


def main():
    func, out = sys.argv[1], sys.argv[2]
    os.environ["PP_FUNC"] = func
    dist.init_process_group("gloo")
    r = dist.get_rank()
    guard = nanbisect.Guard(globals()[func](), entry=f"{os.path.abspath(__file__)}:{func}",
                            out=out)
    try:
        for step in range(4):
            guard.step(batch(step))
        sys.stdout.write(f"RANK {r} DONE\n")
    except nanbisect.NonFiniteStep as e:
        message = str(e).replace("\n", " ")
        sys.stdout.write(f"RANK {r} BUNDLE {e.bundle}\nRANK {r} MESSAGE {message}\n")
    sys.stdout.flush()
    guard.close()
    guard.close()
    if func == "peer_hangs":
        os._exit(0)     # the other rank is still asleep: no goodbye collective with it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
