"""Benchmark: replay memory and time to culprit from 2M to 400M parameters (issue 46).

The workload: a stack of L blocks ``x + LayerNorm(Linear(4d, d)(act(Linear(d, 4d)(x))))``, AdamW,
a batch of 8 x 64 tokens of width d, loss the mean square error against a random target. Sizes
(``--sizes``): 2m (d=256, L=4), 34m (d=256, L=64), 101m (d=1024, L=12), 403m (d=2048, L=12). The
last block's activation is GELU with a planted fault (``--faults``), switched on at step 2
(after 2 healthy steps under `nanbisect.Guard`, which writes the bundle; the batch carries the
switch, so that the Guard's rebuild of step 1 from its snapshot replays a healthy step):

* forward: ``gelu(x) * sqrt(1 + x / 1e-3)``: ``aten.sqrt`` of negatives (healthy: ``/ 1e4``);
* backward: an autograd Function, identity forward, whose backward multiplies the gradient by
  ``sqrt(full_like(grad, -1))`` (healthy: ``+1``): a NaN born in backward only;
* optimizer: ``gelu(x) + 0 * gate``, ``gate`` a parameter in its own AdamW group with eps=0 (and
  unused while healthy): its first gradient is exactly 0 and its first update 0 / 0 (as
  tests/tasks/ddp_train.py's eps=0 tasks).

The model is a task file the script writes into its work directory (size and fault from the
environment, ``NANBISECT_SCALE_SIZE`` / ``NANBISECT_SCALE_FAULT``, so ``nanbisect run`` in a fresh
interpreter builds the same one). Per size and fault, one process at a time (the largest size
needs ~15 GB during ``nanbisect run``), each started by bench_bisect's launcher (``launch``: the
child's own peak RSS, ``ru_maxrss`` through the launcher's RUSAGE_CHILDREN):

1. capture: 2 healthy steps and the faulty one under `nanbisect.Guard` (its peak RSS: the Guard's,
   bundle writing included);
2. training peak: a fresh process builds the healthy model and runs 2 plain steps
   (bench_bisect's ``plain_step``: zero_grad, forward, backward, AdamW step);
3. step times: from the bundle's pre-step state (healthy), ``--steps`` rounds after a warm-up
   round, each a plain step and a step under a Guard (both restored first, untimed): the plain
   step's median and the Guard's step ratio (more rounds, up to 30, while they take under 20 s);
   the plain step's CPU time too (all threads), for the CPU column below;
4. ``--reps`` rounds of a bare ``python -c "import torch, nanbisect"`` and a cold
   ``python -m nanbisect run BUNDLE --no-remedies --json --out DIR``: time to culprit is the run
   less the bare import, in plain steps; its peak RSS; report.json's ``timings``; the culprit,
   checked against the planted one (phase, and the last block). CPU time of the run and the
   bare import too (the parent's RUSAGE_CHILDREN around each): the busy machine's steadier
   figure, against the plain step's CPU. The run's stderr is read as it comes: the moment of
   its culprit line (``nanbisect: culprit found: ...``, printed as soon as the run knows it) is
   the time to culprit a person waits; less the passes before it (report.json's ``timings``)
   it is the start-up (interpreter, torch, nanbisect, the CLI);
5. with ``--with-remedies``, one more run with remedies (the default budget): the whole run.

``--profile SIZE:FAULT`` runs `nanbisect.pipeline.run_bundle` (remedies off, as the CLI above) in
one process, with a thread sampling its RSS every 50 ms; at each pass boundary (the progress
callback) and whenever RSS has grown by ``PROFILE_STEP_MIB`` since the last look, it walks
``gc.get_objects()`` for tensors and groups their storages' bytes by holder: the replayer's
``tensors`` (the bundle's), the model's parameters and buffers, their gradients, the optimizer's
state, and the rest (named by the type of what refers to them).

    python scripts/bench_scale.py [--sizes 2m,34m,101m,403m] [--faults forward,backward,optimizer]
                                  [--reps 2] [--steps 3] [--json out.json] [--keep DIR]
                                  [--with-remedies]
    python scripts/bench_scale.py --profile 101m:backward [--json prof.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = {"2m": (256, 4), "34m": (256, 64), "101m": (1024, 12), "403m": (2048, 12)}
FAULTS = ("forward", "backward", "optimizer")
SIZE_ENV, FAULT_ENV = "NANBISECT_SCALE_SIZE", "NANBISECT_SCALE_FAULT"
MIN_STEPS_S, MAX_ROUNDS = 20.0, 30    # step timing: more rounds while cheap (`child_steps`)
PROFILE_STEP_MIB = 256     # the profile's holder walk: also whenever RSS grew this much
TASK_FILE = "scale_task.py"
TASK_SOURCE = '''\
"""bench_scale's model (written by scripts/bench_scale.py): size and fault from the environment."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanbisect

SIZES = {"2m": (256, 4), "34m": (256, 64), "101m": (1024, 12), "403m": (2048, 12)}
BATCH, SEQ = 8, 64


class _GradSqrt(torch.autograd.Function):
    """Identity forward; backward multiplies by sqrt(c): NaN when c < 0 (born in backward)."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.sqrt(torch.full_like(grad, ctx.c)), None


class Planted(nn.Module):
    """The last block's GELU with the planted fault (``on``)."""

    def __init__(self, kind, width):
        super().__init__()
        self.kind, self.on = kind, False
        if kind == "optimizer":
            self.gate = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        if self.kind == "forward":
            return F.gelu(x) * torch.sqrt(1 + x / (1e-3 if self.on else 1e4))
        if self.kind == "backward":
            return _GradSqrt.apply(F.gelu(x), -1.0 if self.on else 1.0)
        y = F.gelu(x)
        return y + self.gate * 0.0 if self.on else y


class Block(nn.Module):
    def __init__(self, d, act):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(d, 4 * d), act, nn.Linear(4 * d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.ln(self.out(self.act(self.fc(x))))


class Stack(nn.Module):
    def __init__(self, d, n, kind):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, Planted(kind, 4 * d) if i == n - 1 else nn.GELU())
                                    for i in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def config():
    return SIZES[os.environ["NANBISECT_SCALE_SIZE"]], os.environ["NANBISECT_SCALE_FAULT"]


def set_fault(model, on):
    model.blocks[-1].act.on = on


def loss_fn(model, batch):
    # the fault is the batch's (a rebuild of an earlier step from the Guard's snapshot replays
    # that step's batch: healthy)
    set_fault(model, bool(batch["fault"]))
    return (model(batch["x"]) - batch["y"]).pow(2).mean()


def make_batch(i, fault=False):
    """Batch ``i``; ``fault``: the planted fault fires in the step that trains on it."""
    (d, _), _ = config()
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(BATCH, SEQ, d, generator=g),
            "y": torch.randn(BATCH, SEQ, d, generator=g), "fault": torch.tensor(fault)}


def make_task():
    """The entry."""
    (d, n), kind = config()
    torch.manual_seed(0)
    model = Stack(d, n, kind)
    gate = [p for name, p in model.named_parameters() if name.endswith(".gate")]
    rest = [p for name, p in model.named_parameters() if not name.endswith(".gate")]
    groups = [{"params": rest}] + ([{"params": gate, "eps": 0.0}] if gate else [])
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01)
    return nanbisect.Task(model=model, optimizer=opt, loss_fn=loss_fn)
