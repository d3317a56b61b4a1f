"""Regenerate fixtures/bundles/ from the task files in fixtures/tasks/.

Each faulty task is trained under `nanbisect.Guard` until the guard catches its fault and writes a
bundle (``moe_unpermute_on_npu``: under the emulated device kernels of fixtures/inject/, as on the
device where it failed); the healthy tasks are trained a few steps and captured with
`nanbisect.capture`. Run from anywhere: ``python scripts/make_fixtures.py``.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import nanbisect
from nanbisect.util.files import write_atomic

ROOT = Path(__file__).resolve().parent.parent
# bundle name -> (task file, context the guarded steps run under)
FAULTY = {name: (name, None) for name in [
    "forward_nan_behind_mask", "backward_nan_custom_function", "nan_batch", "optimizer_adam_eps0",
    "overflow_then_nan", "moe_unpermute_fp32_probs", "fully_masked_row"]}
FAULTY["moe_unpermute_on_npu"] = ("moe_unpermute", "npu_kernels:npu")
FAULTY["device_only_op"] = ("device_only_op", "npu_kernels:npu")
HEALTHY = {"healthy": 3, "deterministic_gpt": 1}   # task -> steps trained before capture


def _move(bundle: Path, dest: Path) -> None:
    """Move a bundle the guard wrote under its scratch directory to ``dest``, keeping its entry
    file findable from where it now lies: ``entry_file_from_bundle`` is relative to the bundle's
    directory, and the scratch one lies a level deeper than ``dest``."""
    shutil.move(str(bundle), str(dest))
    path = dest / "manifest.json"
    manifest = json.loads(path.read_text())
    if manifest.get("entry_file"):
        manifest["entry_file_from_bundle"] = os.path.relpath(manifest["entry_file"],
                                                             dest.resolve())
        write_atomic(path, json.dumps(manifest, indent=1, allow_nan=False))


def main() -> None:
    os.chdir(ROOT)  # entries are recorded relative to the repository root
    sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))
    sys.path.insert(0, str(ROOT / "fixtures" / "inject"))
    out = ROOT / "fixtures" / "bundles"
    for name in [*FAULTY, *HEALTHY]:
        if (out / name).exists():
            shutil.rmtree(out / name)
    scratch = out / ".guard-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    for name, (task_file, inject) in FAULTY.items():
        mod = importlib.import_module(task_file)
        ctx = contextlib.nullcontext
        if inject:
            inj_mod, _, inj_fn = inject.partition(":")
            ctx = getattr(importlib.import_module(inj_mod), inj_fn)
        guard = nanbisect.Guard(mod.task(), entry=f"fixtures/tasks/{task_file}.py:task",
                                out=scratch)
        try:
            for batch in mod.batches():
                with ctx():
                    guard.step(batch)
        except nanbisect.NonFiniteStep as e:
            _move(e.bundle, out / name)
            print(f"{name}: step {e.observed['step']} {e.observed['summary']} -> {out / name}")
        else:
            raise SystemExit(f"{name}: the guard never fired")
    for name, steps in HEALTHY.items():
        mod = importlib.import_module(name)
        task, batches = mod.task(), mod.batches()
        guard = nanbisect.Guard(task, entry=f"fixtures/tasks/{name}.py:task", out=scratch)
        for _ in range(steps):
            guard.step(next(batches))
        nanbisect.capture(task, next(batches), out / name, entry=f"fixtures/tasks/{name}.py:task",
                          step=steps)
        print(f"{name}: captured at step {steps} -> {out / name}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
