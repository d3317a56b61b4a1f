"""Benchmark: op-level bisection of a forward NaN in a ~5M-parameter GPT (issue 3).

The workload: the tests' GPT (fixtures/tasks/tinygpt.py) built bigger: a pre-norm causal
transformer (6 layers, d_model 256, 8 heads, MLP 1024, vocab 1000 with tied embedding and head,
5.0M fp32 parameters, AdamW) trained on 8 x 256 random tokens. Layer 5 (the last) has
an MLP activation ``gelu(x) * sqrt(1 + x / limit)``; with the fault switched on (``FAULT``, read by
``make_task``) the limit is 2 and a few pre-activations below -2 make ``aten.sqrt`` return NaN
in the forward pass. The same file with ``FAULT = False`` (limit 1e4) is the healthy model with the
same op sequence. The script trains 3 healthy steps under `nanbisect.Guard` (so AdamW has state),
plants the fault, lets the Guard write the bundle into a temporary directory, and then measures,
in one run:

* time: `run_bundle` wall time in this process (no interpreter or import start-up), with the repro
  subprocess and with ``RunOptions(run_repro=False)``, as a multiple of the median plain training
  step (zero_grad, forward, backward, AdamW step) of the same model from the same pre-step state,
  timed between the `run_bundle` calls (so a busy machine slows both alike); and how that time
  splits across the passes, from the progress callback `run_bundle` reports each pass to;
* bytes: the report directory (report.json/.md/.html, repro/) against a full per-op dump of the
  same step, i.e. every aten op's outputs in forward + backward + optimizer. The dump is not
  written: its size is the sum of the outputs' ``nbytes`` seen by a `TorchDispatchMode`;
* memory: peak RSS (``ru_maxrss``) of separate processes, each started by a small launcher
  without torch (a child's ``ru_maxrss`` starts from its parent's peak on Linux): a baseline that
  imports torch and nanbisect and builds the model, a plain one that also runs two training steps
  (the second with AdamW state, as at the bundle's step), and one that runs `run_bundle` (it builds
  its own model); each with glibc's default allocator settings and with a fixed mmap threshold
  (``MALLOC_MMAP_THRESHOLD_``), which shows live memory rather than freed memory glibc keeps;
* peers on the same bundle state: ``torch.autograd.detect_anomaly()`` and transformers'
  ``DebugUnderflowOverflow``: what each names, and the cost of the faulty step (until it raises)
  and of a healthy step under it, against plain steps interleaved with them. transformers is
  never installed into the running Python: the script makes a venv with
  ``--system-site-packages`` (default /tmp/nanbisect-bench-venv), pip-installs transformers there,
  and runs that peer in the venv's python.

What the numbers are not: GPU figures; figures for backward or optimizer faults (a forward fault
stops every nanbisect pass after the forward, so no backward is replayed here); cold-start CLI
times (``nanbisect run`` also pays interpreter start, ``import torch`` and torch's lazy import of
``torch._dynamo`` on the first optimizer built, ~3 s together on the 2-core machine);
the cost of a full dump that is actually written (write bandwidth is not measured).

    python scripts/bench_bisect.py [--steps 8] [--reps 5] [--json out.json] [--no-transformers]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import nanbisect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures" / "tasks"))
import tinygpt  # noqa: E402  (the tests' GPT, built bigger; its plain_step is the baseline)
from tinygpt import plain_step  # noqa: E402

CONFIG = dict(vocab=1000, dim=256, heads=8, n_layers=6, seq=256, batch=8, lr=3e-4,
              weight_decay=0.1, seed=0)
# Other sizes of the same model (scripts/bench_culprit.py), chosen by NANBISECT_BENCH_SIZE in the
# environment, so that the entry this file is (run by `nanbisect run` in another interpreter)
# builds the same one. Plain step on the 2-core machine: ~0.05 s, ~0.35 s, ~2 s.
SIZES = {"small": dict(dim=128, heads=4, n_layers=4, seq=128, batch=2),
         "medium": dict(dim=256, heads=8, n_layers=6, seq=256, batch=4),
         "large": dict(vocab=2000, dim=512, heads=8, n_layers=8, seq=256, batch=7)}
CONFIG.update(SIZES.get(os.environ.get("NANBISECT_BENCH_SIZE", ""), {}))
FAULT = True          # the switch `make_task` reads: True plants the NaN in layer FAULT_LAYER
FAULT_LAYER = CONFIG["n_layers"] - 1       # the last layer
FAULT_LIMIT = 2.0     # pre-activations below -2 exist in every step: sqrt(1 + x/2) is NaN there
HEALTHY_LIMIT = 1e4   # far beyond any pre-activation: same ops, no NaN
WARMUP_STEPS = 3      # healthy guarded steps before the fault is planted (AdamW gets state)
ENTRY = f"{os.path.relpath(os.path.abspath(__file__))}:make_task"  # scripts/bench_bisect.py:...
DEFAULT_VENV = Path(tempfile.gettempdir()) / "nanbisect-bench-venv"


def repro_startup_ms(reps: int) -> dict:
    """Wall time of a fresh interpreter doing only what repro.py does before its first op:
    start Python and import its modules (torch, safetensors). The bar excludes start-up."""
    code = ("import argparse, importlib.util, json, os, sys\nimport torch\n"
            "from safetensors import safe_open")
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(ms(time.perf_counter() - t0))
    return {"ms": times, "median_ms": statistics.median(times)}


# ------------------------------------------------------------------------------------------
# the model and its task


class SqrtGate(nn.Module):
    """GELU scaled by sqrt(1 + x / limit): NaN wherever x < -limit."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x):
        return F.gelu(x) * torch.sqrt(1 + x / self.limit)


