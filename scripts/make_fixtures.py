"""Regenerate fixtures/bundles/ from the task files in fixtures/tasks/.

Each faulty task is trained under `nanbisect.Guard` until the guard catches its fault and writes a
bundle; the healthy task is trained a few steps and then captured with `nanbisect.capture`.
Run from anywhere: ``python scripts/make_fixtures.py``.
"""
from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import nanbisect

ROOT = Path(__file__).resolve().parent.parent
FAULTY = ["forward_nan_behind_mask", "backward_nan_custom_function", "nan_batch",
          "optimizer_adam_eps0", "overflow_then_nan", "moe_unpermute_fp32_probs"]
HEALTHY_STEPS = 3


def main() -> None:
    os.chdir(ROOT)  # entries are recorded relative to the repository root
    sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))
    out = ROOT / "fixtures" / "bundles"
    for name in FAULTY + ["healthy"]:
        if (out / name).exists():
            shutil.rmtree(out / name)
    scratch = out / ".guard-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    for name in FAULTY:
        mod = importlib.import_module(name)
        entry = f"fixtures/tasks/{name}.py:task"
        guard = nanbisect.Guard(mod.task(), entry=entry, out=scratch)
        try:
            for batch in mod.batches():
                guard.step(batch)
        except nanbisect.NonFiniteStep as e:
            shutil.move(str(e.bundle), str(out / name))
            print(f"{name}: step {e.observed['step']} {e.observed['summary']} -> {out / name}")
        else:
            raise SystemExit(f"{name}: the guard never fired")
    shutil.rmtree(scratch, ignore_errors=True)

    mod = importlib.import_module("healthy")
    task, batches = mod.task(), mod.batches()
    guard = nanbisect.Guard(task, entry="fixtures/tasks/healthy.py:task", out=scratch)
    for _ in range(HEALTHY_STEPS):
        guard.step(next(batches))
    nanbisect.capture(task, next(batches), out / "healthy", entry="fixtures/tasks/healthy.py:task",
                      step=HEALTHY_STEPS)
    print(f"healthy: captured at step {HEALTHY_STEPS} -> {out / 'healthy'}")


if __name__ == "__main__":
    main()
