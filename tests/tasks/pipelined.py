"""Pipelined and stalled jobs under the Guard, on 2 gloo ranks; run as

    python -m nanbisect.multirank.spawn --world=2 -- tests/tasks/pipelined.py FUNC OUT_DIR

(or under torchrun). Each trains FUNC's task with `nanbisect.Guard.step` for 4 steps; step 2 is
the one that fails. Every rank prints ``RANK r BUNDLE path`` and ``RANK r MESSAGE text`` for the
`NonFiniteStep` it got (``RANK r DONE`` when none came). torch.distributed.pipelining's
schedules are examples/pipeline_train.py's.
- p2p: two stages written by hand (``Task(step_fn=...)``): activations forward with
  ``dist.send``/``dist.recv``, gradients back with ``isend``/``irecv``. The last stage's loss is a
  triplet loss; at step 2 a triplet's anchor equals its positive, and the gradient of
  ``sqrt(0)`` is born in the last stage's backward;
- p2p_rerun_diverges: the same, except that rank 1 skips its receive when the step is run again
  (the Guard's re-run that records the step's communication): rank 0's send never meets;
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


# -- two stages written by hand ---------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))                       # (B, 8)


class Distance(nn.Module):
    def forward(self, a, b):
        return (a - b).pow(2).sum(-1).sqrt()                 # its gradient at a == b: 0/0


class Triplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.dist = Distance()

    def forward(self, h):                                    # h (B, 8): triplets of rows
        e = self.fc(h)
        a, p, n = e[0::3], e[1::3], e[2::3]
        return torch.relu(self.dist(a, p) - self.dist(a, n) + 1.0).mean()


CALLS = {"n": 0}


def _recv_grad(out):
    g = torch.empty_like(out)
    dist.irecv(g, 1).wait()
    return g


def _first_stage(m, x):
    out = m(x)
    dist.send(out.detach().contiguous(), 1)
    out.backward(_recv_grad(out))
    return None


def _last_stage(m, x):
    CALLS["n"] += 1
    h = torch.empty(x.shape[0], 8)
    if os.environ.get("PP_FUNC") == "p2p_rerun_diverges" and CALLS["n"] > 3:
        h.zero_()           # the Guard's re-run of step 2: this rank receives nothing
    else:
        dist.recv(h, 0)
    h.requires_grad_()
    loss = m(h)
    loss.backward()
    dist.isend(h.grad.contiguous(), 0).wait()
    return loss.detach()


def p2p():
    torch.manual_seed(0)
    first = dist.get_rank() == 0
    m = Encoder() if first else Triplet()
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          step_fn=_first_stage if first else _last_stage)


p2p_rerun_diverges = p2p


# -- a peer that stalls ---------------------------------------------------------------------------
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


# -- the batches ----------------------------------------------------------------------------------
def batch(func: str, step: int):
    g = torch.Generator().manual_seed(step)
    if func.startswith("p2p"):
        x = torch.randn(6, 4, generator=g)                   # 2 triplets
        if step == 2:
            x[1] = x[0]                                      # anchor == positive
        return x
    return torch.randn(4, 4, generator=g) * (100.0 if step == 2 else 1.0)


def main():
    func, out = sys.argv[1], sys.argv[2]
    os.environ["PP_FUNC"] = func
    dist.init_process_group("gloo")
    r = dist.get_rank()
    guard = nanbisect.Guard(globals()[func](), entry=f"{os.path.abspath(__file__)}:{func}",
                            out=out)
    try:
        for step in range(4):
            guard.step(batch(func, step))
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
