"""Benchmark: per-step overhead of `nanbisect.Guard` against a plain training loop (issues 2, 29).

What the numbers are: wall-clock (``--clock cpu``: CPU) time of one training step (zero_grad,
forward, backward, AdamW step) of a GPT on CPU (fixtures/tasks/tinygpt.py: the tests' GPT, built
bigger; its ``plain_step`` is the plain loop) at ``--size default`` (5.0M parameters, batch 8x256)
or ``tiny`` (0.5M parameters, batch 8x64), with ``--threads`` torch threads (2). Four sides on
identical model copies built from the same seed, interleaved round by round in one process (each
round runs every side for a block of ``--block`` steps (5) on the same batches, the order rotating,
so drift (thermal, other load, allocator warm-up) hits all sides alike; the first step of each block
is not measured: it finds its model's state evicted from the cache by the other sides' steps, where
a training loop, which trains one model, finds it there): the plain loop; `Guard.step` as it ships
(history of 64 steps); `Guard(history=0).step`; and the plain loop's step inside `Guard.watch` (a
custom loop: the gradient-finiteness flag of issue 30 is on every guarded side). The plain step
reads its loss with `.item()`, since `Guard.step` returns the loss as a float. Ratios: of the
medians, and the median of the per-step ratios (paired: the same round and batch). Then the pieces
of the Guard are timed alone (RNG state read, snapshot copy, the one-pass parameter and gradient
norms, the history ring's row, the host sync, the walks of the module tree) beside what was
weighed against them and not used (one flat copy of the same bytes, the copies into one flat
buffer's views, AdamW's one-element steps as one stack), and in real steps: Guard.step's parts
before and after the step, and entering and leaving `Guard.watch`.

What they are not: a GPU figure (on an accelerator the snapshot is a device-to-device copy on a
side stream and the screen waits on the device, which cost differently), a figure for other
optimizers (snapshot cost scales with parameters plus optimizer state, the step with FLOPs),
nor the cost of a failing step (which writes a bundle). On a shared machine the step times are
noisy: run it a few times and read the range, and the pieces, which vary less.

    python scripts/bench_guard.py [--size default|tiny] [--steps 30] [--block 5] [--threads 2]
                                  [--clock wall|cpu] [--batch B] [--seq T] [--scaler]
                                  [--clip 1.0] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import nanbisect
from nanbisect import history as hist
from nanbisect.guard import _Snapshot
from nanbisect.guard.screen import _step_norms
from nanbisect.bundle.state import RngState, accelerator_types

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures" / "tasks"))
import tinygpt  # noqa: E402  (the tests' GPT, built bigger; its plain_step is the baseline)
from tinygpt import plain_step  # noqa: E402

CONFIG = dict(vocab=1000, dim=256, heads=8, n_layers=6, seq=256, batch=8, lr=3e-4,
              weight_decay=0.1, seed=0)
# --size: the default (5.0M parameters, batch 8x256) and tiny (0.5M parameters, batch 8x64:
# a step of tens of milliseconds, where the Guard's fixed costs show)
SIZES = {"default": {}, "tiny": dict(dim=128, heads=4, n_layers=2, seq=64, batch=8)}


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


# what a step's time is read from: wall-clock, or (--clock cpu) this thread's CPU time, which a
# busy machine's other processes do not inflate (with --threads 1 the whole step runs on it)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = CLOCKS["wall"]


def timed(fn) -> tuple[float, object]:
    t0 = CLOCK()
    out = fn()
    return CLOCK() - t0, out


def piece_times(guard: nanbisect.Guard, reps: int) -> dict[str, float]:
    """Median ms of each piece of a healthy guarded step, timed alone on the guarded model (after
    its last step: parameters, gradients and optimizer state as a step leaves them)."""
    task = guard.task
    model, opt = task.model, task.optimizer
    params = list(model.parameters())
    dev = params[0].device
    snap, accel = _Snapshot(side_stream=False), accelerator_types()
    snap.take(model, opt, task.grad_scaler, params)  # the copies, allocated once

    def done(*_):     # on an accelerator: the queued work, finished
        if dev.type != "cpu":
            getattr(torch, dev.type).synchronize()

    def copy():       # what the Guard copies before each step
        snap.take(model, opt, task.grad_scaler, params)
        done()
    # the same bytes as one flat buffer: would a single copy (another layout) be cheaper?
    flat_src = torch.cat([t.detach().reshape(-1) for t in snap._live
                          if t.dtype == torch.float32])
    flat_dst = torch.empty_like(flat_src)
    # the live tensors copied into views of one flat buffer (a Guard-owned layout): is one
    # destination cheaper than a copy per tensor?
    live = [t for t in snap._live if t.dtype == torch.float32]
    views, at = [], 0
    for t in live:
        views.append(flat_dst[at:at + t.numel()].view(t.shape))
        at += t.numel()
    ones = [t for t in live if t.numel() == 1]        # AdamW's step tensors
    ones_copies = [torch.empty_like(t) for t in ones]
    ones_dst = torch.empty(len(ones), device=dev)
    grads = [p.grad for p in params]
    norms = _step_norms(params, grads, dev)
    slots = [torch.zeros((), device=dev)] * 4
    ring = hist.HealthLog(hist.DEFAULT_N, [])
    pieces = {
        "RNG state read": lambda: RngState.get(accel),
        "snapshot copy (parameters, buffers, AdamW state)": copy,
        "the same bytes as one flat copy (not used)": lambda: done(flat_dst.copy_(flat_src)),
        "the live tensors into one flat buffer's views (not used)": lambda: done(
            torch._foreach_copy_(views, live)),
        "the one-element tensors (AdamW's step) alone, one foreach call": lambda: done(
            torch._foreach_copy_(ones_copies, ones) if ones else None),
        "the same as one torch.stack (not used)": lambda: done(
            torch.stack(ones, out=ones_dst) if ones else None),
        "screen: parameter and gradient norms, one pass": lambda: done(
            _step_norms(params, grads, dev)),
        "history: the ring's row (one device copy)": lambda: done(
            ring.record_norms(0, norms, lambda: [])),
        "host sync: the slots read back": lambda: torch.stack(slots).tolist(),
        "model.parameters() (read once per step)": lambda: list(model.parameters()),
        "model.parameters() and model.buffers()": lambda: (list(model.parameters()),
                                                           list(model.buffers())),
    }
    try:    # the one walk of both (absent before issue 29's cut: the bench runs either side)
        from nanbisect.guard.snapshot import model_tensors
        pieces["parameters and buffers, one walk (model_tensors, read once per step)"] = \
            lambda: model_tensors(model)
    except ImportError:
        pass
    with torch.no_grad():
        out = {k: 1e3 * statistics.median(timed(f)[0] for _ in range(reps))
               for k, f in pieces.items()}
    print(f"the snapshot copies {len(snap._live)} tensors ({len(ones)} of one element), "
          f"{sum(t.numel() * t.element_size() for t in snap._live) / 1e6:.1f} MB; the screen "
          f"takes {2 * len(params)} norms")
    return out


def in_step_times(guard: nanbisect.Guard, batches: list, reps: int) -> dict[str, float]:
    """Median ms of Guard.step's own parts inside real steps (the RNG read and snapshot
    before the step, the screen after it), and of entering and leaving `Guard.watch` around the
    plain loop's step."""
    times: dict[str, list[float]] = {"begin": [], "end": []}
    saved = {k: getattr(guard, f"_{k}") for k in ("begin", "end")}

    def timer(key, fn):
        def run(*a, **kw):
            t0 = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                times[key].append(CLOCK() - t0)
        return run
    guard._begin, guard._end = timer("begin", saved["begin"]), timer("end", saved["end"])
    try:
        for i in range(reps):
            guard.step(batches[i % len(batches)])
    finally:
        del guard._begin, guard._end
    task, enter, leave = guard.task, [], []
    for i in range(reps):
        b = batches[i % len(batches)]
        cm = guard.watch(b)
        t0 = CLOCK()
        cm.__enter__()  # RNG state read + snapshot copy
        t1 = CLOCK()
        plain_step(task, b)
        t2 = CLOCK()
        cm.__exit__(None, None, None)  # screen + gradient flag + sync + bookkeeping
        leave.append(CLOCK() - t2)
        enter.append(t1 - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"Guard.step: before the step (RNG, snapshot) (in step)": med["begin"],
            "Guard.step: after the step (screen, flag, history, sync) (in step)": med["end"],
            "watch enter: RNG + snapshot (in step)": 1e3 * statistics.median(enter),
            "watch exit: screen + flag + sync (in step)": 1e3 * statistics.median(leave)}


