"""A training script that defines its own optimizer class and runs as ``__main__``
(tests/test_main_classes.py).

Usage: python main_optimizer.py OUT. Trains under a Guard into OUT until the guard catches the
fault, then prints the bundle's path. `Lamb` is a hand-written LAMB (a per-parameter trust ratio
||w|| / ||update|| after a warm-up) with a classic bug: the ratio is not guarded, so `gate`, a
parameter that is zero and whose gradient is always zero, makes 0 / 0 at the first step after
the warm-up (step 3). Captured while running as ``python main_optimizer.py``, the bundle records
the class as ``__main__.Lamb``; `nanbisect run` imports this file as ``main_optimizer``.
"""
import sys

import torch
import torch.nn as nn

from nanbisect import Guard, NonFiniteStep, Task


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, warmup=2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, warmup=warmup))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = st["m"] / (st["v"].sqrt() + group["eps"])
                if st["step"] > group["warmup"]:
                    update = update * (p.norm() / update.norm())   # the bug: 0 / 0 for `gate`
                p.add_(update, alpha=-group["lr"])


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 1)
        self.gate = nn.Parameter(torch.zeros(4))    # switched off: zero, and no gradient

    def forward(self, x):
        return self.head(x).squeeze(-1) + 0 * (x * self.gate).sum(-1)


def make_task() -> Task:
    torch.manual_seed(0)
    model = Gated()
    return Task(model=model, optimizer=Lamb(model.parameters()),
                loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(-1)


if __name__ == "__main__":
    guard = Guard(make_task(), entry=f"{__file__}:make_task", out=sys.argv[1])
    data = batches()
    try:
        for _ in range(10):
            guard.step(next(data))
    except NonFiniteStep as e:
        print(e.bundle)
        sys.exit(0)
    sys.exit("the guard never fired")
