"""A VQ-VAE whose codebook is updated by exponential moving averages (buffers, under no_grad):
``embed = embed_sum / cluster_size``, with ``cluster_size`` starting at 0, is 0/0 for a code no
vector picked yet. The step that makes it keeps a finite loss (the quantised vectors were read
before the update): the NaN sits in the ``embed`` buffer, and the next step's loss is NaN.

``task()`` builds it (``ddp=True``: wrapped in DDP, whose forward broadcasts rank 0's buffers to
the other ranks); ``assigning()`` puts the new codebook in the buffer's place (``self.embed =
...``) instead of writing it in place: the Guard reads the buffers it walked at the step's start,
so it sees that one a step late; ``batch(step)`` is a step's batch.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanbisect

K, D = 8, 4


class VQ(nn.Module):
    def __init__(self, decay: float = 0.9, assign: bool = False):
        super().__init__()
        self.decay, self.assign = decay, assign
        self.register_buffer("embed", torch.randn(K, D, generator=torch.Generator().manual_seed(1)))
        self.register_buffer("cluster_size", torch.zeros(K))
        self.register_buffer("embed_sum", torch.zeros(K, D))

    def forward(self, z):
        flat = z.reshape(-1, D)
        dist = (flat ** 2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() \
            + (self.embed ** 2).sum(1)
        idx = dist.argmin(1)
        q = self.embed[idx].view_as(z)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, K).type(flat.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
                # BUG: a code no vector picked yet has cluster_size 0: 0/0
                new = self.embed_sum / self.cluster_size.unsqueeze(1)
                if self.assign:      # a new tensor in the buffer's place
                    self.embed = new
                else:
                    self.embed.copy_(new)
        return z + (q - z).detach(), q


class VQVAE(nn.Module):
    def __init__(self, assign: bool = False):
        super().__init__()
        self.enc, self.vq, self.dec = nn.Linear(8, D), VQ(assign=assign), nn.Linear(D, 8)

    def forward(self, x):
        z = self.enc(x)
        zq, q = self.vq(z)
        return self.dec(zq), z, q


def loss_fn(model, x):
    out, z, q = model(x)
    return F.mse_loss(out, x) + 0.25 * F.mse_loss(z, q.detach())


def task(ddp: bool = False, assign: bool = False) -> nanbisect.Task:
    torch.manual_seed(0)
    model = VQVAE(assign)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)      # its forward broadcasts rank 0's buffers (the default)
    return nanbisect.Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                          loss_fn=loss_fn)


def assigning() -> nanbisect.Task:
    return task(assign=True)


def batch(step: int = 0, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(100 + step))
