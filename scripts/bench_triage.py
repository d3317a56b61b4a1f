"""Triage a night of bundles: each replay in a fresh interpreter, then forked from each worker's
fork server, then again from the cache; side by side in one run.

The night: every shipped fixture bundle (plus a corrupted one), or with ``--bundles N`` N
distinct bundles of the fixtures' `healthy` task (captured here, one per training step, so no two
are copies that triage would replay once). Each run is a fresh `nanbisect triage` process;
``NANBISECT_TRIAGE_FORK=0`` is the fresh-interpreter-per-bundle way triage worked before its
workers kept a fork server. Prints the wall times (interpreter and torch start-up included),
the exit codes, and the number of bundles, signatures and errors.

With ``--model SIZE`` (issue 47: triage workers that do not fight for the cores): the night is
``--bundles N`` (default 10) distinct bundles of scripts/bench_scale.py's model of that size
(its task file, entry, and size/fault environment, imported from it) with its backward fault,
each captured under `nanbisect.Guard` in its own process; bundle k trains on batches 3k, 3k+1
(healthy) and 3k+2 (the fault), so no two are copies. Then, ``--reps`` times, interleaved (the
order rotated each round): a fresh ``nanbisect triage NIGHT --out OUT --jobs J`` for each J of
``--jobs-list``, and ``--jobs --passive`` (default 2; 0: none) with ``OMP_WAIT_POLICY=PASSIVE``.
Every run gets a fresh ``--out``, and with it a fresh cache (triage caches in ``OUT/cache``
only): nothing is answered from an earlier run. ``OMP_WAIT_POLICY`` is removed from the other
runs' environment. Reports per row the median wall seconds, bundles/min, exit codes,
signatures, errors and the replays' intra-op threads (triage.json ``bundles[].threads``).
Usage: python scripts/bench_triage.py [--jobs 2] [--bundles 20] [--json FILE]
       python scripts/bench_triage.py --model 34m --bundles 10 [--jobs-list 1,2] [--passive 2]
                                      [--reps 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAULT = "backward"          # bench_scale's fault in the model mode


def _fixtures(night: Path) -> None:
    for b in sorted((ROOT / "fixtures" / "bundles").iterdir()):
        if b.is_dir() and not b.name.startswith("."):
            shutil.copytree(b, night / b.name, ignore=shutil.ignore_patterns("nanbisect-report"))
    shutil.copytree(night / "healthy", night / "corrupted")
    (night / "corrupted" / "model.safetensors").write_bytes(b"cut")


def _captured(night: Path, n: int) -> None:
    os.chdir(ROOT)                      # the entry is recorded relative to the repository root
    sys.path.insert(0, str(ROOT / "fixtures" / "tasks"))
    import healthy

    import nanbisect

    task, batches = healthy.task(), healthy.batches()
    guard = nanbisect.Guard(task, entry="fixtures/tasks/healthy.py:task", out=night / ".scratch")
    for step in range(n):
        nanbisect.capture(task, next(batches), night / f"step{step:03d}",
                          entry="fixtures/tasks/healthy.py:task", step=step)
        guard.step(next(batches))
    shutil.rmtree(night / ".scratch", ignore_errors=True)


def _scale():
    """scripts/bench_scale.py as a module (its task file, sizes and environment names)."""
    sys.path.insert(0, str(HERE))
    import bench_scale
    return bench_scale


def _scale_env(size: str) -> dict:
    bs = _scale()
    return {bs.SIZE_ENV: size, bs.FAULT_ENV: FAULT}


def child_capture(entry: str, out: str, k: int) -> dict:
    """In its own process: bundle ``k``, 2 healthy steps on batches 3k, 3k+1 under the Guard,
    then the fault on batch 3k+2 (bench_scale's capture, on batches of its own)."""
    import torch

    import nanbisect
    mod = _scale().import_task(entry)
    guard = nanbisect.Guard(mod.make_task(), entry=entry, out=out)
    try:
        for i in range(2):
            guard.step(mod.make_batch(3 * k + i))
        guard.step(mod.make_batch(3 * k + 2, fault=True))
        guard.close()
    except nanbisect.NonFiniteStep as e:
        return {"bundle": str(e.bundle), "threads": torch.get_num_threads()}
    raise RuntimeError("the planted fault did not fire")


def _model_night(night: Path, work: Path, size: str, n: int) -> dict:
    """N distinct bundles of bench_scale's model under ``night``, one capture process each."""
    bs = _scale()
    if size not in bs.SIZES:
        sys.exit(f"--model: one of {', '.join(bs.SIZES)}")
    entry = bs.write_task(work)
    env = {**os.environ, **_scale_env(size)}
    t0, threads = time.monotonic(), []
    for k in range(n):
        print(f"[capture {k + 1}/{n}]", file=sys.stderr, flush=True)
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-capture",
                            entry, str(night / f"bundle{k:02d}"), str(k)],
                           capture_output=True, text=True, cwd=ROOT, env=env)
        if p.returncode:
            sys.exit(f"capture {k} failed: {(p.stdout + p.stderr)[-1500:]}")
        threads.append(json.loads(p.stdout.strip().splitlines()[-1])["threads"])
    return {"entry": entry, "capture_s": time.monotonic() - t0, "capture_threads": threads}