def set_fault(model: nn.Module, on: bool) -> None:
    """What ``FAULT`` decides at build time, switched on an existing model."""
    model.blocks[FAULT_LAYER].mlp.act.limit = FAULT_LIMIT if on else HEALTHY_LIMIT


def make_task(fault: bool | None = None) -> nanbisect.Task:
    """The entry: ``scripts/bench_bisect.py:make_task``; builds the faulty model when FAULT."""
    fault = FAULT if fault is None else fault
    torch.manual_seed(CONFIG["seed"])
    acts = [SqrtGate(FAULT_LIMIT if fault else HEALTHY_LIMIT) if i == FAULT_LAYER else nn.GELU()
            for i in range(CONFIG["n_layers"])]
    model = tinygpt.TinyGPT(acts, vocab=CONFIG["vocab"], dim=CONFIG["dim"],
                            heads=CONFIG["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"],
                            weight_decay=CONFIG["weight_decay"])
    return nanbisect.Task(model=model, optimizer=opt, loss_fn=tinygpt.lm_loss)


def make_batches(n: int = 8) -> list[dict]:
    return [tinygpt.make_batch(1 + i, pad=0, batch=CONFIG["batch"], seq=CONFIG["seq"],
                               vocab=CONFIG["vocab"]) for i in range(n)]


def make_bundle(out: Path) -> tuple[Path, dict]:
    """Healthy guarded steps, then the fault: the Guard writes the failing step's bundle."""
    task, batches = make_task(fault=False), make_batches()
    guard = nanbisect.Guard(task, entry=ENTRY, out=out)
    for i in range(WARMUP_STEPS):
        guard.step(batches[i])
    set_fault(task.model, True)
    try:
        guard.step(batches[WARMUP_STEPS])
    except nanbisect.NonFiniteStep as e:
        return Path(e.bundle), e.observed
    raise RuntimeError(f"the planted fault did not fire (limit {FAULT_LIMIT}); lower FAULT_LIMIT")


