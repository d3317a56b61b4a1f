"""Benchmark: time to culprit at three model sizes, split by pass (issue 15).

The workload is scripts/bench_bisect.py's GPT with its planted forward NaN (``aten.sqrt`` in the
last layer's MLP activation), built at three sizes (``bench_bisect.SIZES``: plain step ~0.05 s,
~0.35 s and ~2 s on the 2-core machine). Each size runs in its own process (the size is read from
``NANBISECT_BENCH_SIZE`` by the entry, so `nanbisect run` in a fresh interpreter builds the same
model), which:

* trains healthy steps under `nanbisect.Guard`, plants the fault and lets the Guard write the
  bundle;
* times plain training steps (zero_grad, forward, backward, AdamW step) from the bundle's
  pre-step state, interleaved with the runs below, so a busy machine slows both alike;
* times the CLI (``python -m nanbisect run B --json``, a fresh interpreter) and, in the
  same rounds, its start-up: A, ``python -c "import nanbisect.cli, nanbisect.pipeline"`` (python,
  torch, nanbisect); B, A plus building one optimizer (torch imports ``torch._dynamo`` lazily
  the first time a process builds one, ~1.5 s here: any training script pays it before its
  first step; ``nanbisect run`` does not, `nanbisect.util.dynamo` defers it); "after start-up"
  is the CLI's wall time less A;
* times, in the same rounds, ``nanbisect run --no-remedies`` (issue 29's measure: cold CLI until
  the culprit is printed, less a bare ``python -c "import torch, nanbisect"``), in wall time and
  in CPU time (the children's rusage around each run: on a loaded machine the CPU time is the
  steadier of the two), each against a plain step's;
* times ``run_bundle`` in this process, warm (the entry imported and torch's lazy imports done
  by a first, uncounted run), the repro's run included, split by pass (the progress callback:
  the same passes as ``report.json``'s ``timings``), with the remedies (issue 27: the default
  budget of 4 extra replays) and, in the same rounds, without them (``--no-remedies``), so
  what they add to the time to culprit is the difference;
* counts the report directory's bytes, and peak RSS of the CLI run against a plain run of two
  steps (separate processes, started by bench_bisect's launcher);
* runs the peers on the same state: ``torch.autograd.detect_anomaly()`` (and, without
  ``--no-transformers``, transformers' ``DebugUnderflowOverflow`` in a venv), cost of a healthy
  and of the faulty step under each against plain steps.

    python scripts/bench_culprit.py [--sizes small,medium,large] [--reps 3] [--steps 5]
                                    [--json out.json] [--no-transformers]
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZE_ENV = "NANBISECT_BENCH_SIZE"
PASSES = [("read", "read + verify bundle"), ("build", "task build"),
          ("module-pass", "pass 1: module statistics"), ("op-recording", "pass 2: op recording"),
          ("input-catch", "pass 3: input catch"), ("op-check", "op check on the reference"),
          ("remedies", "remedies (extra replays of the step)"),
          ("repro", "repro verification (waiting for it)"), ("module-repro", "module repro"),
          ("report", "report writing")]


def ms(s: float) -> float:
    return 1e3 * s


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: a subprocess's CPU is
    the difference around its run (a loaded machine inflates its wall time, less its CPU)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_size(size: str, reps: int, steps: int, transformers: bool, venv: Path) -> dict:
    """Everything for one size; runs in a process whose environment names the size."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench_bisect as bb
    from nanbisect.pipeline import RunOptions, run_bundle

    work = Path(tempfile.mkdtemp(prefix=f"bench_culprit-{size}-"))
    bundle, _ = bb.make_bundle(work / "bundles")
    rep = bb.replayer(bundle)
    res = {"size": size, "config": bb.CONFIG, "threads": torch.get_num_threads(),
           "n_params": sum(p.numel() for p in rep.task.model.parameters()),
           "loadavg_start": os.getloadavg()}
    plain, inproc, cli, cli_bare, startup, bare = [], [], [], [], [], []
    cpu: dict[str, list] = {"plain": [], "with": [], "without": []}   # this process's CPU, ms
    for i in range(reps + 1):           # round 0 warms up (imports, allocator): not counted
        for _ in range(steps if i else 1):
            c0 = time.process_time()
            dt = bb.timed_step(rep, False)[0]
            if i:
                plain.append(dt)
                cpu["plain"].append(ms(time.process_time() - c0))
        out = work / f"in-{i}"
        marks = [("read", time.perf_counter())]
        c0 = time.process_time()
        report = run_bundle(bundle, RunOptions(), out,
                            lambda key, text: marks.append((key, time.perf_counter())))
        end = time.perf_counter()
        if i:
            cpu["with"].append(ms(time.process_time() - c0))
        timings: dict = {}    # as report.json's timings, but read here (older versions lack it)
        for (key, t), nxt in zip(marks, [m[1] for m in marks[1:]] + [end]):
            timings[key] = timings.get(key, 0.0) + nxt - t
        if i:
            inproc.append({"total_ms": ms(end - marks[0][1]), "timings": timings})
        out = work / f"bare-{i}"               # the same run without remedies (--no-remedies)
        t0, c0 = time.perf_counter(), time.process_time()
        run_bundle(bundle, RunOptions(remedies=0), out)
        if i:
            bare.append({"total_ms": ms(time.perf_counter() - t0), "timings": {}})
            cpu["without"].append(ms(time.process_time() - c0))
        for rows, flags in ((cli, []), (cli_bare, ["--no-remedies"])):
            out = work / f"cli{'-'.join(flags)}-{i}"
            t0, c0 = time.perf_counter(), _children_cpu()
            p = subprocess.run([sys.executable, "-m", "nanbisect", "run", "--ckpt", str(bundle),
                                "--out", str(out), "--json", *flags], capture_output=True,
                               text=True, cwd=str(ROOT))
            total, cpu_s = time.perf_counter() - t0, _children_cpu() - c0
            if p.returncode != 1:
                raise RuntimeError(f"nanbisect run exited {p.returncode}: {p.stderr[-1500:]}")
            cli_rep = json.loads(p.stdout)
            if i:
                rows.append({"total_ms": ms(total), "timings": cli_rep.get("timings"),
                             "cpu_ms": ms(cpu_s)})
        # start-up: what `nanbisect run` loads before it reads the bundle (the same for every
        # version measured): python, torch, the pipeline's modules; and with torch's own lazy
        # import of torch._dynamo that building the first optimizer of a process pays (~1.5 s:
        # any training script pays it before its first step; the task build does here)
        row = {}
        for key, code in (("bare", "import torch, nanbisect"),
                          ("imports", "import nanbisect.cli, nanbisect.pipeline"),
                          ("imports_and_first_optimizer",
                           "import nanbisect.cli, nanbisect.pipeline, torch; "
                           "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)")):
            t0, c0 = time.perf_counter(), _children_cpu()
            subprocess.run([sys.executable, "-c", code], check=True, cwd=str(ROOT))
            row[key] = ms(time.perf_counter() - t0)
            row[key + "_cpu"] = ms(_children_cpu() - c0)
        if i:
            startup.append(row)
    c = report.culprit
    res["culprit"] = {"op": c.op, "module": c.module, "module_call": c.module_call,
                      "phase": c.phase, "source": c.source,
                      "reproduced": report.repro_result.reproduced if report.repro_result
                      else None, "samples": getattr(c, "samples", None)}
    res["remedies"] = [{"kind": m.kind, "outcome": m.outcome, "change": m.change}
                       for m in getattr(report, "remedies", [])]
    step = statistics.median(plain)
    res["plain_step_ms"] = {"median": step, "all": plain}

    def summary(rows):
        keys = list(dict.fromkeys(k for r in rows for k in (r["timings"] or {})))
        total = statistics.median(r["total_ms"] for r in rows)
        return {"median_ms": total, "x_plain": total / step, "all_ms": [r["total_ms"] for r in rows],
                "passes_ms": {k: statistics.median(ms((r["timings"] or {}).get(k, 0.0))
                                                   for r in rows) for k in keys}}

    res["run_bundle"] = summary(inproc)
    res["run_bundle_no_remedies"] = summary(bare)
    added = res["run_bundle"]["median_ms"] - res["run_bundle_no_remedies"]["median_ms"]
    res["remedies_add_ms"] = {"median_difference": added, "x_plain": added / step}
    # CPU time of this process (waiting for a shared core does not count; the repro's fork
    # does not either, the same with and without remedies)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    res["cpu_ms"] = {**med, "all": cpu, "remedies_add": med["with"] - med["without"],
                     "remedies_add_x_plain": (med["with"] - med["without"]) / med["plain"]}
    res["cli"] = summary(cli)
    res["startup_ms"] = {k: statistics.median(r[k] for r in startup) for k in startup[0]}
    # the measure (29): `nanbisect run --no-remedies` until the culprit is printed, less
    # a bare `import torch, nanbisect`; in wall time and in CPU time (the CLI's process and its
    # children, the repro's fork included), each against a plain step's
    res["cli_no_remedies"] = summary(cli_bare)
    after = res["cli_no_remedies"]["median_ms"] - res["startup_ms"]["bare"]
    cpu_after = (statistics.median(r["cpu_ms"] for r in cli_bare)
                 - res["startup_ms"]["bare_cpu"])
    res["cli_no_remedies_after_bare"] = {
        "median_ms": after, "x_plain": after / step, "cpu_ms": cpu_after,
        "cpu_x_plain": cpu_after / med["plain"],
        "cpu_all_ms": [r["cpu_ms"] for r in cli_bare]}
    for key in ("imports", "imports_and_first_optimizer"):
        after = res["cli"]["median_ms"] - res["startup_ms"][key]
        res[f"cli_after_{key}"] = {"median_ms": after, "x_plain": after / step}
    res["bytes"] = {"report": bb.dir_bytes(work / f"in-{reps}")[0],
                    "bundle": bb.dir_bytes(bundle)[0]}
    print(f"[{size}] memory ...", file=sys.stderr)
    _, base = bb.launch([sys.executable, str(HERE / "bench_bisect.py"), "--probe-mem", "baseline",
                         "--bundle", str(bundle), "--out", str(work / "mem-b")])
    _, plain_peak = bb.launch([sys.executable, str(HERE / "bench_bisect.py"), "--probe-mem",
                               "plain", "--bundle", str(bundle), "--out", str(work / "mem-p")])
    _, cli_peak = bb.launch([sys.executable, "-m", "nanbisect", "run", "--ckpt", str(bundle),
                             "--out", str(work / "mem-cli")], cwd=ROOT)
    res["peak_rss_mib"] = {"baseline": base, "plain_2_steps": plain_peak, "nanbisect_run": cli_peak,
                           "x_plain_over_baseline": (cli_peak - base) / (plain_peak - base)}
    print(f"[{size}] peers ...", file=sys.stderr)
    res["peers"] = {"detect_anomaly": bb.anomaly_peer(rep, max(2, steps // 2))}
    if transformers:
        res["peers"]["transformers"] = bb.transformers_peer(bundle, venv, max(2, steps // 2))
    res["loadavg_end"] = os.getloadavg()
    return res


def table(results: list[dict]) -> str:
    lines = ["| | " + " | ".join(f"{r['size']} ({r['n_params'] / 1e6:.1f}M params)"
                                  for r in results) + " |",
             "|---|" + "---:|" * len(results)]

    def row(name, cells):
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("plain step, ms (median)", [f"{r['plain_step_ms']['median']:.0f}" for r in results])
    row("`nanbisect run` wall (fresh interpreter), x plain step",
        [f"{r['cli']['x_plain']:.2f}x ({r['cli']['median_ms']:.0f} ms)" for r in results])
    if all("cli_no_remedies_after_bare" in r for r in results):
        row("**`nanbisect run --no-remedies` less a bare `import torch, nanbisect`, x plain "
            "step: wall / CPU** (issue 29: <= 5)",
            [f"**{r['cli_no_remedies_after_bare']['x_plain']:.2f}x / "
             f"{r['cli_no_remedies_after_bare']['cpu_x_plain']:.2f}x**" for r in results])
        row("the same, ms: wall / CPU (the fixed cost at small)",
            [f"{r['cli_no_remedies_after_bare']['median_ms']:.0f} / "
             f"{r['cli_no_remedies_after_bare']['cpu_ms']:.0f}" for r in results])
        row("bare `python -c 'import torch, nanbisect'`, ms: wall / CPU",
            [f"{r['startup_ms']['bare']:.0f} / {r['startup_ms']['bare_cpu']:.0f}"
             for r in results])
        row("plain step, CPU ms (median)", [f"{r['cpu_ms']['plain']:.0f}" for r in results])
    row("start-up A: `python -c 'import nanbisect.cli, nanbisect.pipeline'`, ms",
        [f"{r['startup_ms']['imports']:.0f}" for r in results])
    row("start-up B: A + torch's first optimizer (its lazy `import torch._dynamo`, which "
        "`nanbisect run` defers: not paid), ms",
        [f"{r['startup_ms']['imports_and_first_optimizer']:.0f}" for r in results])
    row("`nanbisect run` after start-up A, x plain step",
        [f"{r['cli_after_imports']['x_plain']:.2f}x ({r['cli_after_imports']['median_ms']:.0f}"
         " ms)" for r in results])
    row("`run_bundle` in a warm process (passes below), x plain step",
        [f"{r['run_bundle']['x_plain']:.2f}x ({r['run_bundle']['median_ms']:.0f} ms)"
         for r in results])
    if all("run_bundle_no_remedies" in r for r in results):
        row("`run_bundle` with `--no-remedies`, x plain step",
            [f"{r['run_bundle_no_remedies']['x_plain']:.2f}x "
             f"({r['run_bundle_no_remedies']['median_ms']:.0f} ms)" for r in results])
        row("**what the remedies add** (with - without), ms, x plain step",
            [f"**{r['remedies_add_ms']['median_difference']:.0f}** "
             f"({r['remedies_add_ms']['x_plain']:.2f}x)" for r in results])
    if all("cpu_ms" in r for r in results):
        row("CPU of this process, ms: plain step / `run_bundle` with / without remedies",
            [f"{r['cpu_ms']['plain']:.0f} / {r['cpu_ms']['with']:.0f} / "
             f"{r['cpu_ms']['without']:.0f}" for r in results])
        row("**what the remedies add, CPU**, ms, x a plain step's CPU",
            [f"**{r['cpu_ms']['remedies_add']:.0f}** ({r['cpu_ms']['remedies_add_x_plain']:.2f}x)"
             for r in results])
    for key, name in PASSES:
        if any(key in r["run_bundle"]["passes_ms"] for r in results):
            row(f"&nbsp;&nbsp;{name}, ms (share)", [
                f"{r['run_bundle']['passes_ms'].get(key, 0):.0f} "
                f"({r['run_bundle']['passes_ms'].get(key, 0) / r['run_bundle']['median_ms']:.0%})"
                for r in results])
    row("report directory, bytes", [f"{r['bytes']['report']:,}" for r in results])
    row("peak RSS: `nanbisect run` / plain 2 steps, MiB",
        [f"{r['peak_rss_mib']['nanbisect_run']:.0f} / {r['peak_rss_mib']['plain_2_steps']:.0f}"
         for r in results])
    for peer in ("detect_anomaly", "transformers"):
        if all(peer in r["peers"] and "x_plain" in r["peers"][peer] for r in results):
            row(f"{peer}: healthy / faulty step, x plain", [
                f"{r['peers'][peer]['x_plain']['healthy']:.2f}x / "
                f"{r['peers'][peer]['x_plain']['faulty']:.2f}x" for r in results])
    row("culprit (all runs agree)", [f"`{r['culprit']['op']}` in `{r['culprit']['module']}` "
                                     f"call {r['culprit']['module_call']}, reproduced: "
                                     f"{r['culprit']['reproduced']}" for r in results])
    if all("remedies" in r for r in results):
        row("remedies (outcome: the step ...)", ["; ".join(f"{m['kind']} {m['outcome']}: "
                                                          f"{m['change']}" for m in r["remedies"])
                                                for r in results])
    row("load average at start / end", [
        f"{r['loadavg_start'][0]:.1f} / {r['loadavg_end'][0]:.1f}" for r in results])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium,large")
    ap.add_argument("--reps", type=int, default=3, help="measured runs per kind")
    ap.add_argument("--steps", type=int, default=5, help="plain steps timed per round")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--venv", type=Path,
                    default=Path(tempfile.gettempdir()) / "nanbisect-bench-venv")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one, args.reps, args.steps, not args.no_transformers,
                                  args.venv), default=str))
        return
    results = []
    for size in args.sizes.split(","):
        print(f"[{size}] ...", file=sys.stderr)
        p = subprocess.run([sys.executable, __file__, "--one", size, "--reps", str(args.reps),
                            "--steps", str(args.steps), "--venv", str(args.venv)]
                           + (["--no-transformers"] if args.no_transformers else []),
                           env={**os.environ, SIZE_ENV: size}, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"size {size} failed:\n{p.stderr[-3000:]}")
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
