"""Benchmark: CLI start-up and usage errors. ``nanbisect --help``, ``-h`` and ``--version``
against ``python -c "import torch"`` (issue 9; bar: under 0.4x), and the answers to usage errors
(a missing bundle, a file for a bundle, an unknown command, a bad flag value, a mistyped flag, a
malformed device string: issue 28; bar: under 0.5 s, exit code 2, torch not imported), measured
side by side in one run. The command line is typer's: its import, and pydantic's where typer
converts values with it, is in every one of these.

What the numbers are: wall time of a fresh interpreter running each command, from process start to
exit, ``--reps`` rounds, the commands interleaved (the order alternates each round, so drift hits
all alike), after one unmeasured warm-up round (page cache), and the CPU time (user + system) the
process used, which a loaded machine inflates far less than the wall time. Also ``python -c pass``
(the floor: interpreter start-up alone). ``--compare DIR`` runs every nanbisect command a second
time with DIR's nanbisect (``PYTHONPATH=DIR``, e.g. a checkout of an older commit): both columns
in one run. What they are not: the time of ``nanbisect run`` on a real bundle (that imports
torch, builds the model and replays; see bench_bisect.py).

    python scripts/bench_cli.py [--reps 15] [--compare /path/to/other/checkout] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A_FILE = os.path.join(HERE, "pyproject.toml")          # a file where a bundle directory belongs
A_DIR = os.path.join(HERE, "fixtures", "tasks")         # a directory that is not a bundle
NB = [sys.executable, "-m", "nanbisect"]
# NB: `python -m` looks in the working directory first: run in an empty one, so PYTHONPATH picks
CWD = tempfile.mkdtemp(prefix="bench_cli-")
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "nanbisect --help": [*NB, "--help"],
    "nanbisect -h": [*NB, "-h"],
    "nanbisect --version": [*NB, "--version"],
    "nanbisect run --help": [*NB, "run", "--help"],
}
# usage errors: exit code 2, one line on stderr
ERRORS = {
    "nanbisect run nope/step000001": [*NB, "run", "nope/step000001"],
    "nanbisect run FILE": [*NB, "run", A_FILE],
    "nanbisect run DIR-NOT-A-BUNDLE": [*NB, "run", A_DIR],
    "nanbisect frob": [*NB, "frob"],
    "nanbisect run --steps x B": [*NB, "run", "--steps", "x", "nope"],
    "nanbisect run --refrence cpu B": [*NB, "run", "--refrence", "cpu", "nope"],   # did you mean
    "nanbisect inspect nope": [*NB, "inspect", "nope"],
    "nanbisect triage nope": [*NB, "triage", "nope"],
    "nanbisect pack nope": [*NB, "pack", "nope"],
}
TORCH, BAR, ERROR_BAR = 'python -c "import torch"', 0.4, 0.5


def once(cmd: list[str], env: dict | None = None, code: int = 0) -> tuple[float, float]:
    """(wall s, CPU s) of one run of ``cmd``, which must exit with ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=CWD)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != code:
        raise SystemExit(f"{cmd}: exit {p.returncode}, expected {code}: {p.stderr[-500:]!r}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports_torch(cmd: list[str], env: dict | None = None) -> bool:
    """Does the command import torch? (``-X importtime`` lists every module imported.)"""
    p = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True,
                       env=env, cwd=CWD)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in p.stderr.splitlines()
               if line.startswith("import time:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--compare", metavar="DIR", help="another checkout, run side by side")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    sides = {"this": {**os.environ, "PYTHONPATH": HERE}}
    if args.compare:
        sides["compare"] = {**os.environ, "PYTHONPATH": os.path.abspath(args.compare)}
    runs = {}       # (name, side) -> (command, env, expected exit code)
    for name, cmd in {**COMMANDS, **ERRORS}.items():
        for side, env in sides.items():
            if side == "this" or name.startswith("nanbisect"):
                runs[name, side] = (cmd, env, 2 if name in ERRORS else 0)
    keys = list(runs)
    wall: dict = {k: [] for k in keys}
    cpu: dict = {k: [] for k in keys}
    for i in range(args.reps + 1):
        for k in (keys if i % 2 else keys[::-1]):
            w, c = once(*runs[k][:2], code=runs[k][2])
            if i:
                wall[k].append(w)
                cpu[k].append(c)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    torch_s = med[TORCH, "this"]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the end; {args.reps} rounds, interleaved\n")
    print("| command | side | median ms | median CPU ms | x `import torch` | imports torch | bar "
          "|\n|---|---|---:|---:|---:|---|---|")
    for name, side in keys:
        k = (name, side)
        if name in ERRORS:
            verdict = f"< {ERROR_BAR} s: {'met' if med[k] < ERROR_BAR else 'missed'}"
        elif name in ("nanbisect --help", "nanbisect -h", "nanbisect --version"):
            verdict = f"< {BAR}x: {'met' if med[k] / torch_s < BAR else 'missed'}"
        else:
            verdict = ""
        print(f"| `{name}` | {side} | {1e3 * med[k]:.0f} | {1e3 * med_cpu[k]:.0f} | "
              f"{med[k] / torch_s:.2f}x | {'yes' if imports_torch(*runs[k][:2]) else 'no'} | "
              f"{verdict} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": {f"{n} [{s}]": v for (n, s), v in wall.items()},
                       "cpu_s": {f"{n} [{s}]": v for (n, s), v in cpu.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
