"""Bundle bytes per rank with replicas written once: DDP vs FSDP2, 2 and 4 ranks.

Runs tests/tasks/replicas.py (ddp_healthy, fsdp_healthy: a Linear(16, W) -> sqrt -> Linear(W, 1)
network with AdamW, captured at step 3 on every rank) under torchrun, then reads the bundle:
- after: what each rank's part holds on disk (its files and manifest), and the whole bundle;
- before: what each rank would have written without sharing (its part plus the tensor bytes
  its manifest takes from lower ranks: the sum of the parts as they were before replicas were
  written once, give or take a few hundred bytes of safetensors headers).
What the numbers are not: capture time (torch start-up dominates at this size) or a real model's
proportions (here the per-rank batch and RNG, ~16 KB, weigh more than they would at scale).
Usage: python scripts/bench_replicas.py [--ranks 2 4] [--width 1024] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(func: str, n: int, width: int, tmp: Path) -> dict:
    out = tmp / f"{func}-{n}"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        f"--nproc-per-node={n}", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:0", str(ROOT / "tests/tasks/replicas.py"),
                        func, str(out)], capture_output=True, text=True,
                       env={**os.environ, "REPLICAS_WIDTH": str(width)})
    lines = [line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
             if line.startswith("BUNDLE ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{func} on {n} ranks failed:\n{p.stderr[-2000:]}")
    bundle = Path(lines[0])
    top = json.loads((bundle / "manifest.json").read_text())
    after, before = [], []
    for r in range(n):
        d = bundle / f"rank{r}"
        own = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        shared = json.loads((d / "manifest.json").read_text()).get("shared") or {}
        after.append(own)
        before.append(own + sum(ref["bytes"] for ref in shared.values()))
    top_bytes = (bundle / "manifest.json").stat().st_size
    rep = top.get("replicas") or {}
    return {"task": func, "ranks": n, "width": width, "after_per_rank": after,
            "before_per_rank": before, "after_total": sum(after) + top_bytes,
            "before_total": sum(before) + top_bytes, "shared_bytes": rep.get("shared_bytes"),
            "out_of_sync": rep.get("out_of_sync_count")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(func, n, a.width, Path(d)) for func in ("ddp_healthy", "fsdp_healthy")
                for n in a.ranks]
    print(f"Linear(16, {a.width}) -> Linear({a.width}, 1), AdamW; bytes per rank, rank 0 first")
    print("| task | ranks | before: bytes/rank | after: bytes/rank | before total | after total "
          "| after/before |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['ranks']} | {r['before_per_rank']} | {r['after_per_rank']} | "
              f"{r['before_total']} | {r['after_total']} | "
              f"{r['after_total'] / r['before_total']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
