"""Triage a night of bundles: each replay in a fresh interpreter, then forked from each worker's
fork server, then again from the cache; side by side in one run.

The night: every shipped fixture bundle (plus a corrupted one), or with ``--bundles N`` N
distinct bundles of the fixtures' `healthy` task (captured here, one per training step, so no two
are copies that triage would replay once). Each run is a fresh `nanbisect triage` process;
``NANBISECT_TRIAGE_FORK=0`` is the fresh-interpreter-per-bundle way triage worked before its
workers kept a fork server. Prints the wall times (interpreter and torch start-up included),
the exit codes, and the number of bundles, signatures and errors.
Usage: python scripts/bench_triage.py [--jobs 2] [--bundles 20]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fixtures(night: Path) -> None:
    for b in sorted((ROOT / "fixtures" / "bundles").iterdir()):
        if b.is_dir() and not b.name.startswith("."):
            shutil.copytree(b, night / b.name, ignore=shutil.ignore_patterns("nanbisect-report"))
    shutil.copytree(night / "healthy", night / "corrupted")
    (night / "corrupted" / "model.safetensors").write_bytes(b"cut")


def _captured(night: Path, n: int) -> None:
    os.chdir(ROOT)                      # the entry is recorded relative to the repository root
    sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))
    import healthy

    import nanbisect

    task, batches = healthy.task(), healthy.batches()
    guard = nanbisect.Guard(task, entry="fixtures/tasks/healthy.py:task", out=night / ".scratch")
    for step in range(n):
        nanbisect.capture(task, next(batches), night / f"step{step:03d}",
                          entry="fixtures/tasks/healthy.py:task", step=step)
        guard.step(next(batches))
    shutil.rmtree(night / ".scratch", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--bundles", type=int, default=0,
                    help="N distinct bundles of the healthy task instead of the fixtures")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        night = Path(d) / "night"
        _captured(night, a.bundles) if a.bundles else _fixtures(night)
        rows = []
        runs = [("a fresh interpreter per bundle", "0", True),
                ("forked from each worker's server", "1", True),
                ("again, from the cache", "1", False)]
        for label, fork, fresh in runs:
            out = Path(d) / "out"
            if fresh:
                shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "nanbisect", "triage", str(night),
                                "--out", str(out), "--jobs", str(a.jobs), "--json"],
                               capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "NANBISECT_TRIAGE_FORK": fork})
            data = json.loads(p.stdout)
            rows.append((label, time.monotonic() - t0, p.returncode, len(data["bundles"]),
                         len(data["signatures"]), len(data["errors"])))
    print(f"| run (--jobs {a.jobs}) | wall s | exit | bundles | signatures | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |")


if __name__ == "__main__":
    main()