def replayer(bundle: Path):
    """The bundle's task, restorable to the failing step's pre-step state (`.restore()`)."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.replay.replayer import Replayer
    return Replayer(read_bundle(bundle), torch.device("cpu"))


def ms(seconds: float) -> float:
    return 1e3 * seconds


def timed_step(rep, fault: bool, step=plain_step) -> tuple[float, object]:
    """Restore the bundle's pre-step state (untimed), then time ``step``: (ms, its result)."""
    set_fault(rep.task.model, fault)
    batch = rep.restore()
    t0 = time.perf_counter()
    out = step(rep.task, batch)
    return ms(time.perf_counter() - t0), out


# ------------------------------------------------------------------------------------------
# time


def plain_step_times(rep, n: int) -> dict:
    """Plain steps from the bundle's pre-step state (healthy, faulty) and a healthy forward alone,
    interleaved; the state is restored (untimed) before each."""
    variants = {"healthy": (False, plain_step), "faulty": (True, plain_step),
                "forward": (False, lambda task, batch: task.loss_fn(task.model, batch).item())}
    times, losses = defaultdict(list), defaultdict(set)
    for i in range(n + 1):  # round 0 warms the allocator and is not counted
        for name in (list(variants) if i % 2 else list(variants)[::-1]):
            dt, loss = timed_step(rep, *variants[name])
            if i:
                times[name].append(dt)
                losses[name].add(repr(loss))
    out = {}
    for name in variants:
        out[f"{name}_ms"] = times[name]
        out[f"{name}_median_ms"] = statistics.median(times[name])
        out[f"{name}_losses"] = sorted(losses[name])
    return out


class StageClock:
    """`run_bundle`'s progress callback: when each pass began, so its time is up to the next."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def __call__(self, key: str, text: str) -> None:
        self.marks.append((key, time.perf_counter()))

    def pieces(self, end: float) -> dict[str, float]:
        """ms per pass; before the first pass: reading and verifying the bundle."""
        out = {"read + verify bundle": ms(self.marks[0][1] - self.t0) if self.marks else 0.0}
        for (key, t), nxt in zip(self.marks, [m[1] for m in self.marks[1:]] + [end]):
            out[PASS_NAMES.get(key, key)] = out.get(PASS_NAMES.get(key, key), 0.0) + ms(nxt - t)
        return out


# run_bundle's progress keys (nanbisect.pipeline.STAGES) as the tables name them
PASS_NAMES = {"build": "task build (import entry, init model, load tensors)",
              "module-pass": "pass 1: module statistics", "op-recording": "pass 2: op recording",
              "input-catch": "pass 3: input catch", "repro": "repro verification (its wait)",
              "report": "report writing (json, md, html)"}


def time_run_bundle(bundle: Path, work: Path, reps: int, rep) -> dict:
    """`run_bundle` wall time, with and without the repro subprocess, alternating; after each
    call one plain step (on ``rep``), so the ratio's denominator comes from the same minutes."""
    from nanbisect.pipeline import RunOptions, run_bundle
    runs, plain, cold = {True: [], False: []}, [], None
    for i in range(reps + 1):  # run 0 is the cold one (imports the entry file): reported apart
        for with_repro in ((True, False) if i % 2 == 0 else (False, True)):
            out = work / f"report-{i}-{int(with_repro)}"
            clock = StageClock()
            report = run_bundle(bundle, RunOptions(run_repro=with_repro), out, clock)
            end = time.perf_counter()
            row = {"total_ms": ms(end - clock.t0), "pieces_ms": clock.pieces(end), "out": str(out),
                   "report": report}
            if i == 0 and cold is None:
                cold = row
            elif i:
                runs[with_repro].append(row)
                plain.append(timed_step(rep, False)[0])

    def summary(rows: list[dict]) -> dict:
        keys = list(dict.fromkeys(k for r in rows for k in r["pieces_ms"]))
        return {"total_ms": [r["total_ms"] for r in rows],
                "median_ms": statistics.median(r["total_ms"] for r in rows),
                "pieces_median_ms": {k: statistics.median(r["pieces_ms"].get(k, 0.0) for r in rows)
                                     for k in keys}}

    last = runs[True][-1]
    rep = last["report"]
    culprit = rep.culprit.__dict__ if rep.culprit is not None else None
    return {"plain_ms": plain, "plain_median_ms": statistics.median(plain),
            "cold_ms": cold["total_ms"], "cold_with_repro": True,
            "cold_pieces_ms": cold["pieces_ms"],
            "with_repro": summary(runs[True]), "without_repro": summary(runs[False]),
            "verdict": rep.verdict, "phase": rep.phase, "culprit": culprit,
            "repro_result": rep.repro_result, "report_dir": last["out"],
            "report_dir_no_repro_run": runs[False][-1]["out"]}


