"""Multi-rank costs on this machine: capture, bundle bytes, lockstep replay and a replay of one
rank alone (``--ranks 1``), for DDP and FSDP2, with 2 and 4 ranks, side by side in one run.

Runs tests/tasks/ddp_train.py under torchrun with N ranks (rank1_nan: DDP, rank 1's forward takes
sqrt of a negative number; fsdp_rank1_backward_nan: FSDP2, rank 1's backward does), then
`nanbisect run` on the bundle twice: every rank in lockstep, and rank 1 alone with the
collectives the capture recorded. Prints wall times, bytes (whole bundle, rank 0's part, the
mean of the other parts, and the recorded collectives), and whether both replays name the same
culprit. What the numbers are: whole commands, interpreter and torch start-up of every process
included (on 2 cores, 4 ranks share them). What they are not: a real model's costs, which add
its own step time per pass and its own bytes (see docs/SCALING.md for the extrapolation).
Usage: python scripts/bench_ranks.py [--ranks 2 4] [--tasks rank1_nan fsdp_rank1_backward_nan]
       [--json PATH]
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
KIND = {"rank1_nan": "DDP", "fsdp_rank1_backward_nan": "FSDP2"}


def _bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _replay(bundle: Path, out: Path, *flags: str) -> tuple[float, dict]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "nanbisect", "run", "--ckpt", str(bundle),
                        "--json", "--out", str(out), *flags], capture_output=True, text=True)
    took = time.monotonic() - t0
    if r.returncode != 1:
        raise SystemExit(f"replay {flags} of {bundle} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return took, json.loads(r.stdout)


def run(task: str, n: int, tmp: Path) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        f"--nproc-per-node={n}", "--rdzv-backend=c10d",
                        "--rdzv-endpoint=127.0.0.1:0", str(ROOT / "tests/tasks/ddp_train.py"),
                        task, str(tmp / f"{task}{n}")], capture_output=True, text=True)
    capture_s = time.monotonic() - t0
    lines = [line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
             if line.startswith("BUNDLE ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"capture of {task} on {n} ranks failed:\n{p.stderr[-2000:]}")
    bundle = Path(lines[0])
    parts = [_bytes(bundle / f"rank{r}") for r in range(n)]
    tape = [(bundle / f"rank{r}" / "collectives.safetensors") for r in range(n)]
    lock_s, lock = _replay(bundle, tmp / f"{task}{n}-lockstep")
    alone_s, alone = _replay(bundle, tmp / f"{task}{n}-alone", "--ranks", "1")
    key = lambda rep: tuple(rep["culprit"][k] for k in ("rank", "phase", "op", "module",  # noqa: E731
                                                         "module_call"))
    return {"task": task, "kind": KIND.get(task, task), "ranks": n,
            "capture_s": round(capture_s, 2), "bundle_bytes": _bytes(bundle),
            "rank0_bytes": parts[0], "other_rank_bytes": round(sum(parts[1:]) / (n - 1)),
            "tape_bytes_rank0": tape[0].stat().st_size if tape[0].is_file() else 0,
            "lockstep_s": round(lock_s, 2), "alone_s": round(alone_s, 2),
            "same_culprit": key(lock) == key(alone), "culprit": list(key(alone))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tasks", nargs="+", default=list(KIND))
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = [run(t, n, Path(d)) for t in a.tasks for n in a.ranks]
    print("| model | ranks | capture (s) | bundle bytes | rank 0 part | other parts (mean) | "
          "recorded collectives (rank 0) | lockstep replay (s) | `--ranks 1` (s) | same culprit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['ranks']} | {r['capture_s']} | {r['bundle_bytes']} | "
              f"{r['rank0_bytes']} | {r['other_rank_bytes']} | {r['tape_bytes_rank0']} | "
              f"{r['lockstep_s']} | {r['alone_s']} | {'yes' if r['same_culprit'] else 'NO'}: "
              f"rank {r['culprit'][0]}, {r['culprit'][2]} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
