"""`nanbisect selftest`: plant known faults, catch them with Guard, bisect them; a canary.

Each built-in task below holds one fault whose culprit is known by construction. The self-test
trains it under `Guard` on the chosen device until the guard writes a bundle, runs the whole
pipeline on that bundle, and checks phase, module, call index and op. Nothing here reads the
repository's fixtures, so an installed nanbisect can test itself on any machine.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from nanbisect.guard import Guard
from nanbisect.errors import NonFiniteStep
from nanbisect.task import Task


class _Mask(nn.Module):
    def forward(self, x):                                   # (B, T)
        causal = torch.ones(x.shape[-1], x.shape[-1], dtype=torch.bool).triu(1)
        s = x[:, None, :].expand(-1, x.shape[-1], -1).masked_fill(causal, float("-inf"))
        return torch.softmax(s, -1) @ x[..., None]          # -inf: legitimate


class _SqrtAct(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 0.5)                           # NaN below 0.5


class ForwardNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.mask = _Mask()
        self.act = _SqrtAct()

    def forward(self, x):
        return self.act(self.mask(self.fc(x)).squeeze(-1)).sum(-1)


class _BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.log(x) * x.exp()                 # BUG: log of negatives -> NaN


class _ExpAct(nn.Module):
    def forward(self, x):
        return _BadBackward.apply(x)


class BackwardNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.act = _ExpAct()

    def forward(self, x):
        return self.act(self.fc(x)).sum(-1)


def task_forward() -> Task:
    torch.manual_seed(0)
    m = ForwardNaN()
    return Task(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: m(b).mean())


def task_backward() -> Task:
    torch.manual_seed(0)
    m = BackwardNaN()
    return Task(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: m(b).mean())


def task_optimizer() -> Task:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(12, 1))
    return Task(m, torch.optim.Adam(m.parameters(), lr=0.1, eps=0.0),
                lambda m, b: m(b).pow(2).mean())


@dataclass(frozen=True)
class Case:
    name: str
    entry: str
    batch: object
    expect: dict
    also: dict = field(default_factory=dict)   # other values accepted for a key of `expect`

    def met(self, found: dict) -> bool:
        return all(found.get(k) == v or found.get(k) in self.also.get(k, ())
                   for k, v in self.expect.items())


def cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)
    return [
        Case("forward NaN behind -inf masks", "nanbisect.selftest:task_forward",
             torch.rand(4, 6, generator=g) - 2.0,
             {"phase": "forward", "module": "act", "module_call": 0, "op": "aten.sqrt.default"}),
        Case("backward NaN in a custom Function", "nanbisect.selftest:task_backward",
             torch.randn(4, 6, generator=g),
             {"phase": "backward", "module": "act", "module_call": 0, "op": "aten.log.default"}),
        Case("optimizer NaN (Adam eps=0, zero gradient)", "nanbisect.selftest:task_optimizer",
             torch.randint(0, 8, (4, 3), generator=g),
             {"phase": "optimizer", "module": "0", "op": "aten.addcdiv_.default"},
             # Adam's default on an accelerator is its foreach implementation (torch picks it
             # for every device type with foreach kernels): one op over all parameters
             also={"op": ("aten._foreach_addcdiv_.ScalarList", "aten._foreach_addcdiv_.Tensor")}),
    ]


def run(device: str = "cpu") -> list[dict]:
    """Run every case on ``device``; one row per case with what was expected and found."""
    from nanbisect.pipeline import RunOptions, run_bundle
    from nanbisect.task import load_task

    rows = []
    with tempfile.TemporaryDirectory(prefix="nanbisect-selftest-") as d:
        for case in cases():
            t0 = time.monotonic()
            task = load_task(case.entry)
            task.model.to(device)
            guard = Guard(task, entry=case.entry, out=Path(d) / "bundles")
            batch = case.batch.to(device)
            found, bundle = {}, None
            try:
                for _ in range(3):
                    guard.step(batch)
            except NonFiniteStep as e:
                bundle = e.bundle
            if bundle is not None:
                rep = run_bundle(bundle, RunOptions(target=device, reference="none",
                                                    run_repro=False), Path(d) / case.name)
                found = {k: (rep.culprit.__dict__.get(k) if rep.culprit else None)
                         for k in case.expect}
            rows.append({"case": case.name, "expected": case.expect, "found": found,
                         "ok": case.met(found), "seconds": round(time.monotonic() - t0, 2)})
    return rows
