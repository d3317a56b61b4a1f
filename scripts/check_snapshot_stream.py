"""Check: the Guard's pre-step snapshot taken on a side stream is the pre-step state (issue 15;
``Guard(snapshot="every-step")``, the mode that copies the state before every step).

Two identical models (same seed) train side by side under `nanbisect.Guard`, one with the
snapshot on a side stream (the default on an accelerator), one with ``snapshot_stream=False``;
then an update with an infinite learning rate makes every parameter non-finite in the optimizer
step (the step that writes what the side stream is still copying, if the wait were missing). Both
Guards write a bundle; the check compares each bundle's model and optimizer tensors, bit for bit,
with a copy of the pre-step state this script took itself (synchronously), and the two bundles'
lists of tensors with each other. Exit 0 when all agree, 1 otherwise. On the CPU both Guards
copy synchronously: the check still runs, and says so.

    python scripts/check_snapshot_stream.py [--device cuda] [--steps 5]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

import nanbisect
from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.state import encode_optimizer
from nanbisect import devices


def make_task(device: str = "cpu") -> nanbisect.Task:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return nanbisect.Task(model=model, optimizer=opt, loss_fn=lambda m, b: m(b).square().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    side = devices.entry(dev).has_streams()
    print(f"device {dev}: snapshot on a side stream: {side}")
    tasks = {"side_stream": make_task(args.device), "plain_copy": make_task(args.device)}
    out = Path(tempfile.mkdtemp(prefix="snapshot-stream-"))
    guards = {k: nanbisect.Guard(t, entry=f"{__file__}:make_task", out=out / k,
                                 snapshot="every-step",
                                 snapshot_stream=(k == "side_stream"))
              for k, t in tasks.items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(256, 512, generator=g).to(dev) for _ in range(args.steps + 1)]
    for b in batches[:-1]:
        losses = {k: guard.step(b) for k, guard in guards.items()}
        a, c = losses.values()
        if not math.isclose(a, c, rel_tol=1e-5):    # alike, not bit for bit (see below)
            print(f"FAIL: the two Guards' losses differ: {losses}")
            return 1
    bundles, before = {}, {}
    for k, guard in guards.items():
        t = tasks[k]
        optim: dict = {}
        encode_optimizer(t.optimizer, optim)       # the names the bundle stores them under
        before[k] = {**{f"model/{n}": v.detach().cpu().clone()
                        for n, v in t.model.state_dict().items()},
                     **{n: v.detach().cpu().clone() for n, v in optim.items()}}
        for group in t.optimizer.param_groups:
            group["lr"] = float("inf")        # the update makes every parameter non-finite
        try:
            guard.step(batches[-1])
        except nanbisect.NonFiniteStep as e:
            bundles[k] = read_bundle(e.bundle)
        else:
            print(f"FAIL: {k}: the planted update did not trip the Guard")
            return 1
    ok = True
    for k, b in bundles.items():
        stored = {**b.tensors("model"), **b.tensors("optimizer")}
        for name, want in before[k].items():
            got = stored.get(name)
            if got is None or not torch.equal(got.cpu(), want):
                print(f"FAIL: {k}: bundle tensor {name} is not the pre-step value")
                ok = False
    # NB: each bundle against its own pre-step copy, never one model's against the other's: two
    # models trained side by side need not agree bit for bit (MKL may give a GEMM fewer threads
    # on a busy machine, summing in another order), and the check is of the snapshot, not that
    a, c = (set(bundles[k].tensors("optimizer")) for k in ("side_stream", "plain_copy"))
    if a != c:
        print("FAIL: the two bundles store different optimizer tensors")
        ok = False
    print("OK: both bundles hold the pre-step state bit for bit" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
