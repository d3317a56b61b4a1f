"""Multi-rank costs on this machine: capture and replay of a rank-local NaN with 2 and 4 ranks.

Runs tests/tasks/ddp_train.py (rank1_nan) under torchrun with N ranks, then `nanbisect run` on the
bundle; prints wall time of each, bundle bytes in all and per rank. What the numbers are: whole
commands, interpreter and torch start-up of every rank included (on 2 cores, 4 ranks share them).
What they are not: the cost of a real model, which adds its own replay time per pass.
Usage: python scripts/bench_ranks.py [--ranks 2 4] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(n: int, tmp: Path) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        f"--nproc-per-node={n}", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:0", str(ROOT / "tests/tasks/ddp_train.py"),
                        "rank1_nan", str(tmp / f"g{n}")], capture_output=True, text=True)
    capture_s = time.monotonic() - t0
    bundle = Path(next(line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
                       if line.startswith("BUNDLE ")))
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
             for d in bundle.iterdir() if d.is_dir()}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "nanbisect", "run", "--ckpt", str(bundle), "--json"],
                       capture_output=True, text=True)
    replay_s = time.monotonic() - t0
    rep = json.loads(r.stdout)
    return {"ranks": n, "capture_s": round(capture_s, 2), "replay_s": round(replay_s, 2),
            "bundle_bytes": sum(sizes.values()) + (bundle / "manifest.json").stat().st_size,
            "bytes_per_rank": round(sum(sizes.values()) / n), "culprit_rank":
            rep["culprit"]["rank"], "op": rep["culprit"]["op"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = [run(n, Path(d)) for n in a.ranks]
    print("| ranks | capture (s) | replay to culprit (s) | bundle bytes | bytes/rank | culprit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['capture_s']} | {r['replay_s']} | {r['bundle_bytes']} | "
              f"{r['bytes_per_rank']} | rank {r['culprit_rank']}, {r['op']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
