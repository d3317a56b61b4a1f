"""Is a DeepSpeed ZeRO bundle's optimizer state restored bit for bit? Run on 2 ranks as

    python -m nanbisect.multirank.spawn --world=2 --group -- tests/tasks/ds_restore.py KIND OUT [watch]

KIND is an entry of examples/deepspeed_zero.py (zero1, zero2, zero2_bf16, ...). The example's
job runs under `Guard.step` (with ``watch``: the loop's own ``engine.backward`` and
``engine.step`` inside `Guard.watch`) until its planted NaN; the Guard leaves that step's update out, so
the engine then holds the very state the bundle froze. A second engine is built as a replay
builds it (the entry again: other weights, no optimizer state yet), the bundle's part of this
rank restored into it by the replayer, and every tensor compared with the first engine's: the
model's weights, the ZeRO partitions (fp32 masters), the inner optimizer's state. Each rank
prints ``RANK r BUNDLE path``, ``RANK r MOVED n`` (tensors the fresh engine held differently
before the restore: the comparison is not vacuous), ``RANK r EXACT n`` (tensors compared) or
``RANK r DIFF names`` (those that differ).
"""
import os
import sys

import torch
import torch.distributed as dist

import nanbisect
from nanbisect.bundle.format import read_bundle
from nanbisect.replay.replayer import Replayer

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
import deepspeed_zero as ex  # noqa: E402


def say(rank: int, what: str) -> None:
    sys.stdout.write(f"RANK {rank} {what}\n")     # one write: the ranks share the pipe
    sys.stdout.flush()


def state(task) -> dict:
    """name -> a copy of each tensor of the engine's training state."""
    opt = task.optimizer
    out = {f"model.{n}": p.detach().clone() for n, p in task.model.named_parameters()}
    for i, p in enumerate(opt._params()):
        out[f"master.{i}"] = p.detach().clone()
        for k, v in opt.inner.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state.{i}.{k}"] = v.detach().clone()
    scaler = getattr(opt.outer, "loss_scaler", None)
    if scaler is not None:
        out["loss_scale"] = torch.tensor(float(scaler.cur_scale))
    return out


def main() -> None:
    kind, out, watch = sys.argv[1], sys.argv[2], sys.argv[3:] == ["watch"]
    task = getattr(ex, kind)()
    engine = task.optimizer.engine
    rank = dist.get_rank()
    guard = nanbisect.Guard(task, entry=f"{os.path.abspath(ex.__file__)}:{kind}", out=out)
    bundle = None
    try:
        for step in range(4):
            if not watch:
                guard.step(ex.batch(step, rank))
                continue
            b = ex.batch(step, rank)
            with guard.watch(b) as w:
                w.loss = ex.loss_fn(engine, b)
                engine.backward(w.loss)
                engine.step()
    except nanbisect.NonFiniteStep as e:
        bundle = e.bundle
    guard.close()
    say(rank, f"BUNDLE {bundle}")
    live = state(task)
    fresh = getattr(ex, kind)()
    before = state(fresh)
    Replayer(read_bundle(bundle).part(rank), torch.device("cpu"), task=fresh).restore()
    after = state(fresh)
    moved = sum(k not in before or not torch.equal(before[k], v) for k, v in live.items())
    say(rank, f"MOVED {moved}")
    diff = [k for k, v in live.items() if k not in after or after[k].dtype != v.dtype
            or not torch.equal(after[k], v)] + [k for k in after if k not in live]
    say(rank, f"DIFF {' '.join(diff)}" if diff else f"EXACT {len(live)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
