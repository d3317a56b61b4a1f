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

``--memory`` (issue 40) measures memory instead of time: (1) the bytes of the parameters and the
optimizer state (AdamW: two moments and a step per parameter); (2) the bytes of the tensors the
Guard itself holds after ``--mem-steps`` steps (its attributes walked for tensors, one count per
storage, the model's and optimizer's own tensors left out: the snapshot's copies, the history's
ring, anything else), as a multiple of (1); (3) from outside, the resident memory (VmRSS, VmHWM
of /proc/self/status) of ``--mem-steps`` steps of each side (plain, Guard.step, history=0,
Guard.watch), each side in a fresh process of its own (this script, re-invoked), so that no two
share an allocator: the growth of each guarded side's RSS over the steps minus the plain loop's
(as read, after glibc's ``malloc_trim`` has handed back free heap pages (the stable figure: the
heap keeps freed activations, in which a copy may land), and in anonymous pages only), and its
peak minus the plain loop's, as multiples of (1), against issue 40's bar of 0.10x (trimmed).
``--size mlp25m``: an MLP of 25.2M parameters (Linear 2048->4096->2048->4096, GELU, MSE loss,
batch 64) with AdamW, about 288 MiB of parameters and moments (issue 40's model).

    python scripts/bench_guard.py [--size default|tiny|mlp25m] [--steps 30] [--block 5]
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
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
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
# mlp25m (issue 40): Linear 2048->4096->2048->4096 with GELU between, 25.2M parameters, batch 64
# (about 288 MiB of parameters and AdamW moments)
SIZES = {"default": {}, "tiny": dict(dim=128, heads=4, n_layers=2, seq=64, batch=8),
         "mlp25m": dict(model="mlp", widths=(2048, 4096, 2048, 4096), batch=64)}


def mlp_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def make_task(cfg: dict = CONFIG) -> nanbisect.Task:
    torch.manual_seed(cfg["seed"])
    dev = torch.device(cfg.get("device", "cpu"))
    if cfg.get("model") == "mlp":
        w = cfg["widths"]
        layers: list = []
        for i in range(len(w) - 1):
            layers += [torch.nn.Linear(w[i], w[i + 1])] + [torch.nn.GELU()] * (i < len(w) - 2)
        model, loss_fn = torch.nn.Sequential(*layers).to(dev), mlp_loss
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


# -- memory (issue 40) -----------------------------------------------------------------------
MiB = 2.0 ** 20
MEM_SIDES = ["plain", "Guard.step", "Guard.step, history=0", "Guard.watch"]
MEM_BAR = 0.10      # issue 40's target: the Guard's extra memory, x the parameter + state bytes


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under ``t``: one count per storage."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def state_storages(task: nanbisect.Task) -> dict[str, dict[int, int]]:
    """The storages of the user's own tensors: parameters, their gradients, buffers, the
    optimizer's state (data pointer -> bytes), by kind."""
    out: dict[str, dict[int, int]] = {"params": {}, "grads": {}, "buffers": {}, "state": {}}
    for p in task.model.parameters():
        out["params"].__setitem__(*_storage(p))
        if p.grad is not None:
            out["grads"].__setitem__(*_storage(p.grad))
    for b in task.model.buffers():
        out["buffers"].__setitem__(*_storage(b))
    for st in task.optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out["state"].__setitem__(*_storage(v))
    return out


def guard_tensors(guard: nanbisect.Guard, user: set[int]) -> dict[int, tuple[str, int, tuple]]:
    """Every tensor storage the Guard holds that is not one of the user's (``user``: data
    pointers): data pointer -> (the attribute path it was first met at, bytes, a shape met
    there). Walks the Guard's attributes (lists, tuples, dicts, deques, objects), not the Task
    nor modules, optimizers and scalers it reaches."""
    skip = (torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, nanbisect.Task,
            type, type(sys), type(len), type(lambda: 0), type(guard.step), Path, str, bytes)
    held: dict[int, tuple[str, int, tuple]] = {}
    seen: set[int] = set()
    todo: list = [("guard", guard)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            ptr, n = _storage(obj)
            if ptr not in user and ptr not in held and n:
                held[ptr] = (path, n, tuple(obj.shape))
        elif isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            todo += [(f"{path}.key", k) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple, deque, set, frozenset)):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            fields = dict(getattr(obj, "__dict__", {}))
            fields.update({k: getattr(obj, k) for c in type(obj).__mro__
                           for k in getattr(c, "__slots__", ()) if hasattr(obj, k)})
            todo += [(f"{path}.{k}", v) for k, v in fields.items() if k != "task"]
    return held


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
    guard = None if side == "plain" else nanbisect.Guard(
        task, entry="scripts/bench_guard.py:make_task", out=out_dir,
        **({"history": 0} if "history=0" in side else {}))
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
    return res


def memory_main(args, cfg: dict) -> None:
    """Run each side in a fresh process of its own; print and compare."""
    runs: dict[str, list[dict]] = {side: [] for side in MEM_SIDES}
    for side in [x for _ in range(args.mem_repeats) for x in MEM_SIDES]:  # interleaved
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mem-side", side,
               "--size", args.size, "--mem-steps", str(args.mem_steps),
               "--threads", str(args.threads), "--device", args.device]
        cmd += [f for f, on in (("--scaler", args.scaler),) if on]
        for flag, v in (("--clip", args.clip), ("--batch", args.batch), ("--seq", args.seq)):
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
              + "; every tensor the Guard holds:")
        for h in r["held"]:
            print(f"  {h['bytes'] / MiB:10.3f} MiB  {h['shape']}  {h['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "config": cfg, "state_bytes": state, "bar": MEM_BAR,
                       "torch": torch.__version__, "platform": platform.platform(),
                       "sides": sides}, f, indent=2, default=str)


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
    if args.mem_side:
        print("MEMSIDE " + json.dumps(mem_side(args.mem_side, cfg, args.mem_steps,
                                               args.device)))
        return
    if args.memory:
        memory_main(args, cfg)
        return

    names = ["plain", "Guard.step", "Guard.step, history=0", "Guard.watch"]
    tasks = {name: make_task(cfg) for name in names}   # same seed: identical weights
    assert all(torch.equal(a, b) for t in tasks.values() for a, b in
               zip(tasks["plain"].model.parameters(), t.model.parameters()))
    n_params = sum(p.numel() for p in tasks["plain"].model.parameters())
    batches = make_batches(cfg, args.device)

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