def _rel(path: str, night: Path) -> str:
    try:
        return str(Path(path).relative_to(night))
    except ValueError:
        return path


def _triage(night: Path, out: Path, jobs: int, env: dict) -> dict:
    """One fresh ``nanbisect triage`` process into the fresh ``out``: its figures."""
    assert not out.exists(), out         # a fresh --out: a fresh cache (OUT/cache)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "nanbisect", "triage", str(night), "--out",
                        str(out), "--jobs", str(jobs), "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.monotonic() - t0
    try:
        data = json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"wall_s": wall, "exit": p.returncode, "bundles": 0, "signatures": [],
                "errors": [p.stderr[-1500:]], "threads": {}, "cached": 0}
    bundles = data["bundles"]
    return {"wall_s": wall, "exit": p.returncode, "bundles": len(bundles),
            "signatures": [(g["signature"], g["count"]) for g in data["signatures"]],
            "errors": [e.get("error") for e in data["errors"]],
            "threads": {_rel(b["bundle"], night): b.get("threads") for b in bundles},
            "cached": sum(bool(b.get("cached")) for b in bundles),
            "seconds": [b.get("seconds") for b in bundles]}


def model_mode(a) -> dict:
    n = a.bundles or 10
    rows = [(f"--jobs {j}", j, {}) for j in (int(x) for x in a.jobs_list.split(","))]
    if a.passive:
        rows.append((f"--jobs {a.passive}, OMP_WAIT_POLICY=PASSIVE", a.passive,
                     {"OMP_WAIT_POLICY": "PASSIVE"}))
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    base.update(_scale_env(a.model))     # the replays rebuild the model from these
    with tempfile.TemporaryDirectory(prefix="bench_triage-") as d:
        night = Path(d) / "night"
        res = {"model": a.model, "fault": FAULT, "n_bundles": n, "cpus": os.cpu_count(),
               "loadavg_start": os.getloadavg(), "python": sys.executable,
               "PYTHONPATH": os.environ.get("PYTHONPATH"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
               **_model_night(night, Path(d), a.model, n)}
        runs: dict[str, list] = {label: [] for label, _, _ in rows}
        for r in range(a.reps):
            for i in range(len(rows)):
                label, jobs, extra = rows[(i + r) % len(rows)]
                print(f"[round {r + 1}/{a.reps}] triage {label}", file=sys.stderr, flush=True)
                out = Path(d) / f"out-{r}-{(i + r) % len(rows)}"
                runs[label].append(_triage(night, out, jobs, {**base, **extra}))
                shutil.rmtree(out, ignore_errors=True)
        res["loadavg_end"] = os.getloadavg()
    res["rows"] = []
    for label, jobs, extra in rows:
        rr = runs[label]
        wall = statistics.median(x["wall_s"] for x in rr)
        res["rows"].append({"label": label, "jobs": jobs, "env": extra, "median_wall_s": wall,
                            "bundles_per_min": 60 * rr[-1]["bundles"] / wall, "runs": rr})
    return res


def model_table(res: dict) -> str:
    lines = [f"{res['n_bundles']} bundles of bench_scale's {res['model']} model ({res['fault']} "
             f"fault), {res['cpus']} cores, load {res['loadavg_start'][0]:.1f}-"
             f"{res['loadavg_end'][0]:.1f}; capture {res['capture_s']:.0f} s (threads "
             f"{sorted(set(res['capture_threads']))})", "",
             "| triage | wall s (median; all) | bundles/min | exit | bundles (cached) | "
             "signatures | errors | replay threads (x bundles) |",
             "|---|---:|---:|---|---:|---|---:|---|"]
    for row in res["rows"]:
        rr = row["runs"]
        threads = Counter(t for x in rr for t in x["threads"].values())
        walls = ", ".join(f"{x['wall_s']:.1f}" for x in rr)
        lines.append(
            f"| {row['label']} | {row['median_wall_s']:.1f} ("
            f"{walls}) | {row['bundles_per_min']:.1f} | "
            f"{','.join(str(x['exit']) for x in rr)} | "
            f"{rr[-1]['bundles']} ({sum(x['cached'] for x in rr)}) | "
            f"{'; '.join(f'{s} x{c}' for s, c in rr[-1]['signatures'])} | "
            f"{sum(len(x['errors']) for x in rr)} | "
            f"{', '.join(f'{t} (x{c})' for t, c in sorted(threads.items(), key=str))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--bundles", type=int, default=0,
                    help="N distinct bundles of the healthy task instead of the fixtures "
                    "(with --model: of that model; default 10)")
    ap.add_argument("--model", metavar="SIZE",
                    help="bench_scale's model of SIZE (2m, 34m, 101m, 403m), backward fault")
    ap.add_argument("--jobs-list", default="1,2", help="with --model: the --jobs rows")
    ap.add_argument("--passive", type=int, default=2, metavar="J",
                    help="with --model: a row of --jobs J under OMP_WAIT_POLICY=PASSIVE (0: none)")
    ap.add_argument("--reps", type=int, default=1, help="with --model: interleaved rounds")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--child-capture", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_capture:
        entry, out, k = a.child_capture
        print(json.dumps(child_capture(entry, out, int(k))))
        return
    if a.model:
        res = model_mode(a)
        print(model_table(res))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        return
    with tempfile.TemporaryDirectory() as d:
        night = Path(d) / "night"
        _captured(night, a.bundles) if a.bundles else _fixtures(night)
        rows = []
        runs = [("a fresh interpreter per bundle", "0", True),
                ("forked from each worker's server", "1", True),
                ("again, from the cache", "1", False)]
        for label, fork, fresh in runs:
            out = Path(d) / "out"
            if fresh:
                shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            p = subprocess.run([sys.executable, "-m", "nanbisect", "triage", str(night),
                                "--out", str(out), "--jobs", str(a.jobs), "--json"],
                               capture_output=True, text=True, cwd=ROOT,
                               env={**os.environ, "NANBISECT_TRIAGE_FORK": fork})
            data = json.loads(p.stdout)
            rows.append((label, time.monotonic() - t0, p.returncode, len(data["bundles"]),
                         len(data["signatures"]), len(data["errors"])))
    print(f"| run (--jobs {a.jobs}) | wall s | exit | bundles | signatures | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |")
    if a.json:
        keys = ("run", "wall_s", "exit", "bundles", "signatures", "errors")
        Path(a.json).write_text(json.dumps({"jobs": a.jobs, "bundles": a.bundles,
                                            "rows": [dict(zip(keys, r)) for r in rows]},
                                           indent=1))


if __name__ == "__main__":
    main()
