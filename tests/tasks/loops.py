"""Tasks for real training loops, each with one trait a replay must honour or a fault to find.

- ``scaled``: a GradScaler over a model whose ``gate`` divides by zero in backward (the backward
  of sqrt at 0): every step's gradients are inf (batches from ``pos_batch``), so the scaler
  skips every step (a stall).
- ``healthy_scaled``: the same model without the fault, with a scale so large that the first
  steps overflow: the scaler skips them, then trains (normal).
- ``unscaled`` and ``loud``: Tasks that declare no GradScaler, for loops that keep their own
  (``loop_scaler``): ``unscaled`` is ``scaled``'s faulty model (its gradients are inf at any
  scale), ``loud`` the healthy one with its loss times 1e4 (finite gradients that overflow at a
  loss scale near 2**127 only).
- ``clipped``: clipping to 1.0 and accumulation of 2 micro-batches; a batch flagged ``bad`` makes
  ``gate``'s backward inf in its second micro-batch, which clipping turns into NaN.
- ``frozen_bn``: a BatchNorm backbone the loop freezes (eval mode, no gradients) under a trained
  head; in eval mode the head's ``gate`` takes sqrt of a negative (a forward NaN that train mode,
  with batch statistics, does not give).
- ``frozen_param``: an embedding the loop freezes whose gradient would be inf if it were trained;
  the real fault is Adam with eps=0 on rows with zero gradient (an optimizer NaN).
- ``underflow``: ``exp(-110 x) / exp(-110 x)``: float32 underflows to 0/0 (NaN) where float64
  gives 1; the same on any correct device, so "numerics", never "device".
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanbisect


class ZeroSqrt(nn.Module):
    """sqrt of a difference that is exactly zero: the forward is 0, the backward divides by 0."""

    def __init__(self, broken: bool = True):
        super().__init__()
        self.broken = broken

    def forward(self, x):
        if not self.broken:
            return x
        return x + torch.sqrt(x - x.detach())         # BUG: d sqrt(u)/du at u = 0 is inf


class Net(nn.Module):
    def __init__(self, broken: bool = True):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.gate = ZeroSqrt(broken)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.gate(self.fc(x))).squeeze(-1)


def mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def batch(seed: int, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return {"x": x, "y": x.sum(-1)}


def mean_out(model, batch):
    """The mean output: one sign of gradient for every sample, so an inf stays inf (an inf
    gradient times inputs of both signs would sum to NaN)."""
    return model(batch["x"]).mean()


def pos_batch(seed: int) -> dict:
    return {"x": batch(seed)["x"].abs() + 0.1}


def scaled():
    torch.manual_seed(0)
    m = Net(broken=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    return nanbisect.Task(m, opt, mean_out,
                          grad_scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))


def unscaled():
    torch.manual_seed(0)
    m = Net(broken=True)
    return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.01), mean_out)


def loud_mse(model, batch):
    return 1e4 * mse(model, batch)


def loud():
    torch.manual_seed(0)
    m = Net(broken=False)
    return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=1e-7), loud_mse)


def loop_scaler(init_scale: float = 1024.0, growth_interval: int = 2000):
    """The GradScaler a custom AMP loop keeps for itself (not declared on its Task)."""
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)


def amp_watch(guard, task, scaler, batch) -> None:
    """One step of the custom AMP loop, under ``guard.watch``."""
    with guard.watch(batch) as w:
        task.optimizer.zero_grad(set_to_none=True)
        w.loss = task.loss_fn(task.model, batch)
        scaler.scale(w.loss).backward()
        scaler.step(task.optimizer)
        scaler.update()


def healthy_scaled():
    torch.manual_seed(0)
    m = Net(broken=False)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    return nanbisect.Task(m, opt, mse,
                          grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 126))


class Switch(nn.Module):
    """sqrt(x - x) added to the rows the batch flags only: its backward is inf there."""

    def forward(self, x, bad):
        rows = bad.nonzero().flatten()
        if rows.numel() == 0:
            return x
        sel = x[rows]
        return x.index_add(0, rows, torch.sqrt(sel - sel.detach()))   # BUG: inf backward


class SwitchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.gate = Switch()
        self.head = nn.Linear(8, 1)

    def forward(self, x, bad):
        return self.head(self.gate(self.fc(x), bad)).squeeze(-1)


def switch_loss(model, batch):
    return F.mse_loss(model(batch["x"], batch["bad"]), batch["y"])


def switch_batch(seed: int, bad: bool = False) -> dict:
    b = batch(seed)
    b["bad"] = torch.zeros(6)
    if bad:
        b["bad"][2] = 1.0
    return b


def clipped():
    torch.manual_seed(0)
    m = SwitchNet()
    return nanbisect.Task(m, torch.optim.AdamW(m.parameters(), lr=1e-2), switch_loss,
                          clip_grad_norm=1.0, accumulate=2)


class Gate(nn.Module):
    def forward(self, h):
        return torch.sqrt(3.0 - h)                     # NaN where h > 3


class FrozenBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.gate = Gate()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.gate(self.backbone(x))).squeeze(-1)


def frozen_bn():
    torch.manual_seed(0)
    m = FrozenBN()
    with torch.no_grad():            # the backbone passes large values through in eval mode
        m.backbone[0].weight.copy_(torch.eye(4) * 4.0)
        m.backbone[0].bias.zero_()
    return nanbisect.Task(m, torch.optim.SGD(m.head.parameters(), lr=0.01), mse)


def freeze_backbone(model: FrozenBN) -> None:
    """What the fine-tuning loop does after building the model: the entry does not do it."""
    model.backbone.eval()
    model.backbone.requires_grad_(False)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(8))   # frozen by the loop; sqrt(0)' would be inf
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, tokens):
        e = self.embed(tokens).mean(1)
        return self.head(e + torch.sqrt(self.scale)).squeeze(-1)


def bag_loss(model, batch):
    return F.mse_loss(model(batch["tokens"]), batch["target"])


def bag_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 16, (8, 5), generator=g)    # rows 16..31 never used
    return {"tokens": tokens, "target": tokens.float().mean(1)}


def frozen_param():
    torch.manual_seed(0)
    m = Bag()
    params = [p for n, p in m.named_parameters() if n != "scale"]
    return nanbisect.Task(m, torch.optim.Adam(params, lr=1e-2, eps=0.0), bag_loss)


class Underflow(nn.Module):
    def forward(self, x):
        z = torch.exp(-110.0 * x.abs())               # float32: 0 (underflow); float64: 1e-48
        return x + z / z                               # 0/0: NaN in float32 only


class UnderflowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = Underflow()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.fc(x) + 1.0)).squeeze(-1)


def underflow():
    torch.manual_seed(0)
    m = UnderflowNet()
    return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.01), mse)
