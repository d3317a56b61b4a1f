"""Your own training loop, guarded with `Guard.watch` (the same model and data as train.py).

    python examples/custom_loop.py    # a NaN at step 7: nanbisect-bundles/step000007
    nanbisect run nanbisect-bundles/step000007

`watch` checks the step your loop runs. The bundle replays through the entry's Task, not
through this loop, so the Task must describe what the loop does (here: the loss, clipping to
1.0, AdamW); a loop that does more replays as ``replay-mismatch``. Zero the gradients at the
start of the step: the guard reads them when the block ends.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import nanbisect
from train import batches, loss_fn, make_task   # noqa: F401  (make_task: this file's entry)

ENTRY = f"{Path(__file__).resolve()}:make_task"


def main(out: str | Path = "nanbisect-bundles") -> Path | None:
    task = make_task()
    model, optimizer = task.model, task.optimizer
    guard = nanbisect.Guard(task, entry=ENTRY, out=out)
    try:
        for step, batch in enumerate(batches()):
            with guard.watch(batch) as w:
                optimizer.zero_grad()
                w.loss = loss_fn(model, batch)   # set it before optimizer.step(): it is read then
                w.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            print(f"step {step}: loss {w.value:.4f}")
        guard.close()                            # reads the last step's update
    except nanbisect.NonFiniteStep as e:         # raised when the block ends
        print(f"step {e.observed['step']}: non-finite {e.observed['first']}; replay it with: "
              f"nanbisect run {e.bundle}")
        return e.bundle
    return None


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