def summary(ts: list[float]) -> dict:
    ms = [1e3 * t for t in ts]
    return {"median": statistics.median(ms), "mean": statistics.mean(ms),
            "stdev": statistics.stdev(ms), "all": ms}


def watch_step(guard: nanbisect.Guard, batch) -> float:
    """The plain loop's step, guarded by `Guard.watch` (a custom loop)."""
    with guard.watch(batch):
        loss = plain_step(guard.task, batch)
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="default",
                    help="the model and batch (tiny: 0.5M parameters, batch 8x64)")
    ap.add_argument("--steps", type=int, default=30, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    ap.add_argument("--block", type=int, default=5,
                    help="steps per side in a row in each round; the first of each block is not "
                         "measured (1: one step per side per round, all measured)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (the size's)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (the size's)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall-clock time, or this thread's CPU time (with --threads 1: robust "
                         "to other load on the machine)")
    ap.add_argument("--scaler", action="store_true",
                    help="a GradScaler on every side (the plain loop runs the AMP recipe)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX",
                    help="clip_grad_norm_ to MAX on every side")
    ap.add_argument("--device", default="cpu", help="where the model trains (cuda: a GPU)")
    ap.add_argument("--no-snapshot-stream", action="store_true",
                    help="Guard(snapshot_stream=False): the pre-step copy on the current stream")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    cfg = dict(CONFIG, **SIZES[args.size], scaler=args.scaler, clip=args.clip,
               device=args.device)
    cfg.update({k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None})

    names = ["plain", "Guard.step", "Guard.step, history=0", "Guard.watch"]
    tasks = {name: make_task(cfg) for name in names}   # same seed: identical weights
    assert all(torch.equal(a, b) for t in tasks.values() for a, b in
               zip(tasks["plain"].model.parameters(), t.model.parameters()))
    n_params = sum(p.numel() for p in tasks["plain"].model.parameters())
    batches = [{k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in
                tinygpt.make_batch(1 + i, pad=0, batch=cfg["batch"], seq=cfg["seq"],
                                   vocab=cfg["vocab"]).items()} for i in range(8)]

    times: dict[str, list[float]] = {name: [] for name in names}
    same_loss = True
    with tempfile.TemporaryDirectory() as out:
        guards = {name: nanbisect.Guard(
            tasks[name], entry="scripts/bench_guard.py:make_task", out=out,
            snapshot_stream=not args.no_snapshot_stream,
            **({"history": 0} if "history=0" in name else {})) for name in names[1:]}
        runs = {"plain": lambda b: plain_step(tasks["plain"], b),
                "Guard.step": guards["Guard.step"].step,
                "Guard.step, history=0": guards["Guard.step, history=0"].step,
                "Guard.watch": lambda b: watch_step(guards["Guard.watch"], b)}
        k = args.block
        rounds = args.warmup + -(-args.steps // max(1, k - 1))
        for i in range(rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            losses: dict[int, set] = {}
            for name in order:
                for j in range(k):      # the same batches on every side
                    b = batches[(i * k + j) % len(batches)]
                    dt, loss = timed(lambda: runs[name](b))
                    losses.setdefault(j, set()).add(loss)
                    if i >= args.warmup and (j > 0 or k == 1):
                        times[name].append(dt)
            same_loss &= all(len(v) == 1 for v in losses.values())
        pieces = piece_times(guards["Guard.step"], reps=max(10, args.steps))
        pieces |= in_step_times(guards["Guard.step"], batches, reps=max(10, args.steps // 2))

    plain = times["plain"]
    med_p = statistics.median(plain)
    res = {
        "config": cfg, "size": args.size, "n_params": n_params, "optimizer": "AdamW",
        "steps": args.steps, "warmup": args.warmup, "block": args.block, "clock": args.clock,
        "load_average": os.getloadavg(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "platform": platform.platform(),
        "processor": platform.processor(), "losses_identical": same_loss, "sides": {},
        "pieces_ms_median": pieces}
    for name in names:
        ts = times[name]
        res["sides"][name] = {
            "ms": summary(ts),
            "ratio_of_medians": statistics.median(ts) / med_p,
            "ratio_paired_median": statistics.median(t / p for p, t in zip(plain, ts))}
    print(f"size {args.size}: {cfg} | params: {n_params:,} | AdamW | torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, load average "
          f"{os.getloadavg()[0]:.1f} | {args.warmup} warm-up rounds, then {len(plain)} measured "
          f"steps per side in blocks of {args.block} (order rotating) | losses identical on "
          f"every side: "
          f"{same_loss}\n")
    print("| side | median ms/step | mean ms/step | stdev ms | x plain (medians) "
          "| x plain (median of paired ratios) |\n|---|---:|---:|---:|---:|---:|")
    for name, r in res["sides"].items():
        ms = r["ms"]
        print(f"| {name} | {ms['median']:.2f} | {ms['mean']:.2f} | {ms['stdev']:.2f} "
              f"| {r['ratio_of_medians']:.4f} | {r['ratio_paired_median']:.4f} |")
    print("\n| Guard piece | median ms | % of plain step |\n|---|---:|---:|")
    for k, v in pieces.items():
        print(f"| {k} | {v:.3f} | {100 * v / (1e3 * med_p):.2f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
