"""Benchmark: CLI start-up. ``nanbisect --help``, ``-h`` and ``--version`` against
``python -c "import torch"``, measured side by side in one run (issue 9; bar: under 0.4x).

What the numbers are: wall time of a fresh interpreter running each command, from process start to
exit, ``--reps`` rounds, the commands interleaved (the order alternates each round, so drift hits
all alike), after one unmeasured warm-up round (page cache). Also ``python -c pass`` (the floor:
interpreter start-up alone) and, for context, the CLI's ``run --help``. What they are not: the
time of ``nanbisect run`` (that imports torch, builds the model and replays; see bench_bisect.py).

    python scripts/bench_cli.py [--reps 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "nanbisect --help": [sys.executable, "-m", "nanbisect", "--help"],
    "nanbisect -h": [sys.executable, "-m", "nanbisect", "-h"],
    "nanbisect --version": [sys.executable, "-m", "nanbisect", "--version"],
    "nanbisect run --help": [sys.executable, "-m", "nanbisect", "run", "--help"],
}
TORCH, BAR = 'python -c "import torch"', 0.4


def once(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def imports_torch(cmd: list[str]) -> bool:
    """Does the command import torch? (``-X importtime`` lists every module imported.)"""
    p = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True)
    return any(line.rstrip().endswith("| torch") for line in p.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    names = list(COMMANDS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.reps + 1):
        for name in (names if i % 2 else names[::-1]):
            dt = once(COMMANDS[name])
            if i:
                times[name].append(dt)
    med = {n: statistics.median(v) for n, v in times.items()}
    torch_ms = med[TORCH]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; {args.reps} rounds, interleaved\n")
    print("| command | median ms | x `import torch` | imports torch | bar |\n|---|---:|---:|---|---|")
    for n in names:
        barred = n in ("nanbisect --help", "nanbisect -h", "nanbisect --version")
        verdict = (f"< {BAR}x: {'met' if med[n] / torch_ms < BAR else 'missed'}" if barred
                   else "")
        print(f"| `{n}` | {1e3 * med[n]:.0f} | {med[n] / torch_ms:.2f}x | "
              f"{'yes' if imports_torch(COMMANDS[n]) else 'no'} | {verdict} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times_s": times, "median_s": med}, f, indent=1)


if __name__ == "__main__":
    main()