# ------------------------------------------------------------------------------------------
# bytes


def dir_bytes(path: Path) -> tuple[int, dict[str, int]]:
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
             if p.is_file()}
    return sum(files.values()), files


class OutputBytes(TorchDispatchMode):
    """Sum ``nbytes`` of every tensor every aten op returns (what a per-op dump would save)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: dict[str, int] = defaultdict(int)
        self.all: dict[str, int] = defaultdict(int)
        self.fresh: dict[str, int] = defaultdict(int)  # outputs that are not views / in-place

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors:
            self.ops[self.phase] += 1
            aliases = any(r.alias_info is not None for r in func._schema.returns)
            n = sum(t.numel() * t.element_size() for t in tensors)
            self.all[self.phase] += n
            if not aliases:
                self.fresh[self.phase] += n
        return out


def full_dump_bytes(rep) -> dict:
    """Per-op output bytes of the failing step (forward NaN, backward and AdamW still run)."""
    set_fault(rep.task.model, True)
    batch = rep.restore()
    task, mode = rep.task, OutputBytes()
    with mode:
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(task.model, batch)
        mode.phase = "backward"
        loss.backward()
        mode.phase = "optimizer"
        task.optimizer.step()
    phases = ("forward", "backward", "optimizer")
    return {"ops": {p: mode.ops[p] for p in phases},
            "all_bytes": {p: mode.all[p] for p in phases},
            "fresh_bytes": {p: mode.fresh[p] for p in phases},
            "total_all": sum(mode.all.values()), "total_fresh": sum(mode.fresh.values())}


# ------------------------------------------------------------------------------------------
# memory (each mode runs in its own process: python scripts/bench_bisect.py --probe-mem MODE)


def maxrss_mib(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


def vmhwm_mib() -> float:
    """Peak RSS of this process's current address space (reset by exec), from /proc."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 1024


def probe_mem(mode: str, bundle: str | None, out: str | None) -> dict:
    res = {"mode": mode, "after_imports_mib": maxrss_mib()}
    if mode == "nanbisect":
        from nanbisect.pipeline import RunOptions, run_bundle
        report = run_bundle(bundle, RunOptions(run_repro=True), Path(out))
        res["verdict"], res["op"] = report.verdict, report.culprit.op
    else:
        task, batches = make_task(fault=False), make_batches(2)
        res["after_build_mib"] = maxrss_mib()
        if mode == "plain":
            plain_step(task, batches[0])  # creates the AdamW state
            res["after_step1_mib"] = maxrss_mib()
            plain_step(task, batches[1])  # a step with AdamW state, as at the bundle's step
    res["maxrss_mib"], res["vmhwm_mib"] = maxrss_mib(), vmhwm_mib()
    return res


# NB: on Linux a child's ru_maxrss starts from its parent's peak RSS (exec records the peak of
# the address space it replaces, which vfork shares with the parent). This process is large by
# now, so every measured process is started by a small launcher without torch, and the launcher
# reports its only child's peak (RUSAGE_CHILDREN).
LAUNCHER = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print('CHILD_MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
            "sys.exit(rc)")


