"""Benchmark: the cost of `nanbisect run --steps K` as a multiple of K plain training steps
(issue 13).

What the numbers are: a ~5M-parameter GPT (scripts/bench_guard.py's) trained under
`Guard(lookback=K)` until a learning-rate jump makes it fail; then, in the same process, the
median of K plain steps of the same model, and the wall time of `run_bundle(--steps K,
--reference cpu)` split at its progress stages: the window (K steps on the target and on the
reference, plus one host copy of the state per step) and the bisection that follows (the
failing step's single-step passes, as `run` without --steps). The repro's subprocess is not run.

    python scripts/bench_steps.py [--k 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_guard import CONFIG, make_task, plain_step, timed, tinygpt  # noqa: E402

import nanbisect  # noqa: E402
from nanbisect.pipeline import RunOptions, run_bundle  # noqa: E402

ENTRY = "scripts/bench_guard.py:make_task"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=8, help="steps to replay")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    k = args.k
    batches = [tinygpt.make_batch(1 + i, pad=0, batch=CONFIG["batch"], seq=CONFIG["seq"],
                                  vocab=CONFIG["vocab"]) for i in range(8)]
    with tempfile.TemporaryDirectory() as d:
        guard = nanbisect.Guard(make_task(), entry=ENTRY, out=Path(d) / "b", lookback=k)
        bundle = None
        for i in range(10 * k):
            if i == k + 2:
                for g in guard.task.optimizer.param_groups:
                    g["lr"] = 1e30
            try:
                guard.step(batches[i % len(batches)])
            except nanbisect.NonFiniteStep as e:
                bundle = e.bundle
                break
        assert bundle is not None, "the learning-rate jump must make the run fail"
        plain = make_task()
        for i in range(2):            # warm-up: allocator, first-call costs
            plain_step(plain, batches[i])
        step_s = statistics.median(timed(lambda: plain_step(plain, batches[i % 8]))[0]
                                   for i in range(k))
        marks: list[tuple[str, float]] = []
        t0 = time.perf_counter()
        report = run_bundle(bundle, RunOptions(steps=k, reference="cpu", run_repro=False),
                            Path(d) / "r", lambda key, text: marks.append((key,
                                                                           time.perf_counter())))
        total = time.perf_counter() - t0
    window_end = next((t for key, t in marks if key == "build"), t0 + total)
    window = window_end - t0
    res = {"k": k, "plain_step_s": step_s, "run_steps_s": total, "window_s": window,
           "bisect_s": total - window, "x_k_plain_steps": total / (k * step_s),
           "window_x_k_plain_steps": window / (k * step_s), "verdict": report.verdict,
           "replayed": len(report.steps["replayed"]), "threads": torch.get_num_threads()}
    print(f"K={k}: plain step {1e3 * step_s:.0f} ms; run --steps {k}: {total:.1f} s = "
          f"{res['x_k_plain_steps']:.1f} x K plain steps (window {window:.1f} s = "
          f"{res['window_x_k_plain_steps']:.1f} x; bisection after it {total - window:.1f} s); "
          f"verdict {report.verdict}, {res['replayed']} steps replayed")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
