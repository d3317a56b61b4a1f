"""Benchmark: what a compiled capture adds to a run (issue 26): the compiled replay and torch's
compiler bisection.

The workload is tests/tasks/compiled_faults.py's planted compiler fault (a custom softmax whose
decomposition in inductor's table drops the max), trained under ``torch.compile`` (inductor,
CPU). This script captures its failing step with `nanbisect.Guard`, then runs ``python -m
nanbisect run B --no-remedies`` in a fresh interpreter ``--reps`` times and prints, per rep and
as medians, the CLI's wall time and report.json's ``timings``: ``compiled`` (the step replayed
compiled), ``compiler-bisect`` (the bisection's child: building the task, one compile per
bisection step, attributing the op), ``repro`` (the module repro's one run), and the passes an
eager run has anyway (``build``, ``module-pass``). The machine's load average is printed before
and after, as docs/BENCHMARKS.md records it. The first rep pays inductor's cold caches when the
capture did not (the capture compiles the same graph, so usually it does not).

    python scripts/bench_compiler.py [--reps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "tasks"


def capture(out: Path) -> Path:
    sys.path.insert(0, str(TASKS))
    import compiled_faults as cf

    import nanbisect

    guard = nanbisect.Guard(cf.task(), entry=f"{TASKS / 'compiled_faults.py'}:task", out=out)
    try:
        guard.step(cf.batch())
    except nanbisect.NonFiniteStep as e:
        return Path(e.bundle)
    raise SystemExit("the planted fault did not fail compiled: no bundle")


def run_once(bundle: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "nanbisect", "run", str(bundle), "--out", str(out),
                        "--no-remedies"], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 1:
        raise SystemExit(f"run exited {p.returncode}: {p.stderr[-2000:]}")
    r = json.loads((out / "report.json").read_text())
    return {"wall": wall, "classification": r["classification"], "compiler": r["compiler"],
            **{k: v for k, v in r["timings"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-compiler-") as d:
        t0 = time.perf_counter()
        bundle = capture(Path(d) / "bundles")
        print(f"capture (one compiled step, inductor): {time.perf_counter() - t0:.1f} s",
              flush=True)
        rows = []
        for i in range(a.reps):
            row = run_once(bundle, Path(d) / f"report{i}")
            rows.append(row)
            print(f"rep {i}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items()
                                           if isinstance(v, float)), flush=True)
    keys = [k for k in rows[0] if isinstance(rows[0][k], float)]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    print("median: " + ", ".join(f"{k} {v:.1f} s" for k, v in med.items()))
    print(f"compiler finding: {rows[-1]['compiler']}")
    print(f"load average after: {os.getloadavg()}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "median": med}, indent=1))


if __name__ == "__main__":
    main()
