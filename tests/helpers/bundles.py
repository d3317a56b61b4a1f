"""Multi-rank bundles captured once per test session, shared by every test (and every xdist
worker) that needs the same one: each caller gets a private copy.

A multi-rank capture costs 5-15 s; several test files need the same few (rank1_nan,
comm_corrupt, ...). The first caller captures into the session's cache under a lock; the others
wait for it and copy the result. The cache is keyed by script, function and world size, and
lives in the session's pytest temporary directory (`CACHE`, set by tests/conftest.py), so a new
session never sees an old capture.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

CACHE: Path | None = None     # set by conftest.py for the session


def run_ranks(script: Path, args: list[str], ranks: int, timeout: float = 240,
              env: dict | None = None, statuses: Path | None = None):
    """Run ``script args`` on ``ranks`` ranks of one gloo process group, as torchrun would (its
    environment, a TCPStore, a failed rank stopping the others), with the ranks forked from one
    interpreter that imported torch (`nanbisect.multirank.spawn`): a new interpreter per rank
    costs 3-4 s of CPU. The spawner itself is forked from the test worker's fork server
    (`conftest.run_python`: torch imported once per worker), or a fresh interpreter where that
    server cannot serve. tests/multirank/test_multirank_faults.py captures under torchrun itself.
    ``env``: variables added to this process's; ``statuses``: where the spawner writes every
    rank's exit status (JSON)."""
    from helpers import run_python

    res = run_python(["-m", "nanbisect.multirank.spawn", f"--world={ranks}", "--group",
                      "--preload=nanbisect.guard", "--preload=torch._dynamo",
                      *([f"--statuses={statuses}"] if statuses else []),
                      "--", str(script), *args],
                     env={**os.environ, **(env or {})}, timeout=timeout)
    return subprocess.CompletedProcess([], res.code, res.stdout, res.stderr)


def one_bundle(script: Path, args: list[str], ranks: int, env: dict | None = None,
               timeout: float = 240) -> Path:
    """The one bundle every rank of ``script args`` wrote (each prints ``RANK r BUNDLE path``,
    as the examples do)."""
    p = run_ranks(script, args, ranks, timeout=timeout, env=env)
    said = {line.split()[1]: line.split()[3] for line in p.stdout.splitlines()
            if line.startswith("RANK ") and line.split()[2] == "BUNDLE"}
    assert len(said) == ranks and len(set(said.values())) == 1, p.stdout + p.stderr[-3000:]
    return Path(next(iter(said.values())))


def culprit_report(bundle: Path, out: Path, *more: str, env: dict | None = None) -> dict:
    """report.json of ``nanbisect run bundle --out out --no-remedies *more``, which must find a
    culprit (exit 1)."""
    import json

    from helpers import cli

    res = cli("run", str(bundle), "--out", str(out), "--no-remedies", *more, env=env,
              timeout=240)
    assert res.code == 1, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _capture(script: Path, func: str, out: Path, ranks: int) -> Path:
    p = run_ranks(script, [func, str(out)], ranks)
    lines = [line.split(" ", 1)[1].strip() for line in p.stdout.splitlines()
             if line.startswith("BUNDLE ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-2000:]
    return Path(lines[0])


def captured(script: Path, func: str, out: Path, ranks: int = 2) -> Path:
    """``func``'s bundle from ``script`` on ``ranks`` ranks, copied to ``out``/<name>."""
    if CACHE is None:    # no session cache (a direct import): capture for this caller alone
        return _capture(script, func, out, ranks)
    key = CACHE / f"{Path(script).stem}-{func}-{ranks}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{key.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # one capture; the others wait, then copy
        done = key / "path"
        if not done.is_file():
            bundle = _capture(script, func, key / "g", ranks)
            done.write_text(str(bundle))
        bundle = Path(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    dst = out / bundle.name
    shutil.copytree(bundle, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
    return dst


def session_cache(basetemp: Path) -> Path:
    """The cache for this session: shared by xdist workers (their base temp's parent is the
    session's), private to the session otherwise."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "captured"
