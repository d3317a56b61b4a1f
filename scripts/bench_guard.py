"""Benchmark: per-step overhead of `nanbisect.Guard` against a plain training loop (issue 2).

What the numbers are: wall-clock time of one full training step (zero_grad, forward, backward,
AdamW step) of a ~5M-parameter GPT on CPU (fixtures/tasks/tinygpt.py: the tests' GPT, built
bigger; its ``plain_step`` is the plain loop), measured for a plain loop and for `Guard.step`, interleaved in one process on two identical model copies built from the same seed.
Each measured round runs one plain and one guarded step on the same batch, alternating which goes
first, so drift (thermal, other load, allocator warm-up) hits both sides alike. The plain step also
reads its loss with `.item()`, since `Guard.step` returns the loss as a float. Then the pieces of
Guard (RNG state read, pre-step snapshot copy, finite screen) are timed alone in a loop, and
in-step: time spent entering and leaving `Guard.watch` around real training steps.

What they are not: a GPU figure (on an accelerator the snapshot is a device-to-device copy and the
screen waits on the device, which cost differently), a figure for other model sizes or
optimizers (snapshot cost scales with parameters plus optimizer state, the step with FLOPs), nor
the cost of a failing step (which writes a bundle). Medians are the headline; means show outliers.

    python scripts/bench_guard.py [--steps 30] [--batch 8] [--seq 256] [--scaler] [--clip 1.0]
                                  [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import nanbisect
from nanbisect.guard import _screen, _Snapshot
from nanbisect.bundle.state import RngState, accelerator_types

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures" / "tasks"))
import tinygpt  # noqa: E402  (the tests' GPT, built bigger; its plain_step is the baseline)
from tinygpt import plain_step  # noqa: E402

CONFIG = dict(vocab=1000, dim=256, heads=8, n_layers=6, seq=256, batch=8, lr=3e-4,
              weight_decay=0.1, seed=0)


def make_task(cfg: dict = CONFIG) -> nanbisect.Task:
    torch.manual_seed(cfg["seed"])
    dev = torch.device(cfg.get("device", "cpu"))
    model = tinygpt.TinyGPT([torch.nn.GELU() for _ in range(cfg["n_layers"])],
                            vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scaler = (torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10) if cfg.get("scaler")
              else None)
    return nanbisect.Task(model=model, optimizer=opt, loss_fn=tinygpt.lm_loss,
                          grad_scaler=scaler, clip_grad_norm=cfg.get("clip"))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def piece_times(guard: nanbisect.Guard, reps: int) -> dict[str, float]:
    """Median ms of each piece of a healthy guarded step, timed alone on the guarded model."""
    model, opt = guard.task.model, guard.task.optimizer
    params = list(model.parameters())
    snap, accel = _Snapshot(side_stream=False), accelerator_types()
    snap.take(model, opt)  # allocate the copies once, as a warm Guard has
    dev = params[0].device

    def copy():    # the copy itself, finished (on an accelerator: synchronised)
        snap.take(model, opt)
        if dev.type != "cpu":
            getattr(torch, dev.type).synchronize()
    # the same bytes as one flat buffer: would a single copy (another layout) be cheaper?
    flat_src = torch.cat([t.reshape(-1) for t in snap._live if t.dtype == torch.float32])
    flat_dst = torch.empty_like(flat_src)
    pieces = {
        "rng_state_get (alone)": lambda: RngState.get(accel),
        "snapshot copy (alone)": copy,
        "the same bytes as one flat copy (alone, not used)": lambda: (
            flat_dst.copy_(flat_src), dev.type == "cpu" or getattr(torch, dev.type).synchronize()),
        "screen: params+loss, 1 sync (alone)": lambda: torch.stack(
            [torch.zeros(()), _screen([p.data for p in params], params[0].device)]).tolist(),
    }
    return {k: 1e3 * statistics.median(timed(f)[0] for _ in range(reps))
            for k, f in pieces.items()}


def in_step_times(guard: nanbisect.Guard, batches: list, reps: int) -> dict[str, float]:
    """Median ms spent inside `Guard.watch` before and after the body, on real training steps."""
    task, enter, leave = guard.task, [], []
    for i in range(reps):
        cm = guard.watch(batches[i % len(batches)])
        t0 = time.perf_counter()
        w = cm.__enter__()  # RNG state read + snapshot copy
        t1 = time.perf_counter()
        task.optimizer.zero_grad(set_to_none=True)
        w.loss = task.loss_fn(task.model, batches[i % len(batches)])
        w.loss.backward()
        task.optimizer.step()
        t2 = time.perf_counter()
        cm.__exit__(None, None, None)  # screen + host sync + bookkeeping
        leave.append(time.perf_counter() - t2)
        enter.append(t1 - t0)
    return {"watch enter: rng + snapshot (in step)": 1e3 * statistics.median(enter),
            "watch exit: screen + sync (in step)": 1e3 * statistics.median(leave)}


def summary(ts: list[float]) -> dict:
    ms = [1e3 * t for t in ts]
    return {"median": statistics.median(ms), "mean": statistics.mean(ms),
            "stdev": statistics.stdev(ms), "all": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps per side")
    ap.add_argument("--batch", type=int, default=CONFIG["batch"])
    ap.add_argument("--seq", type=int, default=CONFIG["seq"], help="tokens per sequence")
    ap.add_argument("--scaler", action="store_true",
                    help="a GradScaler on both sides (the plain loop runs the AMP recipe)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX",
                    help="clip_grad_norm_ to MAX on both sides")
    ap.add_argument("--device", default="cpu", help="where the model trains (cuda: a GPU)")
    ap.add_argument("--no-snapshot-stream", action="store_true",
                    help="Guard(snapshot_stream=False): the pre-step copy on the current stream")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    cfg = dict(CONFIG, batch=args.batch, seq=args.seq, scaler=args.scaler, clip=args.clip,
               device=args.device)

    plain = make_task(cfg)
    guarded = make_task(cfg)  # same seed: identical weights
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(),
                                                 guarded.model.parameters()))
    n_params = sum(p.numel() for p in plain.model.parameters())
    batches = [{k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in
                tinygpt.make_batch(1 + i, pad=0, batch=cfg["batch"], seq=cfg["seq"],
                                   vocab=cfg["vocab"]).items()} for i in range(8)]

    t_plain, t_guard, same_loss = [], [], True
    with tempfile.TemporaryDirectory() as out:
        guard = nanbisect.Guard(guarded, entry="scripts/bench_guard.py:make_task", out=out,
                                snapshot_stream=not args.no_snapshot_stream)
        for i in range(args.warmup + args.steps):
            b = batches[i % len(batches)]
            order = [("plain", lambda: plain_step(plain, b)), ("guard", lambda: guard.step(b))]
            losses = {}
            for side, fn in (order if i % 2 == 0 else order[::-1]):
                dt, losses[side] = timed(fn)
                if i >= args.warmup:
                    (t_plain if side == "plain" else t_guard).append(dt)
            same_loss &= losses["plain"] == losses["guard"]
        pieces = piece_times(guard, reps=max(10, args.steps))
        pieces |= in_step_times(guard, batches, reps=max(10, args.steps // 2))

    med_p, med_g = statistics.median(t_plain), statistics.median(t_guard)
    res = {
        "config": cfg, "n_params": n_params, "optimizer": "AdamW", "steps": args.steps,
        "warmup": args.warmup, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "platform": platform.platform(), "processor": platform.processor(),
        "plain_ms": summary(t_plain), "guard_ms": summary(t_guard),
        "overhead_pct_median": 100 * (med_g / med_p - 1),
        "overhead_pct_mean": 100 * (statistics.mean(t_guard) / statistics.mean(t_plain) - 1),
        "overhead_pct_paired_median": 100 * statistics.median(
            g_ / p_ - 1 for p_, g_ in zip(t_plain, t_guard)),
        "pieces_ms_median": pieces, "losses_identical": same_loss,
    }
    print(f"config: {cfg} | params: {n_params:,} | AdamW | torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads | {args.warmup} warm-up + {args.steps} measured "
          f"steps per side, interleaved | plain and guarded losses identical: {same_loss}\n")
    print("| loop | median ms/step | mean ms/step | stdev ms |\n|---|---:|---:|---:|")
    for name, key in (("plain", "plain_ms"), ("Guard.step", "guard_ms")):
        r = res[key]
        print(f"| {name} | {r['median']:.1f} | {r['mean']:.1f} | {r['stdev']:.1f} |")
    print(f"\noverhead (median guarded / median plain - 1): {res['overhead_pct_median']:+.2f}%"
          f"  (mean-based {res['overhead_pct_mean']:+.2f}%, "
          f"median of paired ratios {res['overhead_pct_paired_median']:+.2f}%)\n")
    print("| Guard piece | median ms | % of plain step |\n|---|---:|---:|")
    for k, v in pieces.items():
        print(f"| {k} | {v:.2f} | {100 * v / (1e3 * med_p):.2f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