def launch(cmd: list[str], cwd: Path | None = None, env: dict | None = None
           ) -> tuple[str, float]:
    """Run ``cmd`` under the launcher; return its stdout and its peak RSS in MiB."""
    p = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], capture_output=True, text=True,
                       cwd=cwd, env=None if env is None else {**os.environ, **env})
    m = re.search(r"^CHILD_MAXRSS_KIB (\d+)$", p.stdout, flags=re.M)
    if m is None:
        raise RuntimeError(f"{cmd} failed: {(p.stdout + p.stderr)[-1500:]}")
    return p.stdout[:m.start()], int(m.group(1)) / 1024


MEM_MODES = ("baseline", "plain", "nanbisect")
# glibc's default mmap threshold adapts upwards, after which freed blocks of tens of MB stay in
# the heap (RSS) instead of going back to the OS; a fixed threshold shows live memory instead.
ALLOCATORS = {"default": None, "mmap_threshold_128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def memory(bundle: Path, work: Path, repro: Path) -> dict:
    out = {}
    for alloc, env in ALLOCATORS.items():
        res = out[alloc] = {}
        for mode in MEM_MODES:
            stdout, peak = launch([sys.executable, os.path.abspath(__file__), "--probe-mem", mode,
                                   "--bundle", str(bundle), "--out",
                                   str(work / f"mem-{alloc}-{mode}")], env=env)
            res[mode] = json.loads(stdout.strip().splitlines()[-1]) | {"launcher_mib": peak}
        base, pl = res["baseline"]["maxrss_mib"], res["plain"]["maxrss_mib"]
        nb = res["nanbisect"]["maxrss_mib"]
        res["ratio_raw"], res["ratio_over_baseline"] = nb / pl, (nb - base) / (pl - base)
    # the repro subprocess run_bundle starts, run again on its own (exit 1 = reproduced)
    out["repro_subprocess_mib"] = launch([sys.executable, str(repro), "--device", "cpu"],
                                         cwd=repro.parent.parent)[1]
    return out


# ------------------------------------------------------------------------------------------
# peers


def _user_frame(text: str) -> str | None:
    """Last 'file:line (function)' of a traceback text that is not inside torch."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', text)
    user = [f for f in frames if "/torch/" not in f[0]]
    if not user:
        return None
    path, line, fn = user[-1]
    return f"{os.path.relpath(path)}:{line} ({fn})"


def anomaly_step(said: dict):
    """A plain step under detect_anomaly; what it raised and warned goes into ``said``."""
    def step(task, batch):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autograd.detect_anomaly():
                    plain_step(task, batch)
            except RuntimeError as e:
                trace = "\n".join(str(w.message) for w in caught
                                  if "Traceback of forward call" in str(w.message))
                said.update(error=str(e), forward_traceback_user_frame=_user_frame(trace),
                            warning_head=trace.splitlines()[0] if trace else None)
    return step


def interleaved(rep, variants: dict, n: int) -> dict[str, list[float]]:
    """``n`` timed rounds (after one warm-up round) of every variant, alternating the order."""
    times = defaultdict(list)
    for i in range(n + 1):
        for name in (list(variants) if i % 2 else list(variants)[::-1]):
            fault, step = variants[name]
            dt, _ = timed_step(rep, fault, step)
            if i:
                times[name].append(dt)
    return times


def ratios(times: dict[str, list[float]]) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ms": dict(times), "median_ms": med,
            "x_plain": {k: v / med["plain"] for k, v in med.items()}}


def anomaly_peer(rep, n: int) -> dict:
    """Plain step, healthy step under detect_anomaly, faulty step under it (until it raises)."""
    said: dict = {}
    times = interleaved(rep, {"plain": (False, plain_step),
                              "healthy": (False, anomaly_step({})),
                              "faulty": (True, anomaly_step(said))}, n)
    m = re.search(r"Function '(\w+)' returned nan", said.get("error") or "")
    return {**said, "names": m.group(1) if m else None, **ratios(times)}


def duo_peer(bundle: str, n: int) -> dict:
    """transformers' DebugUnderflowOverflow; runs in the venv (``--probe-duo``)."""
    import transformers
    from transformers.debug_utils import DebugUnderflowOverflow

    rep, said = replayer(Path(bundle)), {}

    def unhook(model):  # DebugUnderflowOverflow keeps no hook handles, and stays tripped
        for m in model.modules():
            m._forward_hooks.clear()

    def plain(task, batch):
        unhook(task.model)
        return plain_step(task, batch)

    def under_duo(task, batch):
        unhook(task.model)
        DebugUnderflowOverflow(task.model)  # hooks every module's forward
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                plain_step(task, batch)
        except ValueError as e:
            said.update(error=str(e), printed=buf.getvalue())

    times = interleaved(rep, {"plain": (False, plain), "healthy": (False, under_duo),
                              "faulty": (True, under_duo)}, n)
    printed = said.get("printed", "")
    frames = re.findall(r"^ {17} (\S+) (\w+)$", printed, flags=re.M)
    return {"transformers": transformers.__version__, **ratios(times),
            "error": said.get("error"), "last_frame": list(frames[-1]) if frames else None,
            "nan_lines": [ln for ln in printed.splitlines() if "has nans" in ln or
                          "has infs" in ln],
            "printed_lines": len(printed.splitlines()), "printed_tail": printed.strip()[-1500:]}


def ensure_venv(venv: Path) -> Path:
    """A venv that sees the system torch and has transformers; the system python is untouched."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       check=True)
    have = subprocess.run([str(py), "-c", "import transformers.debug_utils"],
                          capture_output=True).returncode == 0
    if not have:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "transformers"], check=True)
    return py


def transformers_peer(bundle: Path, venv: Path, n: int) -> dict:
    py = ensure_venv(venv)
    p = subprocess.run([str(py), os.path.abspath(__file__), "--probe-duo", "--bundle",
                        str(bundle), "--steps", str(n)], capture_output=True, text=True)
    if p.returncode != 0:
        return {"error_running": (p.stdout + p.stderr)[-2000:]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["python"] = str(py)
    return res


# ------------------------------------------------------------------------------------------
# main


def fmt_x(x: float) -> str:
    return f"{x:.2f}x"


def print_tables(res: dict) -> None:
    ps, t = res["plain_step"], res["run_bundle"]
    plain, plain_rb = ps["healthy_median_ms"], t["plain_median_ms"]
    c = t["culprit"] or {}
    print(f"model: {res['n_params']:,} params, AdamW, batch {CONFIG['batch']}x{CONFIG['seq']}, "
          f"fault: aten.sqrt in blocks.{FAULT_LAYER}.mlp.act | torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads | bundle {res['bundle_bytes'] / 2**20:.1f} MiB | "
          f"load average at start {res['loadavg_start'][0]:.2f}, end {res['loadavg_end'][0]:.2f}\n")
    print(f"nanbisect says: verdict={t['verdict']} phase={t['phase']} op={c.get('op')} "
          f"module={c.get('module')} call={c.get('module_call')} source={c.get('source')} "
          f"op_index={c.get('op_index')}; repro: {t['repro_result']}\n")
    print("| time | median ms | x plain step | bar |\n|---|---:|---:|---|")
    print(f"| plain step, healthy, from the bundle's pre-step state | {plain:.0f} | 1.00x | |")
    for key, name in (("faulty", f"plain step, faulty (NaN from layer {FAULT_LAYER} on)"),
                      ("forward", "plain forward alone, healthy (loss_fn only)")):
        v = ps[f"{key}_median_ms"]
        print(f"| {name} | {v:.0f} | {fmt_x(v / plain)} | |")
    print(f"| plain step, healthy, timed between the run_bundle calls | {plain_rb:.0f} | "
          f"{fmt_x(plain_rb / plain)} | |")
    for key, name in (("with_repro", "run_bundle, repro subprocess included"),
                      ("without_repro", "run_bundle, RunOptions(run_repro=False)")):
        v = t[key]["median_ms"]
        print(f"| {name} | {v:.0f} | **{fmt_x(v / plain_rb)}** | 5x: "
              f"{'met' if v / plain_rb <= 5 else 'missed'} |")
    su = res["repro_startup_ms"]["median_ms"]
    v = t["with_repro"]["median_ms"] - su
    print(f"| run_bundle with repro, less the repro's interpreter + import start-up "
          f"({su:.0f} ms, timed alone) | {v:.0f} | **{fmt_x(v / plain_rb)}** | 5x: "
          f"{'met' if v / plain_rb <= 5 else 'missed'} |")
    print(f"| run_bundle, first call in the process (with repro) | {t['cold_ms']:.0f} | "
          f"{fmt_x(t['cold_ms'] / plain_rb)} | |")
    print("\n(run_bundle rows: x the plain steps timed between the run_bundle calls)\n")
    print("| piece of run_bundle | with repro, ms | x plain | without repro, ms |\n"
          "|---|---:|---:|---:|")
    w, wo = t["with_repro"]["pieces_median_ms"], t["without_repro"]["pieces_median_ms"]
    for k in w:
        print(f"| {k} | {w[k]:.0f} | {w[k] / plain_rb:.2f} | {wo.get(k, 0.0):.0f} |")
    b, d = res["bytes"], res["full_dump"]
    print("\n| bytes | bytes | share of full dump |\n|---|---:|---:|")
    print(f"| report dir (incl. repro/) | {b['report_total']:,} | "
          f"**{100 * b['report_total'] / d['total_all']:.4f}%** |")
    for name, size in b["report_files"].items():
        print(f"| &nbsp; {name} | {size:,} | |")
    print(f"| full per-op dump, all outputs (fwd {d['ops']['forward']} + bwd "
          f"{d['ops']['backward']} + opt {d['ops']['optimizer']} ops) | {d['total_all']:,} | "
          f"100% |")
    print(f"| full per-op dump, views and in-place outputs left out | {d['total_fresh']:,} | "
          f"{100 * d['total_fresh'] / d['total_all']:.1f}% |")
    print(f"| forward-only dump (the failing phase), all outputs | "
          f"{d['all_bytes']['forward']:,} | {100 * d['all_bytes']['forward'] / d['total_all']:.1f}%"
          f" |")
    m = res["memory"]
    md, mm = m["default"], m["mmap_threshold_128k"]
    print("\n| peak RSS of its own process, MiB (ru_maxrss) | glibc default | "
          "MALLOC_MMAP_THRESHOLD_=131072 |\n|---|---:|---:|")
    rows = (("baseline", "baseline: import torch + nanbisect, build model"),
            ("plain", "plain: baseline + 2 training steps"),
            ("nanbisect", "nanbisect: import + run_bundle (builds its own model)"))
    for key, name in rows:
        print(f"| {name} | {md[key]['maxrss_mib']:.0f} | {mm[key]['maxrss_mib']:.0f} |")
    print(f"| repro.py on its own (run_bundle's subprocess) | {m['repro_subprocess_mib']:.0f} | |")
    print(f"| nanbisect / plain: raw; above baseline (bar 1.5x) | {md['ratio_raw']:.2f}x; "
          f"**{md['ratio_over_baseline']:.2f}x** | {mm['ratio_raw']:.2f}x; "
          f"**{mm['ratio_over_baseline']:.2f}x** |")
    print()
    a, h = res["peers"]["detect_anomaly"], res["peers"].get("transformers", {})
    right_module = f"blocks.{FAULT_LAYER}.mlp.act"
    print("| tool | what it names | right op? | right module? | faulty step, x plain | "
          "healthy step, x plain |\n|---|---|---|---|---:|---:|")
    print(f"| nanbisect run_bundle | `{c.get('op')}` in `{c.get('module')}` call "
          f"{c.get('module_call')}, {c.get('source')} | {c.get('op') == 'aten.sqrt.default'} | "
          f"{c.get('module') == right_module} | {fmt_x(t['with_repro']['median_ms'] / plain_rb)}"
          f" ({fmt_x(t['without_repro']['median_ms'] / plain_rb)} without repro) | "
          f"Guard: see issue 2 |")
    ax = a["x_plain"]
    print(f"| torch.autograd.detect_anomaly() | `{a.get('names')}`, forward line "
          f"{a.get('forward_traceback_user_frame')} | {a.get('names') == 'SqrtBackward0'} | "
          f"(no modules) | {fmt_x(ax['faulty'])} | {fmt_x(ax['healthy'])} |")
    if "error_running" in h:
        print(f"| DebugUnderflowOverflow | failed to run: {h['error_running'][-200:]} | | | | |")
    elif h:
        last, hx = h["last_frame"] or ["?", "?"], h["x_plain"]
        print(f"| transformers {h['transformers']} DebugUnderflowOverflow | last frame "
              f"`{last[0]}` ({last[1]}), {'; '.join(h['nan_lines'])} | (no ops) | "
              f"{last[0] == right_module} | {fmt_x(hx['faulty'])} | {fmt_x(hx['healthy'])} |")
    print("\n(peer rows: x plain steps interleaved with that peer's steps, in its own process)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured plain steps per variant")
    ap.add_argument("--reps", type=int, default=5, help="measured run_bundle calls per variant")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help="venv for the transformers peer (made with --system-site-packages)")
    ap.add_argument("--no-transformers", action="store_true", help="skip that peer")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (kept) instead of a temp dir")
    ap.add_argument("--probe-mem", choices=MEM_MODES, help=argparse.SUPPRESS)
    ap.add_argument("--probe-duo", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bundle", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe_mem:
        print(json.dumps(probe_mem(args.probe_mem, args.bundle, args.out)))
        return
    if args.probe_duo:
        print(json.dumps(duo_peer(args.bundle, args.steps)))
        return

    with contextlib.ExitStack() as stack:
        if args.keep:
            work = Path(args.keep)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_bisect-")))
        bundle, observed = make_bundle(work / "bundles")
        rep = replayer(bundle)
        res = {"config": CONFIG, "fault": {"layer": FAULT_LAYER, "limit": FAULT_LIMIT},
               "n_params": sum(p.numel() for p in rep.task.model.parameters()),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "python": platform.python_version(), "platform": platform.platform(),
               "loadavg_start": os.getloadavg(), "bundle": str(bundle),
               "bundle_bytes": dir_bytes(bundle)[0], "observed": observed}
        print("timing plain steps ...", file=sys.stderr)
        res["plain_step"] = plain_step_times(rep, args.steps)
        print("timing run_bundle ...", file=sys.stderr)
        res["run_bundle"] = time_run_bundle(bundle, work, args.reps, rep)
        print("timing the repro's interpreter + imports alone ...", file=sys.stderr)
        res["repro_startup_ms"] = repro_startup_ms(args.reps)
        total, files = dir_bytes(Path(res["run_bundle"]["report_dir"]))
        res["bytes"] = {"report_total": total, "report_files": files}
        print("counting a full per-op dump ...", file=sys.stderr)
        res["full_dump"] = full_dump_bytes(rep)
        print("detect_anomaly ...", file=sys.stderr)
        res["peers"] = {"detect_anomaly": anomaly_peer(rep, max(2, args.steps // 2))}
        del rep
        print("memory (subprocesses) ...", file=sys.stderr)
        repro = Path(res["run_bundle"]["report_dir"]) / "repro" / "repro.py"
        res["memory"] = memory(bundle, work, repro)
        if not args.no_transformers:
            print(f"DebugUnderflowOverflow (venv {args.venv}) ...", file=sys.stderr)
            res["peers"]["transformers"] = transformers_peer(bundle, args.venv,
                                                             max(2, args.steps // 2))
    res["loadavg_end"] = os.getloadavg()
    print_tables(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    main()
