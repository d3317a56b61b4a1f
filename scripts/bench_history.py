"""Benchmark: what `Guard(history=N)` and `Guard(lookback=K)` add to a healthy step (issue 13).

What the numbers are: wall-clock time of one full training step (zero_grad, forward, backward,
AdamW step) of the ~5M-parameter GPT of scripts/bench_guard.py on CPU, for four sides measured in
one process on identical model copies, interleaved round by round (each round runs every side
once on the same batch, the order rotating), so drift hits all sides alike: a plain loop, Guard
without history (``history=0``), Guard as it ships (``history=64``), and Guard with
``lookback=K`` on top (its snapshot refresh every K steps is a full state copy, amortised here
over the measured steps). Overheads are medians of per-round ratios against the plain step; the
bars of issue 13: history at most +0.5 points over Guard without it, lookback at most 3%.
Also timed alone: the screen as Guard computes it now (per-parameter norms) and as it was before
(one sum per parameter), and one lookback snapshot refresh.

What they are not: a GPU figure (there the ring and the snapshot are device-to-device copies and
cost bandwidth, not host time), or other model sizes (the refresh scales with parameters plus
optimizer state, the step with FLOPs).

    python scripts/bench_history.py [--steps 32] [--lookback 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_guard import CONFIG, make_task, plain_step, timed, tinygpt  # noqa: E402

import nanbisect  # noqa: E402
from nanbisect.bundle.lookback import Lookback  # noqa: E402
from nanbisect.bundle.state import local  # noqa: E402
from nanbisect.guard.screen import screen_sum  # noqa: E402

ENTRY = "scripts/bench_guard.py:make_task"


def old_screen(params: list[torch.Tensor], dev) -> torch.Tensor:
    """The screen before issue 13: one float32 sum per parameter."""
    return torch.stack([local(t).sum(dtype=torch.float32).to(dev) for t in params]).sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured rounds")
    ap.add_argument("--lookback", type=int, default=16, help="K of the lookback side")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    batches = [tinygpt.make_batch(1 + i, pad=0, batch=CONFIG["batch"], seq=CONFIG["seq"],
                                  vocab=CONFIG["vocab"]) for i in range(8)]
    tasks = {name: make_task() for name in ("plain", "history=0", "history=64",
                                            f"history=64, lookback={args.lookback}")}
    times: dict[str, list[float]] = {name: [] for name in tasks}
    losses_same = True
    with tempfile.TemporaryDirectory() as out:
        runners = {"plain": lambda b: plain_step(tasks["plain"], b)}
        for name, kw in (("history=0", {"history": 0}), ("history=64", {}),
                         (f"history=64, lookback={args.lookback}",
                          {"lookback": args.lookback})):
            g = nanbisect.Guard(tasks[name], entry=ENTRY, out=out, **kw)
            runners[name] = g.step
        names = list(runners)
        for i in range(args.warmup + args.steps):
            b = batches[i % len(batches)]
            order = names[i % len(names):] + names[:i % len(names)]
            got = {}
            for name in order:
                dt, got[name] = timed(lambda: runners[name](b))
                if i >= args.warmup:
                    times[name].append(dt)
            losses_same &= len(set(got.values())) == 1
    plain = times["plain"]
    res = {"config": CONFIG, "rounds": args.steps, "warmup": args.warmup,
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "platform": platform.platform(), "losses_identical": losses_same, "sides": {}}
    for name in names:
        ts = times[name]
        res["sides"][name] = {
            "median_ms": 1e3 * statistics.median(ts),
            "overhead_pct_paired_median": (100 * statistics.median(
                t / p - 1 for p, t in zip(plain, ts)) if name != "plain" else 0.0)}
    # pieces alone
    model = tasks["history=64"].model
    params = [p.data for p in model.parameters()]
    reps = 20
    res["pieces_ms"] = {
        "screen now (per-parameter norms)": 1e3 * statistics.median(
            timed(lambda: screen_sum(params, params[0].device).item())[0] for _ in range(reps)),
        "screen before (per-parameter sums)": 1e3 * statistics.median(
            timed(lambda: old_screen(params, params[0].device).item())[0] for _ in range(reps)),
    }
    lb, opt = Lookback(args.lookback), tasks["history=64"].optimizer
    res["pieces_ms"]["lookback snapshot refresh (one, on the device)"] = 1e3 * statistics.median(
        timed(lambda: lb._take(0, model, opt, None))[0] for _ in range(5))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT {n_params:,} parameters, AdamW, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.steps} rounds (+{args.warmup} warm-up), "
          f"sides interleaved; identical losses on every side: {losses_same}\n")
    print("| side | median ms/step | overhead vs plain (median of paired ratios) |")
    print("|---|---:|---:|")
    for name, r in res["sides"].items():
        print(f"| {name} | {r['median_ms']:.1f} | {r['overhead_pct_paired_median']:+.2f}% |")
    print("\n| piece (alone) | median ms |\n|---|---:|")
    for k, v in res["pieces_ms"].items():
        print(f"| {k} | {v:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
