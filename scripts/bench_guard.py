"""Benchmark: per-step overhead and memory of `nanbisect.Guard` against a plain training loop
(issues 2, 29, 40).

What the numbers are: wall-clock (``--clock cpu``: CPU) time of one training step (zero_grad,
forward, backward, AdamW step) of a GPT on CPU (fixtures/tasks/tinygpt.py: the tests' GPT, built
bigger; its ``plain_step`` is the plain loop) at ``--size default`` (5.0M parameters, batch 8x256)
or ``tiny`` (0.5M parameters, batch 8x64), or of an MLP at ``mlp25m`` (below), with ``--threads``
torch threads (2). Five sides on identical model copies built from the same seed, interleaved
round by round in one process (each round runs every side for a block of ``--block`` steps (5) on
the same batches, the order rotating, so drift (thermal, other load, allocator warm-up) hits all
sides alike; the first step of each block is not measured: it finds its model's state evicted from
the cache by the other sides' steps, where a training loop, which trains one model, finds it
there): the plain loop; `Guard.step` as it ships (issue 40's default ``snapshot="rebuild"``,
history of 64 steps: the step read once just before its update, per step a copy of the buffers
and the GradScaler's scale only, the step's record (RNG, groups, a copy of the batch), and a
snapshot of parameters and optimizer state every K steps, K chosen so that it costs <= 0.2% of a
step); `Guard(history=0).step`; `Guard(snapshot="every-step").step` (the former exact copy of
the whole state before every step); and the plain loop's step inside `Guard.watch` (a custom
loop, read from the optimizer's step pre-hook). Every guarded side's Guard is closed at the end
(`Guard.close`: the snapshot file removed). The plain step reads its loss with `.item()`, since
`Guard.step` returns the loss as a float. Ratios: of the medians, and the median of the per-step
ratios (paired: the same round and batch); the bars (issue 40): `Guard.step` <= 1.03x plain at
``tiny`` and <= 1.01x at ``default`` (an idle machine, medians of interleaved steps). A median
leaves the K-step snapshot out (one step in K): it is timed alone below, and amortised by K.
Then the pieces of the Guard are timed alone: the RNG state read, the per-step copy
(`Snapshot.take_early`: buffers, scaler scale), the step's record (`Keeper.record`), the K-step
snapshot (`Keeper.take`: a safetensors file write on the CPU), alone and divided by K, the
one-pass parameter and gradient norms, the history ring's row, the host sync, the walks of the
module tree, and every-step mode's copy (`Snapshot.take`) for comparison; and in real steps:
`Guard.step`'s parts (`_begin`, `_before_update`, `_end`), and entering, reading (the pre-hook)
and leaving `Guard.watch`.

What they are not: a GPU figure (on an accelerator the K-step snapshot goes to pinned host
memory, every-step mode's copy is a device-to-device copy on a side stream, and the screen waits
on the device, which cost differently), a figure for other optimizers (snapshot cost scales with
parameters plus optimizer state, the step with FLOPs), nor the cost of a failing step (which
writes a bundle, and after an update that went non-finite rebuilds its pre-state by replaying up
to K steps). On a shared machine the step times are noisy: run it a few times and read the range,
and the pieces, which vary less.

``--memory`` (issue 40) measures memory instead of time: (1) the bytes of the parameters and the
optimizer state (AdamW: two moments and a step per parameter); (2) the bytes of the tensors the
Guard itself holds in memory after ``--mem-steps`` steps (its attributes walked for tensors, one
count per storage, the model's and optimizer's own tensors left out: the per-step copies, the
kept steps' batches, the history's ring, anything else), as a multiple of (1); (3) from outside,
the resident memory (VmRSS, VmHWM of /proc/self/status) of ``--mem-steps`` steps of each side
(plain, Guard.step, history=0, every-step, Guard.watch), each side in a fresh process of its own
(this script, re-invoked), so that no two share an allocator: the growth of each guarded side's
RSS over the steps minus the plain loop's (as read, after glibc's ``malloc_trim`` has handed back
free heap pages (the stable figure: the heap keeps freed activations, in which a copy may land),
and in anonymous pages only), and its peak minus the plain loop's, as multiples of (1), against
issue 40's bar of 0.10x (trimmed). On the CPU the default Guard's K-step snapshot is a file, not
memory: it is not in (2) nor in RSS (its pages are in the page cache; on a tmpfs temporary
directory they would be memory all the same): its size, K and the file system it is on are
reported beside the table (K is chosen ``CHOOSE_AFTER`` (4) steps after the first snapshot: with
fewer steps it is not chosen yet).
``--size mlp25m``: an MLP of 25.2M parameters (Linear 2048->4096->2048->4096, GELU, MSE loss,
batch 64) with AdamW, about 288 MiB of parameters and moments (issue 40's model).
``--size features`` / ``features5m`` with ``--batch-ratio R`` (issue 63): the GPT's blocks
(`FeatureNet`: 3 blocks at dim 128, 0.6M parameters, batch 8x64; 6 blocks at dim 256, 4.9M
parameters, batch 8x256) fed float features (frames, patches, embeddings) and a regression
target per position, the features' width chosen so that a batch is R times the parameter +
AdamW state bytes (a width above dim is mean-pooled to it first: the batch grows, the model
does not): where the kept batches, not the model, decide what the Guard writes.

    python scripts/bench_guard.py [--size default|tiny|mlp25m|features|features5m]
                                  [--batch-ratio R] [--steps 30] [--block 5]
                                  [--threads 2] [--clock wall|cpu] [--batch B] [--seq T]
                                  [--scaler] [--clip 1.0] [--json out.json]
    python scripts/bench_guard.py --memory [--size ...] [--mem-steps 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import nanbisect
from nanbisect import history as hist
from nanbisect.bundle.state import RngState, accelerator_types
from nanbisect.guard.keep import CHOOSE_AFTER, Keeper
from nanbisect.guard.screen import step_norms
from nanbisect.guard.snapshot import Snapshot, model_tensors
from nanbisect.guard.freeze import scaler_state

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures" / "tasks"))
import tinygpt  # noqa: E402  (the tests' GPT, built bigger; its plain_step is the baseline)
from tinygpt import plain_step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.held import (_storage, count_takes, guard_tensors,  # noqa: E402  (a Guard holds)
                          state_storages)

CONFIG = dict(vocab=1000, dim=256, heads=8, n_layers=6, seq=256, batch=8, lr=3e-4,
              weight_decay=0.1, seed=0)
# --size: the default (5.0M parameters, batch 8x256) and tiny (0.5M parameters, batch 8x64:
# a step of tens of milliseconds, where the Guard's fixed costs show)
# mlp25m (issue 40): Linear 2048->4096->2048->4096 with GELU between, 25.2M parameters, batch 64
# (about 288 MiB of parameters and AdamW moments)
SIZES = {"default": {}, "tiny": dict(dim=128, heads=4, n_layers=2, seq=64, batch=8),
         "mlp25m": dict(model="mlp", widths=(2048, 4096, 2048, 4096), batch=64),
         # float features (frames, patches, embeddings) in, one regression target per position
         # out: the batch's bytes set by its width (--batch-ratio), the model fixed
         "features": dict(model="features", dim=128, heads=4, n_layers=3, seq=64, batch=8,
                          width=128),
         "features5m": dict(model="features", dim=256, heads=8, n_layers=6, seq=256, batch=8,
                            width=256)}


class FeatureNet(torch.nn.Module):
    """The GPT's blocks over float features (B, T, width): a width above ``dim`` is pooled to
    ``dim`` first (a parameter-free front end, as audio or image patches are downsampled), so
    the batch's bytes change and the model does not; a regression target per position."""

    def __init__(self, width: int, dim: int, heads: int, n_layers: int) -> None:
        super().__init__()
        self.pool = width // dim if width > dim else 1
        self.inp = torch.nn.Linear(min(width, dim), dim)
        self.blocks = torch.nn.ModuleList(tinygpt.Block(torch.nn.GELU(), 0.0, dim, heads)
                                          for _ in range(n_layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, W = x.shape
        if self.pool > 1:
            x = x.view(B, T, W // self.pool, self.pool).mean(-1)
        h = self.inp(x)
        mask = torch.zeros(B, 1, 1, T, device=x.device)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln_f(h)).squeeze(-1)


def mlp_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def features_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def state_bytes_of(model: torch.nn.Module) -> int:
    """Parameters and AdamW's two moments, in bytes (the state a snapshot holds)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def width_for_ratio(cfg: dict, ratio: float) -> int:
    """The feature width whose batch (x and y, float32) is nearest ``ratio`` times the state's
    bytes (a width above ``dim``: a multiple of it, pooled)."""
    import math

    dim, rows = cfg["dim"], cfg["batch"] * cfg["seq"]
    blocks = state_bytes_of(torch.nn.ModuleList(
        tinygpt.Block(torch.nn.GELU(), 0.0, dim, cfg["heads"]) for _ in range(cfg["n_layers"])))

    def ratio_of(w: int) -> float:
        return rows * (w + 1) * 4 / (blocks + state_bytes_of(FeatureNet(w, dim, 1, 0)))
    widths = list(range(1, dim + 1)) + [dim * k for k in range(2, 257)]
    return min(widths, key=lambda w: abs(math.log(ratio_of(w) / ratio)))


def batch_bytes(batch) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values()
               if isinstance(v, torch.Tensor))


def make_task(cfg: dict = CONFIG) -> nanbisect.Task:
    torch.manual_seed(cfg["seed"])
    dev = torch.device(cfg.get("device", "cpu"))
    if cfg.get("model") == "mlp":
        w = cfg["widths"]
        layers: list = []
        for i in range(len(w) - 1):
            layers += [torch.nn.Linear(w[i], w[i + 1])] + [torch.nn.GELU()] * (i < len(w) - 2)
        model, loss_fn = torch.nn.Sequential(*layers).to(dev), mlp_loss
    elif cfg.get("model") == "features":
        model = FeatureNet(cfg["width"], cfg["dim"], cfg["heads"], cfg["n_layers"]).to(dev)
        loss_fn = features_loss
    else:
        model = tinygpt.TinyGPT([torch.nn.GELU() for _ in range(cfg["n_layers"])],
                                vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"]).to(dev)
        loss_fn = tinygpt.lm_loss
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scaler = (torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10) if cfg.get("scaler")
              else None)
    return nanbisect.Task(model=model, optimizer=opt, loss_fn=loss_fn,
                          grad_scaler=scaler, clip_grad_norm=cfg.get("clip"))


def make_batches(cfg: dict, device: str, n: int = 8) -> list[dict]:
    """``n`` batches of the size's task, on ``device``."""
    if cfg.get("model") == "mlp":
        g = torch.Generator().manual_seed(1)
        w = cfg["widths"]
        return [{"x": torch.randn(cfg["batch"], w[0], generator=g).to(device),
                 "y": torch.randn(cfg["batch"], w[-1], generator=g).to(device)}
                for _ in range(n)]
    if cfg.get("model") == "features":
        g = torch.Generator().manual_seed(1)
        shape = (cfg["batch"], cfg["seq"])
        return [{"x": torch.randn(*shape, cfg["width"], generator=g).to(device),
                 "y": torch.randn(*shape, generator=g).to(device)} for _ in range(n)]
    return [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in
             tinygpt.make_batch(1 + i, pad=0, batch=cfg["batch"], seq=cfg["seq"],
                                vocab=cfg["vocab"]).items()} for i in range(n)]


# what a step's time is read from: wall-clock, or (--clock cpu) this thread's CPU time, which a
# busy machine's other processes do not inflate (with --threads 1 the whole step runs on it)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
CLOCK = CLOCKS["wall"]


def timed(fn) -> tuple[float, object]:
    t0 = CLOCK()
    out = fn()
    return CLOCK() - t0, out


def piece_times(guard: nanbisect.Guard, reps: int, batch, k: int | None = None,
                every: float | None = None) -> dict[str, float]:
    """Median ms of each piece of a healthy guarded step, timed alone on the guarded model (after
    its last step: parameters, gradients and optimizer state as a step leaves them). ``batch``:
    a step's batch (the record copies it); ``k``: the K of the shipped Guard (the K-step
    snapshot's cost is also shown divided by it); ``every``: the steps between the snapshots
    the shipped Guard took in the run (the kept steps' share of the state can bring one sooner
    than K: `nanbisect.guard.keep.RECORD_SHARE`)."""
    task = guard.task
    model, opt, scaler = task.model, task.optimizer, task.grad_scaler
    params, buffers = model_tensors(model)
    dev = params[0].device
    accel = accelerator_types()

    def done(*_):     # on an accelerator: the queued work, finished
        if dev.type != "cpu":
            getattr(torch, dev.type).synchronize()

    # the default Guard's per-step copy (buffers, the scaler's scale and growth tracker)
    early = Snapshot(side_stream=False)
    early.take_early(opt, scaler, buffers)   # the copies, allocated once
    # every-step mode's whole-state copy (parameters, buffers, AdamW state), for comparison
    whole = Snapshot(side_stream=False)
    whole.take(model, opt, scaler, params, buffers)
    # the K-step snapshot, on a Keeper of its own (the shipped Guard's is left as it is)
    keeper = Keeper(on_host=guard._keeper.on_host if guard._keeper is not None else
                    dev.type == "cpu")
    bufs = early.early_copies(buffers)
    scaler_kept = scaler_state(task)
    rng = RngState.get(accel)
    groups = [{kk: v for kk, v in g.items() if kk != "params"} for g in opt.param_groups]
    at = [0]

    def take_k():     # a snapshot written (a file on the CPU; pinned host memory on a GPU)
        keeper.take(at[0], model, opt, scaler_kept, bufs)
        done()

    def record():     # the step's record: RNG (read), groups and a copy of the batch
        at[0] += 1
        keeper.record(at[0], rng, opt, groups, batch, 1.0, 1.0)

    grads = [p.grad for p in params]
    norms = step_norms(params, grads, dev)
    slots = [torch.zeros((), device=dev)] * 4
    ring = hist.HealthLog(hist.DEFAULT_N, [])
    pieces = {
        "RNG state read": lambda: RngState.get(accel),
        "per-step copy (buffers, scaler scale): Snapshot.take_early": lambda: done(
            early.take_early(opt, scaler, buffers)),
        "per-step record (RNG, groups, batch copy): Keeper.record": record,
        "screen: parameter and gradient norms, one pass": lambda: done(
            step_norms(params, grads, dev)),
        "history: the ring's row (one device copy)": lambda: done(
            ring.record_norms(0, norms, lambda: [])),
        "host sync: the slots read back": lambda: torch.stack(slots).tolist(),
        "model.parameters() and model.buffers()": lambda: (list(model.parameters()),
                                                           list(model.buffers())),
        "parameters and buffers, one walk (model_tensors, once per step)": lambda:
            model_tensors(model),
        "every-step mode's copy (parameters, buffers, AdamW state): Snapshot.take": lambda:
            done(whole.take(model, opt, scaler, params, buffers)),
    }
    try:
        with torch.no_grad():
            take_k()      # the first: a snapshot for the records to follow
            out = {name: 1e3 * statistics.median(timed(f)[0] for _ in range(reps))
                   for name, f in pieces.items()}
            # a file write of the whole state: fewer repetitions
            snap_ms = 1e3 * statistics.median(timed(take_k)[0] for _ in range(min(reps, 7)))
    finally:
        keeper.close()
    snap_name = "K-step snapshot (Keeper.take, file write), once per K steps"
    if dev.type != "cpu":
        snap_name = "K-step snapshot (Keeper.take, to pinned host memory), once per K steps"
    out[snap_name] = snap_ms
    if k:
        out[f"  ... amortised: / K = {k}"] = snap_ms / k
    if every:
        out[f"  ... amortised: / the steps between this run's snapshots = {every:.1f}"] = \
            snap_ms / every
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    print(f"per step: {len(early._early.live)} tensors copied "
          f"({nbytes(early._early.live) / 1e6:.3f} MB); the K-step snapshot: "
          f"{keeper.state_bytes / 1e6:.1f} MB every K = {k} steps; "
          f"every-step mode copies {len(whole._live)} tensors, "
          f"{nbytes(whole._live) / 1e6:.1f} MB; the screen "
          f"takes {2 * len(params)} norms")
    return out


def in_step_times(guard: nanbisect.Guard, batches: list, reps: int) -> dict[str, float]:
    """Median ms of Guard.step's own parts inside real steps (`_begin`: RNG read, per-step copy;
    `_before_update`: the reading, and the K-step snapshot when due; `_end`: the record, the
    history), and of entering, reading (the optimizer's pre-hook) and leaving `Guard.watch`
    around the plain loop's step."""
    names = ("begin", "before_update", "end")
    times: dict[str, list[float]] = {k: [] for k in names}

    def timer(key, fn):
        def run(*a, **kw):
            t0 = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                times[key].append(CLOCK() - t0)
        return run
    for k in names:
        setattr(guard, f"_{k}", timer(k, getattr(guard, f"_{k}")))
    try:
        for i in range(reps):
            guard.step(batches[i % len(batches)])
        step_times = {k: list(v) for k, v in times.items()}
        for v in times.values():
            v.clear()
        task, enter, leave = guard.task, [], []
        for i in range(reps):
            b = batches[i % len(batches)]
            cm = guard.watch(b)
            t0 = CLOCK()
            cm.__enter__()  # _begin: RNG state read + per-step copy
            t1 = CLOCK()
            plain_step(task, b)   # the reading runs in the optimizer's pre-hook
            t2 = CLOCK()
            cm.__exit__(None, None, None)  # _end: record, history, bookkeeping
            leave.append(CLOCK() - t2)
            enter.append(t1 - t0)
    finally:
        for k in names:
            guard.__dict__.pop(f"_{k}", None)
    med = {k: 1e3 * statistics.median(v) if v else float("nan") for k, v in step_times.items()}
    mean_bu = 1e3 * statistics.mean(step_times["before_update"]) \
        if step_times["before_update"] else float("nan")
    hook = times["before_update"]
    return {"Guard.step: _begin (RNG, per-step copy) (in step)": med["begin"],
            "Guard.step: _before_update (screen, sync, history) (in step)":
                med["before_update"],
            "Guard.step: _before_update, mean (with any K-step snapshot) (in step)": mean_bu,
            "Guard.step: _end (record, bookkeeping) (in step)": med["end"],
            "watch enter: _begin (in step)": 1e3 * statistics.median(enter),
            "watch: _before_update in the optimizer's pre-hook (in step)":
                1e3 * statistics.median(hook) if hook else float("nan"),
            "watch exit: _end (in step)": 1e3 * statistics.median(leave)}


def summary(ts: list[float]) -> dict:
    ms = [1e3 * t for t in ts]
    return {"median": statistics.median(ms), "mean": statistics.mean(ms),
            "stdev": statistics.stdev(ms), "all": ms}


def watch_step(guard: nanbisect.Guard, batch) -> float:
    """The plain loop's step, guarded by `Guard.watch` (a custom loop)."""
    with guard.watch(batch):
        loss = plain_step(guard.task, batch)
    return loss


# -- memory (issue 40) -----------------------------------------------------------------------
MiB = 2.0 ** 20
SIDES = ["plain", "Guard.step", "Guard.step, history=0", "Guard.step, every-step",
         "Guard.watch"]
MEM_SIDES = SIDES
TIME_BARS = {"tiny": 1.03, "default": 1.01,   # issue 40: Guard.step's median, x plain
             "features": 1.03, "features5m": 1.01}   # issue 63: batches up to 0.1x the state
MEM_BAR = 0.10      # issue 40's target: the Guard's extra memory, x the parameter + state bytes


def make_guard(side: str, task: nanbisect.Task, out: str, **kw) -> nanbisect.Guard:
    """The Guard of a side: as it ships, ``history=0``, or ``snapshot="every-step"``."""
    if "history=0" in side:
        kw["history"] = 0
    if "every-step" in side:
        kw["snapshot"] = "every-step"
    return nanbisect.Guard(task, entry="scripts/bench_guard.py:make_task", out=out, **kw)


def _fs_type(path: str) -> str:
    """The file system ``path`` is on (/proc/mounts: the longest mount point above it)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return "?"
    path = os.path.realpath(path)
    best = max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else "?"


def snapshot_file(guard: nanbisect.Guard | None) -> dict | None:
    """The default Guard's K-step snapshot: its file (None without one), its bytes, K (None:
    not chosen yet), the state bytes it holds, the step it was taken at, the file system."""
    keeper = getattr(guard, "_keeper", None)
    if keeper is None:
        return None
    d = getattr(keeper._store, "_dir", None)
    path = Path(d) / "state.safetensors" if d is not None else None
    return {"path": str(path) if path is not None else None,
            "bytes": path.stat().st_size if path is not None and path.exists() else 0,
            "k": keeper.k, "state_bytes": keeper.state_bytes,
            "taken_at_step": keeper.snap.step if keeper.snap is not None else None,
            "kept_steps": len(keeper.records),
            "filesystem": _fs_type(str(path.parent)) if path is not None else None}


def _proc_status() -> dict[str, float]:
    """VmRSS, VmHWM (the peak) and RssAnon (the resident memory less the pages of files: the
    libraries' code) of this process, in MiB (ru_maxrss for all three off Linux)."""
    keys = ("VmRSS", "VmHWM", "RssAnon")
    try:
        with open("/proc/self/status") as f:
            kv = dict(line.split(":", 1) for line in f if line.startswith(keys))
        out = {k: int(v.split()[0]) / 1024 for k, v in kv.items()}
        return out | {k: out["VmRSS"] for k in keys if k not in out}
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return dict.fromkeys(keys, peak)


def mem_side(side: str, cfg: dict, steps: int, device: str) -> dict:
    """One side's memory, in this (fresh) process: RSS after the task is built (optimizer
    state not yet made), after each of ``steps`` steps, and the peak; then what the Guard holds,
    walked after the RSS was read."""
    task = make_task(cfg)
    batches = make_batches(cfg, device)
    dev = torch.device(device)
    acc = getattr(torch, dev.type) if dev.type != "cpu" else None
    if acc is not None:
        acc.synchronize()
        acc.reset_peak_memory_stats()
    gc.collect()
    before = _proc_status()
    dev_before = acc.memory_allocated() if acc is not None else 0
    out_dir = tempfile.mkdtemp(prefix="bench_guard_mem_")
    guard = None if side == "plain" else make_guard(side, task, out_dir)
    run = {"plain": lambda b: plain_step(task, b), "Guard.watch": lambda b: watch_step(guard, b)
           }.get(side, guard.step if guard is not None else None)
    rss, copies_at = [], []
    for i in range(steps):
        run(batches[i % len(batches)])
        if acc is not None:
            acc.synchronize()
        rss.append(_proc_status()["VmRSS"])
        if guard is not None:    # where the snapshot's copies live: reused, or made anew
            snap = guard._snapshot
            copies_at.append(sorted({_storage(c)[0] for c in
                                     snap._early.copies + snap._late.copies}))
    snap_file = snapshot_file(guard)   # before close: the K-step snapshot, on disk
    gc.collect()
    after = _proc_status()
    try:    # glibc: give back the heap's free pages, so that what is left is what is live
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = _proc_status()["VmRSS"]
    except (OSError, AttributeError):
        trimmed = after["VmRSS"]
    res = {"side": side, "steps": steps, "rss_before_mib": before["VmRSS"],
           "rss_after_mib": after["VmRSS"], "rss_per_step_mib": rss,
           "rss_trimmed_mib": trimmed, "anon_before_mib": before["RssAnon"],
           "anon_after_mib": after["RssAnon"],
           "peak_mib": after["VmHWM"], "peak_before_steps_mib": before["VmHWM"]}
    if acc is not None:
        res |= {"device_before_mib": dev_before / MiB,
                "device_after_mib": acc.memory_allocated() / MiB,
                "device_peak_mib": acc.max_memory_allocated() / MiB}
    user = state_storages(task)
    res["n_params"] = sum(p.numel() for p in task.model.parameters())
    res["bytes"] = {k: sum(v.values()) for k, v in user.items()}
    if guard is not None:
        held = guard_tensors(guard, {p for v in user.values() for p in v})
        snap = guard._snapshot
        copies = {_storage(c)[0]: _storage(c)[1] for c in snap._early.copies +
                  snap._late.copies}
        res["held"] = [{"path": p, "bytes": n, "shape": list(sh)}
                       for p, n, sh in sorted(held.values(), key=lambda x: -x[1])]
        res["held_bytes"] = sum(n for _, n, _ in held.values())
        res["snapshot_copies"] = {"tensors": len(snap._live), "storages": len(copies),
                                  "bytes": sum(copies.values())}
        ring = guard._history._ring if guard._history is not None else None
        res["history_ring"] = ({"shape": list(ring.shape), "bytes": _storage(ring)[1]}
                               if ring is not None else None)
        # the steps at which the copies moved to new storage (0: the first take)
        res["copies_made_at_steps"] = [i for i, c in enumerate(copies_at)
                                       if i == 0 or c != copies_at[i - 1]]
        res["snapshot_file"] = snap_file
        guard.close()     # the snapshot file removed
        if snap_file is not None:
            res["snapshot_file"]["removed_by_close"] = not Path(snap_file["path"]).exists()
    shutil.rmtree(out_dir, ignore_errors=True)    # no bundle was written: an empty directory
    return res


def _snap_line(f: dict | None, state: int) -> str:
    """The K-step snapshot as the memory report says it (``state``: the parameter and optimizer
    state bytes after the steps)."""
    if f is None:
        return "no K-step snapshot (the whole state is copied in memory before every step)"
    if f["path"] is None:
        return "the K-step snapshot: in pinned host memory (not a file)"
    k = f["k"] if f["k"] is not None else (f"not chosen yet (chosen {CHOOSE_AFTER} steps after "
                                           "the first snapshot)")
    return (f"the K-step snapshot lives on disk, not in memory: {f['bytes'] / MiB:.1f} MiB "
            f"(state {f['state_bytes'] / MiB:.1f} MiB"
            + (": parameters only, taken before the optimizer's state existed"
               if f["state_bytes"] < 0.9 * state else "")
            + f") in {f['path']} ({f['filesystem']}), "
            f"taken at step {f['taken_at_step']}, K = {k}, {f['kept_steps']} steps kept since; "
            f"removed by close: {f.get('removed_by_close')}")


def memory_main(args, cfg: dict) -> None:
    """Run each side in a fresh process of its own; print and compare."""
    runs: dict[str, list[dict]] = {side: [] for side in MEM_SIDES}
    for side in [x for _ in range(args.mem_repeats) for x in MEM_SIDES]:  # interleaved
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-side", side,
               "--size", args.size, "--mem-steps", str(args.mem_steps),
               "--threads", str(args.threads), "--device", args.device]
        cmd += [f for f, on in (("--scaler", args.scaler),) if on]
        for flag, v in (("--clip", args.clip), ("--batch", args.batch), ("--seq", args.seq),
                        ("--batch-ratio", args.batch_ratio)):
            cmd += [flag, str(v)] if v is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("MEMSIDE ")]
        if out.returncode or not line:
            sys.exit(f"bench_guard --memory: side {side!r} failed (exit {out.returncode}):\n"
                     f"{out.stderr[-3000:]}")
        runs[side].append(json.loads(line[-1][len("MEMSIDE "):]))
    # each side's first run, its RSS figures the medians over the repeats
    sides = {k: dict(v[0], repeats=v) for k, v in runs.items()}
    for r in sides.values():
        for key in ("rss_before_mib", "rss_after_mib", "rss_trimmed_mib", "peak_mib",
                    "anon_before_mib", "anon_after_mib"):
            r[key] = statistics.median(x[key] for x in r["repeats"])
    plain = sides["plain"]
    b = plain["bytes"]
    state = b["params"] + b["state"]
    growth = {k: r["rss_after_mib"] - r["rss_before_mib"] for k, r in sides.items()}
    kept = {k: r["rss_trimmed_mib"] - r["rss_before_mib"] for k, r in sides.items()}
    anon = {k: r["anon_after_mib"] - r["anon_before_mib"] for k, r in sides.items()}
    for k, r in sides.items():
        r["rss_growth_mib"] = growth[k]
        r["extra_rss_mib"] = growth[k] - growth["plain"]
        r["extra_rss_x_state"] = r["extra_rss_mib"] * MiB / state
        r["extra_trimmed_mib"] = kept[k] - kept["plain"]
        r["extra_trimmed_x_state"] = r["extra_trimmed_mib"] * MiB / state
        r["extra_anon_mib"] = anon[k] - anon["plain"]
        r["extra_anon_x_state"] = r["extra_anon_mib"] * MiB / state
        r["extra_peak_mib"] = r["peak_mib"] - plain["peak_mib"]
        r["extra_peak_x_state"] = r["extra_peak_mib"] * MiB / state
        if "held_bytes" in r:
            r["held_x_state"] = r["held_bytes"] / state
        if "device_after_mib" in r:
            r["extra_device_x_state"] = ((r["device_after_mib"] - r["device_before_mib"]) -
                                         (plain["device_after_mib"] -
                                          plain["device_before_mib"])) * MiB / state
    print(f"size {args.size}: {cfg} | params: {plain['n_params']:,} | AdamW | torch "
          f"{torch.__version__}, {args.threads} threads, device {args.device} | "
          f"{args.mem_steps} steps per side, each side in a fresh process, "
          f"{args.mem_repeats} time(s) (interleaved; RSS: medians)\n")
    print(f"parameters {b['params'] / MiB:.1f} MiB + AdamW state {b['state'] / MiB:.1f} MiB = "
          f"**{state / MiB:.1f} MiB** (the state, below: x state); buffers "
          f"{b['buffers'] / MiB:.2f} MiB, gradients {b['grads'] / MiB:.1f} MiB\n")
    print("| side | RSS before MiB | after MiB | growth MiB | extra growth over plain MiB "
          "(x state) | the same after malloc_trim | the same, RssAnon only | peak MiB "
          f"| extra peak (x state) | Guard-held tensors MiB (x state) | meets {MEM_BAR:.2f}x "
          "(after malloc_trim) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, r in sides.items():
        held = (f"{r['held_bytes'] / MiB:.1f} ({r['held_x_state']:.3f}x)" if "held_bytes" in r
                else "-")
        meets = "-" if k == "plain" else ("yes" if r["extra_trimmed_x_state"] <= MEM_BAR else "no")
        print(f"| {k} | {r['rss_before_mib']:.1f} | {r['rss_after_mib']:.1f} "
              f"| {r['rss_growth_mib']:.1f} | {r['extra_rss_mib']:.1f} "
              f"({r['extra_rss_x_state']:.3f}x) | {r['extra_trimmed_mib']:.1f} "
              f"({r['extra_trimmed_x_state']:.3f}x) | {r['extra_anon_mib']:.1f} "
              f"({r['extra_anon_x_state']:.3f}x) | {r['peak_mib']:.1f} "
              f"| {r['extra_peak_mib']:.1f} "
              f"({r['extra_peak_x_state']:.3f}x) | {held} | {meets} |")
    if "extra_device_x_state" in plain:
        print("\ndevice memory allocated, extra growth over plain (x state): " + ", ".join(
            f"{k} {r['extra_device_x_state']:.3f}x" for k, r in sides.items()))
    for k, r in sides.items():
        if "held" not in r:
            continue
        ring = r["history_ring"]
        print(f"\n{k}: the snapshot's copies: {r['snapshot_copies']['tensors']} tensors in "
              f"{r['snapshot_copies']['storages']} storages, "
              f"{r['snapshot_copies']['bytes'] / MiB:.2f} MiB, made at steps "
              f"{r['copies_made_at_steps']} (reused after); history ring: "
              + (f"{ring['shape']} float32, {ring['bytes'] / 1024:.1f} KiB" if ring else "none")
              + "; " + _snap_line(r.get("snapshot_file"), state)
              + "; every tensor the Guard holds:")
        for h in r["held"]:
            print(f"  {h['bytes'] / MiB:10.3f} MiB  {h['shape']}  {h['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "config": cfg, "state_bytes": state, "bar": MEM_BAR,
                       "torch": torch.__version__, "platform": platform.platform(),
                       "sides": sides}, f, indent=2, default=str)


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--size", choices=sorted(SIZES), default="default",
                    help="the model and batch (tiny: 0.5M parameters, batch 8x64)")
    ap.add_argument("--steps", type=int, default=30, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured rounds")
    ap.add_argument("--block", type=int, default=5,
                    help="steps per side in a row in each round; the first of each block is not "
                         "measured (1: one step per side per round, all measured)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (the size's)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (the size's)")
    ap.add_argument("--batch-ratio", type=float, default=None, metavar="R",
                    help="--size features/features5m: the feature width whose batch is nearest "
                         "R times the parameter + AdamW state bytes")
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
    ap.add_argument("--memory", action="store_true",
                    help="measure memory instead of time (issue 40): the Guard's tensors, and "
                         "each side's resident memory in a fresh process of its own")
    ap.add_argument("--mem-steps", type=int, default=8, help="--memory: steps per side")
    ap.add_argument("--mem-repeats", type=int, default=1,
                    help="--memory: fresh processes per side (RSS figures: their medians)")
    ap.add_argument("--mem-side", choices=MEM_SIDES, help=argparse.SUPPRESS)  # a child's side
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    cfg = dict(CONFIG, **SIZES[args.size], scaler=args.scaler, clip=args.clip,
               device=args.device)
    cfg.update({k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v is not None})
    if args.batch_ratio is not None:
        if cfg.get("model") != "features":
            ap.error("--batch-ratio needs --size features or features5m")
        cfg["width"] = width_for_ratio(cfg, args.batch_ratio)
    if args.mem_side:
        print("MEMSIDE " + json.dumps(mem_side(args.mem_side, cfg, args.mem_steps,
                                               args.device)))
        return
    if args.memory:
        memory_main(args, cfg)
        return

    names = list(SIDES)
    tasks = {name: make_task(cfg) for name in names}   # same seed: identical weights
    assert all(torch.equal(a, b) for t in tasks.values() for a, b in
               zip(tasks["plain"].model.parameters(), t.model.parameters()))
    n_params = sum(p.numel() for p in tasks["plain"].model.parameters())
    batches = make_batches(cfg, args.device)
    state = state_bytes_of(tasks["plain"].model)
    ratio = batch_bytes(batches[0]) / state

    times: dict[str, list[float]] = {name: [] for name in names}
    same_loss = True
    with tempfile.TemporaryDirectory() as out:
        guards = {name: make_guard(name, tasks[name], out,
                                   snapshot_stream=not args.no_snapshot_stream)
                  for name in names[1:]}
        takes = {name: count_takes(g) for name, g in guards.items() if g._keeper is not None}
        runs = {name: guards[name].step for name in names[1:-1]}
        runs |= {"plain": lambda b: plain_step(tasks["plain"], b),
                 "Guard.watch": lambda b: watch_step(guards["Guard.watch"], b)}
        k = k_block = args.block
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
        shipped = guards["Guard.step"]
        snap = {name: snapshot_file(g) for name, g in guards.items()}   # as the steps left it
        at = takes["Guard.step"]
        every = (at[-1] - at[0]) / (len(at) - 1) if len(at) > 1 else None
        pieces = piece_times(shipped, max(10, args.steps), batches[0], shipped._keeper.k, every)
        for name, f in snap.items():
            if f is not None:
                f["taken_at_steps"] = list(takes[name])
        pieces |= in_step_times(shipped, batches, reps=max(10, args.steps // 2))
        for g in guards.values():
            g.close()     # the snapshot file removed

    plain = times["plain"]
    med_p = statistics.median(plain)
    res = {
        "config": cfg, "size": args.size, "n_params": n_params, "optimizer": "AdamW",
        "steps": args.steps, "warmup": args.warmup, "block": args.block, "clock": args.clock,
        "load_average": os.getloadavg(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "platform": platform.platform(),
        "processor": platform.processor(), "losses_identical": same_loss, "sides": {},
        "state_bytes": state, "batch_bytes": batch_bytes(batches[0]), "batch_state_ratio": ratio,
        "pieces_ms_median": pieces, "snapshots": snap}
    for name in names:
        ts = times[name]
        res["sides"][name] = {
            "ms": summary(ts),
            "ratio_of_medians": statistics.median(ts) / med_p,
            "ratio_paired_median": statistics.median(t / p for p, t in zip(plain, ts))}
    print(f"size {args.size}: {cfg} | params: {n_params:,} | AdamW | a batch "
          f"{batch_bytes(batches[0]) / 1e6:.3f} MB, {ratio:.4f}x the state's "
          f"{state / 1e6:.1f} MB | torch {torch.__version__}, "
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
    bar = TIME_BARS.get(args.size)
    if bar is not None:
        r = res["sides"]["Guard.step"]
        res["bar"] = {"x_plain": bar, "meets": r["ratio_of_medians"] <= bar}
        print(f"\nthe bar at --size {args.size} (issues 40 and 63): Guard.step <= {bar:.2f}x "
              f"plain (medians, an idle machine): {r['ratio_of_medians']:.4f}x: "
              f"{'meets' if res['bar']['meets'] else 'misses'} it (load average "
              f"{os.getloadavg()[0]:.1f})")
    for name, f in snap.items():
        if f is not None:
            k = f["k"] if f["k"] is not None else "not chosen yet"
            print(f"{name}: K-step snapshot {f['state_bytes'] / 1e6:.1f} MB "
                  f"({f['filesystem']} file), K = {k}, the last taken at step "
                  f"{f['taken_at_step']}; taken at steps {f['taken_at_steps']} of "
                  f"{rounds * k_block} (the median step leaves it out; see the pieces)")
    print("\n| Guard piece | median ms | % of plain step |\n|---|---:|---:|")
    for k, v in pieces.items():
        print(f"| {k} | {v:.3f} | {100 * v / (1e3 * med_p):.2f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
