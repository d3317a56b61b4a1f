"""Triage a night's worth of fixture bundles twice: the second run answers from the cache.

Copies every shipped fixture bundle (plus a corrupted one) into a temporary directory, runs
`nanbisect triage` on it twice in fresh processes, and prints both wall times (interpreter and
torch start-up included), the exit codes, and the number of signatures and errors.
Usage: python scripts/bench_triage.py [--jobs 2]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        night = Path(d) / "night"
        for b in sorted((ROOT / "fixtures" / "bundles").iterdir()):
            if b.is_dir() and not b.name.startswith("."):
                shutil.copytree(b, night / b.name,
                                ignore=shutil.ignore_patterns("nanbisect-report"))
        shutil.copytree(night / "healthy", night / "corrupted")
        (night / "corrupted" / "model.safetensors").write_bytes(b"cut")
        rows = []
        for label in ("first run", "second run (cache)"):
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "nanbisect", "triage", str(night),
                                "--out", str(Path(d) / "out"), "--jobs", str(a.jobs), "--json"],
                               capture_output=True, text=True)
            data = json.loads(p.stdout)
            rows.append((label, time.monotonic() - t0, p.returncode, len(data["bundles"]),
                         len(data["signatures"]), len(data["errors"])))
    print("| run | wall s | exit | bundles | signatures | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |")


if __name__ == "__main__":
    main()