'''


def ms(seconds: float) -> float:
    return 1e3 * seconds


def write_task(work: Path) -> str:
    """The task file in ``work``; returns its entry string."""
    path = work / TASK_FILE
    path.write_text(TASK_SOURCE)
    return f"{path}:make_task"


def import_task(entry: str):
    """The task file as a module (the same file the entry names)."""
    from nanbisect.task import import_target
    return import_target(entry.rpartition(":")[0])


def bench():
    """scripts/bench_bisect.py (imports torch): its launcher, replayer and plain step."""
    sys.path.insert(0, str(HERE))
    import bench_bisect
    return bench_bisect


def launch(cmd: list[str], env: dict) -> tuple[str, float, float, float]:
    """bench_bisect's launcher around ``cmd``: (stdout, wall seconds, peak RSS MiB, CPU seconds
    of the launcher and what it waited for: the command's user + system time, all threads)."""
    bb = bench()
    from bench_culprit import _children_cpu
    t0, c0 = time.perf_counter(), _children_cpu()
    out, peak = bb.launch(cmd, cwd=ROOT, env=env)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if not out.strip():
        raise RuntimeError(f"{' '.join(cmd)} printed nothing (failed?); env {env}")
    return out, wall, peak, cpu


CULPRIT_LINE = "nanbisect: culprit found:"
AFTER_CULPRIT = ("repro", "remedies", "surfaced-repro", "module-repro", "op-check", "report")


def launch_run(cmd: list[str], env: dict) -> tuple[str, float, float, float, float | None]:
    """`launch` for ``nanbisect run``: stderr read as it comes, to time the culprit line (the
    CLI prints it the moment the run knows its culprit); (stdout, wall s, peak RSS MiB, CPU s,
    seconds from the start to the culprit line or None)."""
    import subprocess
    import threading

    bb = bench()
    from bench_culprit import _children_cpu
    t0, c0 = time.perf_counter(), _children_cpu()
    p = subprocess.Popen([sys.executable, "-c", bb.LAUNCHER, *cmd], cwd=ROOT,
                         env={**os.environ, **env}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen: list[float] = []
    err: list[str] = []

    def read() -> None:
        for line in p.stderr:
            if line.startswith(CULPRIT_LINE) and not seen:
                seen.append(time.perf_counter() - t0)
            err.append(line)
    th = threading.Thread(target=read, daemon=True)
    th.start()
    out = p.stdout.read()
    p.wait()
    th.join(30)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    import re
    m = re.search(r"^CHILD_MAXRSS_KIB (\d+)$", out, flags=re.M)
    if m is None:
        raise RuntimeError(f"{cmd} failed: {(out + ''.join(err))[-1500:]}")
    return out[:m.start()], wall, int(m.group(1)) / 1024, cpu, (seen[0] if seen else None)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# children (each in its own process, started by the launcher)


def child_capture(entry: str, out: str) -> dict:
    """2 healthy steps under the Guard, then the fault: the bundle; the Guard's step times."""
    import torch

    import nanbisect
    mod = import_task(entry)
    task = mod.make_task()
    guard = nanbisect.Guard(task, entry=entry, out=out)
    times, bundle = [], None
    try:
        for i in range(2):
            t0 = time.perf_counter()
            guard.step(mod.make_batch(i))
            times.append(ms(time.perf_counter() - t0))
        guard.step(mod.make_batch(2, fault=True))
        guard.close()     # an update's fault is read at the next step's reading: here
    except nanbisect.NonFiniteStep as e:
        bundle = str(e.bundle)
    if bundle is None:
        raise RuntimeError("the planted fault did not fire")
    return {"bundle": bundle, "guard_healthy_step_ms": times, "nanbisect_file": nanbisect.__file__,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "n_params": sum(p.numel() for p in task.model.parameters())}


def child_plain(entry: str) -> dict:
    """The training peak: build the healthy model, 2 plain steps (the second with AdamW state)."""
    bb = bench()
    mod = import_task(entry)
    task = mod.make_task()
    for i in range(2):
        bb.plain_step(task, mod.make_batch(i))
    return {"maxrss_mib": bb.maxrss_mib()}


def child_steps(entry: str, bundle: str, rounds: int, out: str) -> dict:
    """Plain steps and Guard steps from the bundle's pre-step state (healthy), interleaved."""
    import torch

    import nanbisect
    bb = bench()
    rep = bb.replayer(Path(bundle))
    guard = nanbisect.Guard(rep.task, entry=entry, out=out)
    plain, guarded, cpu = [], [], []
    t_end, i = time.perf_counter() + MIN_STEPS_S, 0
    # round 0 warms up (not counted); at least ``rounds`` more, and more (up to MAX_ROUNDS) while
    # they take under MIN_STEPS_S: a busy machine's medians need many steps where they are cheap
    while i <= rounds or (i <= MAX_ROUNDS and time.perf_counter() < t_end):
        for kind in (("plain", "guard") if i % 2 else ("guard", "plain")):
            batch = rep.restore()
            batch["fault"] = torch.tensor(False)     # healthy
            t0, c0 = time.perf_counter(), time.process_time()
            if kind == "plain":
                bb.plain_step(rep.task, batch)
            else:
                guard.step(batch)
            dt = ms(time.perf_counter() - t0)
            if i:
                (plain if kind == "plain" else guarded).append(dt)
                if kind == "plain":
                    cpu.append(ms(time.process_time() - c0))
        i += 1
    step = statistics.median(plain)
    return {"plain_ms": plain, "guard_ms": guarded, "plain_median_ms": step,
            "plain_cpu_ms": cpu, "plain_cpu_median_ms": statistics.median(cpu),
            "guard_median_ms": statistics.median(guarded),
            "guard_x_plain": statistics.median(guarded) / step}


# ------------------------------------------------------------------------------------------
# the profile (in-process run_bundle)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def holders() -> dict:
    """Bytes of the tensors Python can see, by storage, grouped by what holds them."""
    import gc

    import torch

    from nanbisect.replay.replayer import Replayer
    objs = gc.get_objects()
    reps = [o for o in objs if isinstance(o, Replayer)]
    tensors = [o for o in objs if isinstance(o, torch.Tensor)]
    del objs
    groups: dict[str, set] = {g: set() for g in ("replayer.tensors (bundle)", "model parameters",
                                                 "gradients", "optimizer state")}

    def key(t):
        try:
            s = t.untyped_storage()
            return (s.data_ptr(), s.nbytes(), t.device.type)
        except (RuntimeError, NotImplementedError):
            return None

    for r in reps:
        groups["replayer.tensors (bundle)"] |= {key(t) for t in r.tensors.values()
                                                if isinstance(t, torch.Tensor)}
        model, opt = r.task.model, r.task.optimizer
        groups["model parameters"] |= {key(t) for t in [*model.parameters(), *model.buffers()]}
        groups["gradients"] |= {key(p.grad) for p in model.parameters() if p.grad is not None}
        if opt is not None:
            groups["optimizer state"] |= {key(v) for st in opt.state.values()
                                          for v in st.values() if isinstance(v, torch.Tensor)}
    claimed = set().union(*groups.values())
    other: dict = {}
    for t in tensors:
        k = key(t)
        if k is not None and k not in claimed and k[0] != 0:
            other.setdefault(k, t)
    out = {g: {"bytes": sum(k[1] for k in ks if k), "storages": len(ks)}
           for g, ks in groups.items()}
    out["other"] = {"bytes": sum(k[1] for k in other), "storages": len(other)}
    # what refers to the largest of the rest (type of the referrer, and of the referrer's)
    big = sorted(other.items(), key=lambda kv: -kv[0][1])[:5]
    named = []
    for k, t in big:
        refs = []
        for r in gc.get_referrers(t):
            if r is tensors or r is other or r is big:
                continue
            up = [type(u).__name__ for u in gc.get_referrers(r)
                  if u is not tensors and not isinstance(u, type(sys._getframe()))][:3]
            refs.append(f"{type(r).__name__}<-{','.join(up)}" if isinstance(r, (dict, list,
                                                                               tuple)) else
                        type(r).__name__)
        named.append({"bytes": k[1], "shape": list(t.shape), "dtype": str(t.dtype),
                      "referrers": refs[:4]})
    out["other"]["largest"] = named
    shared = sum(1 for k in claimed if sum(k in ks for ks in groups.values()) > 1)
    out["storages_in_two_groups"] = shared
    out["replayers"] = len(reps)
    return out


def child_profile(bundle: str, out: str) -> dict:
    """`run_bundle` with remedies off, its RSS sampled every 50 ms and its holders walked."""
    import threading

    from nanbisect.pipeline import RunOptions, run_bundle
    from nanbisect.util import memory

    t0 = time.perf_counter()
    samples, walks, marks, errors = [], [], [], []
    stop, lock = threading.Event(), threading.Lock()
    last = [0.0]

    def walk(why: str) -> None:
        with lock:
            rss = rss_mib()
            walks.append({"t": time.perf_counter() - t0, "why": why, "rss_mib": rss,
                          "holders": holders()})
            last[0] = rss

    def sampler() -> None:
        while not stop.wait(0.05):
            rss = rss_mib()
            samples.append((round(time.perf_counter() - t0, 3), round(rss, 1)))
            if rss > last[0] + PROFILE_STEP_MIB:
                try:     # the replay runs on meanwhile: a dict it changes may fail the walk
                    walk("rss grew")
                except Exception as e:   # noqa: BLE001 (kept, the sampling goes on)
                    errors.append(repr(e))
                    last[0] = rss

    def progress(key: str, text: str) -> None:
        marks.append({"key": key, "t": time.perf_counter() - t0, "rss_mib": rss_mib()})
        walk(f"pass {key}")

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    memory.own_process()        # as `nanbisect run` does (the allocator's tuning)
    report = run_bundle(bundle, RunOptions(remedies=0), Path(out), progress)
    marks.append({"key": "end", "t": time.perf_counter() - t0, "rss_mib": rss_mib()})
    stop.set()
    th.join()
    peak = max(samples, key=lambda s: s[1]) if samples else (None, None)
    # the rss peak of the process: from the kernel
    with open("/proc/self/status") as f:
        hwm = next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM"))
    # per pass: the highest sample between its mark and the next
    per_pass = []
    for m, nxt in zip(marks, marks[1:]):
        inside = [s[1] for s in samples if m["t"] <= s[0] < nxt["t"]]
        per_pass.append({"key": m["key"], "start_rss_mib": m["rss_mib"],
                         "max_rss_mib": max(inside, default=m["rss_mib"]),
                         "seconds": nxt["t"] - m["t"]})
    c = report.culprit
    return {"vmhwm_mib": hwm, "peak_sample": peak, "walk_errors": errors, "passes": per_pass,
            "walks": walks, "samples": samples, "timings": report.timings,
            "culprit": None if c is None else {"phase": c.phase, "op": c.op, "module": c.module,
                                               "parameter": c.parameter}}


# ------------------------------------------------------------------------------------------
# the parent: one size and fault at a time


def planted(culprit: dict | None, fault: str, n_blocks: int) -> bool:
    """Is the culprit the planted one: its phase, in the last block (op or parameter)?"""
    if not culprit or culprit.get("phase") != fault:
        return False
    where = f"blocks.{n_blocks - 1}."
    if fault == "optimizer":
        return (culprit.get("parameter") or culprit.get("module") or "").startswith(
            f"{where}act.gate")
    return (culprit.get("module") or "").startswith(where) and "sqrt" in (culprit.get("op") or "")


def one(size: str, fault: str, work: Path, reps: int, rounds: int,
        with_remedies: bool = False) -> dict:
    d, n = SIZES[size]
    env = {SIZE_ENV: size, FAULT_ENV: fault}
    here = work / f"{size}-{fault}"
    here.mkdir(parents=True, exist_ok=True)
    entry = write_task(work)
    me = [sys.executable, str(Path(__file__).resolve())]
    res: dict = {"size": size, "fault": fault, "d": d, "blocks": n,
                 "loadavg_start": os.getloadavg()}
    say = lambda what: print(f"[{size} {fault}] {what} ...", file=sys.stderr, flush=True)  # noqa
    say("capture")
    out, wall, peak, _ = launch(me + ["--child", "capture", entry, str(here / "bundles")], env)
    cap = last_json(out)
    bundle = cap.pop("bundle")
    res.update(cap)
    res["capture"] = {"wall_s": wall, "peak_rss_mib": peak}
    say("training peak (2 plain steps)")
    res["training_peak_rss_mib"] = launch(me + ["--child", "plain", entry], env)[2]
    say("plain and Guard steps")
    out, _, peak, _ = launch(me + ["--child", "steps", entry, bundle, str(rounds),
                                str(here / "guard")], env)
    res["steps"] = last_json(out) | {"peak_rss_mib": peak}
    step = res["steps"]["plain_median_ms"]
    bare, runs = [], []
    for i in range(reps):
        say(f"bare import and nanbisect run, round {i + 1}/{reps}")
        out, wall, peak, cpu = launch([sys.executable, "-c", "import torch, nanbisect; "
                                       "print(nanbisect.__file__)"], env)
        bare.append({"ms": ms(wall), "cpu_ms": ms(cpu), "peak_rss_mib": peak,
                     "nanbisect_file": out.strip()})
        report_dir = here / f"report-{i}"
        p_out, wall, peak, cpu, told = launch_run(
            [sys.executable, "-m", "nanbisect", "run", bundle, "--no-remedies", "--json",
             "--out", str(report_dir)], env)
        rep = json.loads(p_out)
        c = rep.get("culprit") or {}
        t = rep.get("timings") or {}
        before = sum(v for k, v in t.items() if k not in AFTER_CULPRIT)
        runs.append({"ms": ms(wall), "cpu_ms": ms(cpu), "peak_rss_mib": peak,
                     "culprit_line_ms": ms(told) if told is not None else None,
                     # the process's start to the pipeline's: interpreter, torch, nanbisect, CLI
                     "startup_ms": ms(told - before) if told is not None else None,
                     "timings": rep.get("timings"), "verdict": rep.get("verdict"),
                     "culprit": {k: c.get(k) for k in ("phase", "op", "module", "module_call",
                                                        "parameter")}})
    if with_remedies:
        say("nanbisect run with remedies (the default budget)")
        p_out, wall, peak, cpu, told = launch_run(
            [sys.executable, "-m", "nanbisect", "run", bundle, "--json", "--out",
             str(here / "report-remedies")], env)
        rep = json.loads(p_out)
        res["with_remedies"] = {"ms": ms(wall), "peak_rss_mib": peak,
                                "culprit_line_ms": ms(told) if told is not None else None,
                                "timings": rep.get("timings"),
                                "remedies": [(r.get("kind"), r.get("outcome"))
                                             for r in rep.get("remedies") or []]}
    bare_ms = statistics.median(r["ms"] for r in bare)
    run_ms = statistics.median(r["ms"] for r in runs)
    run_peak = statistics.median(r["peak_rss_mib"] for r in runs)
    keys = list(dict.fromkeys(k for r in runs for k in (r["timings"] or {})))
    bare_cpu = statistics.median(r["cpu_ms"] for r in bare)
    run_cpu = statistics.median(r["cpu_ms"] for r in runs)
    res["bare_import"] = {"median_ms": bare_ms, "cpu_median_ms": bare_cpu, "all": bare}
    res["run"] = {"median_ms": run_ms, "all": runs, "peak_rss_mib": run_peak,
                  "after_bare_ms": run_ms - bare_ms,
                  "after_bare_x_plain": (run_ms - bare_ms) / step,
                  "cpu_median_ms": run_cpu, "cpu_after_bare_ms": run_cpu - bare_cpu,
                  "cpu_after_bare_x_plain_cpu": (run_cpu - bare_cpu)
                  / res["steps"]["plain_cpu_median_ms"],
                  "peak_x_training": run_peak / res["training_peak_rss_mib"],
                  "timings_median_s": {k: statistics.median((r["timings"] or {}).get(k, 0.0)
                                                            for r in runs) for k in keys}}
    told = [r["culprit_line_ms"] for r in runs if r["culprit_line_ms"] is not None]
    if told:
        res["run"]["culprit_line_median_ms"] = statistics.median(told)
        res["run"]["culprit_line_after_bare_x_plain"] = (statistics.median(told) - bare_ms) / step
        res["run"]["startup_median_ms"] = statistics.median(r["startup_ms"] for r in runs
                                                            if r["startup_ms"] is not None)
    if "with_remedies" in res:
        res["with_remedies"]["after_bare_x_plain"] = \
            (res["with_remedies"]["ms"] - bare_ms) / step
    res["culprit"] = runs[-1]["culprit"]
    res["planted_found"] = all(planted(r["culprit"], fault, n) for r in runs)
    res["guard"] = {"step_x_plain": res["steps"]["guard_x_plain"],
                    "capture_peak_rss_mib": res["capture"]["peak_rss_mib"],
                    "capture_peak_x_training": res["capture"]["peak_rss_mib"]
                    / res["training_peak_rss_mib"]}
    res["loadavg_end"] = os.getloadavg()
    if not res["planted_found"]:
        print(f"[{size} {fault}] NOT the planted culprit: {[r['culprit'] for r in runs]}",
              file=sys.stderr)
    return res


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def gb(mib: float) -> str:
    return f"{mib / 1024:.2f} GB"


def table(results: list[dict]) -> str:
    lines = []
    for fault in dict.fromkeys(r["fault"] for r in results):
        lines += [f"\n**fault in {fault}**\n",
                  "| model | plain step | `nanbisect run --no-remedies` peak memory vs the "
                  "training peak | time to culprit in plain steps (run less a bare import): "
                  "wall / CPU | the culprit line, plain steps after a bare import | with "
                  "remedies, plain steps | Guard step, x plain | Guard (capture) peak vs "
                  "training peak | culprit | load avg |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in results if r["fault"] == fault):
            run, g, c = r["run"], r["guard"], r["culprit"]
            what = c.get("parameter") if fault == "optimizer" and c.get("parameter") else \
                f"`{c.get('op')}` in `{c.get('module')}`"
            lines.append(
                f"| d={r['d']}, L={r['blocks']} ({r['n_params'] / 1e6:.1f}M) | "
                f"{r['steps']['plain_median_ms']:.0f} ms | {gb(run['peak_rss_mib'])} vs "
                f"{gb(r['training_peak_rss_mib'])} ({run['peak_x_training']:.2f}x) | "
                f"{run['after_bare_x_plain']:.1f} / {run['cpu_after_bare_x_plain_cpu']:.1f} | "
                f"{_fmt(run.get('culprit_line_after_bare_x_plain'))} | "
                f"{_fmt((r.get('with_remedies') or {}).get('after_bare_x_plain'))} | "
                f"{g['step_x_plain']:.2f}x | "
                f"{gb(g['capture_peak_rss_mib'])} ({g['capture_peak_x_training']:.2f}x) | "
                f"{c.get('phase')}: {what}{'' if r['planted_found'] else ' **NOT PLANTED**'} | "
                f"{r['loadavg_start'][0]:.1f}-{r['loadavg_end'][0]:.1f} |")
        lines.append("\n`timings` of report.json (median s), and the start-up (the process's "
                     "start to the pipeline's):\n")
        for r in (r for r in results if r["fault"] == fault):
            t = r["run"]["timings_median_s"]
            start = r["run"].get("startup_median_ms")
            lines.append(f"- {r['size']}: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items())
                         + (f"; start-up {start / 1000:.2f} (a bare import "
                            f"{r['bare_import']['median_ms'] / 1000:.2f})"
                            if start is not None else ""))
    return "\n".join(lines)


def profile_text(res: dict) -> str:
    lines = [f"profile {res['size']}:{res['fault']}: VmHWM {gb(res['vmhwm_mib'])}, highest "
             f"sample {res['peak_sample'][1]} MiB at {res['peak_sample'][0]} s; culprit "
             f"{res['culprit']}", "", "| pass | seconds | RSS at start, MiB | max RSS in it, MiB |",
             "|---|---:|---:|---:|"]
    for p in res["passes"]:
        lines.append(f"| {p['key']} | {p['seconds']:.2f} | {p['start_rss_mib']:.0f} | "
                     f"{p['max_rss_mib']:.0f} |")
    top = max(res["walks"], key=lambda w: w["rss_mib"])
    lines += ["", f"holders at the highest walk ({top['why']}, RSS {top['rss_mib']:.0f} MiB):"]
    groups = sorted(((k, v) for k, v in top["holders"].items() if isinstance(v, dict)),
                    key=lambda kv: -kv[1]["bytes"])
    for k, v in groups:
        lines.append(f"- {k}: {v['bytes'] / 2**20:.0f} MiB in {v['storages']} storages")
    seen = sum(v["bytes"] for v in top["holders"].values() if isinstance(v, dict)) / 2**20
    base = res["passes"][0]["start_rss_mib"] if res["passes"] else 0.0
    lines.append(f"- not seen as Python tensors (autograd's saved tensors, allocator caches, "
                 f"...): {top['rss_mib'] - base - seen:.0f} MiB (RSS less the {base:.0f} MiB "
                 "at the first pass, less the groups above; storages shared by two groups are "
                 "counted twice)")
    for o in top["holders"]["other"]["largest"]:
        lines.append(f"  - other: {o['bytes'] / 2**20:.0f} MiB {o['dtype']} {o['shape']} held by "
                     f"{o['referrers']}")
    lines.append("\nholders at each walk (MiB): " + "; ".join(
        f"{w['why']} @{w['rss_mib']:.0f}: " + ", ".join(
            f"{k.split(' ')[0]} {v['bytes'] / 2**20:.0f}" for k, v in w["holders"].items()
            if isinstance(v, dict)) for w in res["walks"]))
    return "\n".join(lines)


def profile(spec: str, work: Path) -> dict:
    size, _, fault = spec.partition(":")
    env = {SIZE_ENV: size, FAULT_ENV: fault}
    entry = write_task(work)
    me = [sys.executable, str(Path(__file__).resolve())]
    print(f"[profile {spec}] capture ...", file=sys.stderr, flush=True)
    bundle = last_json(launch(me + ["--child", "capture", entry, str(work / "bundles")],
                              env)[0])["bundle"]
    print(f"[profile {spec}] run_bundle ...", file=sys.stderr, flush=True)
    out, wall, peak, _ = launch(me + ["--child", "profile", entry, bundle,
                                   str(work / "profile-report")], env)
    return {"size": size, "fault": fault, "wall_s": wall, "peak_rss_mib": peak,
            **last_json(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--reps", type=int, default=2, help="rounds of bare import + nanbisect run")
    ap.add_argument("--steps", type=int, default=3, help="plain and Guard steps timed")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (kept), else a temporary one")
    ap.add_argument("--profile", metavar="SIZE:FAULT")
    ap.add_argument("--with-remedies", action="store_true",
                    help="also one run with remedies (the default budget) per size and fault")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, entry, *rest = args.child
        if kind == "capture":
            res = child_capture(entry, rest[0])
        elif kind == "plain":
            res = child_plain(entry)
        elif kind == "steps":
            res = child_steps(entry, rest[0], int(rest[1]), rest[2])
        else:
            res = child_profile(rest[0], rest[1])
        print(json.dumps(res, default=str))
        return
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    env_note = {"python": sys.executable, "PYTHONPATH": os.environ.get("PYTHONPATH"),
                "cwd": str(ROOT)}
    try:
        if args.profile:
            res = profile(args.profile, work) | env_note
            print(profile_text(res))
            if args.json:
                Path(args.json).write_text(json.dumps(res, indent=1, default=str))
            return
        results = []
        for size in args.sizes.split(","):
            for fault in args.faults.split(","):
                results.append(one(size, fault, work, args.reps, args.steps,
                                   args.with_remedies))
                shutil.rmtree(work / f"{size}-{fault}" / "bundles", ignore_errors=True)
                if args.json:     # as it goes: a later size that fails keeps the earlier ones
                    Path(args.json).write_text(json.dumps(
                        {"results": results, **env_note}, indent=1, default=str))
        print(table(results))
        if not all(r["planted_found"] for r in results):
            sys.exit("some run did not name the planted culprit (see the table)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
