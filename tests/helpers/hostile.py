"""Hostile inputs' builders: a real bundle of a tiny task (captured once per process and
copied), edited on disk; multi-rank and partial layouts as the Guard writes them; safetensors
pieces; tar archives. The hostile cases themselves are in tests/bundle/test_hostile*.py."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save

from helpers.paths import ROOT
from nanbisect import Task, capture
from nanbisect.bundle.format import SCHEMA

ENTRY = f"{Path(__file__).resolve()}:make_task"   # capture checks it exists, never imports it


def make_task() -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = lambda m, b: m(b).pow(2).mean()   # noqa: E731
    loss_fn(model, torch.ones(2, 3)).backward()
    opt.step()
    return Task(model=model, optimizer=opt, loss_fn=loss_fn)


# --------------------------------------------------------------------------------------------
# helpers: real bundles, edited on disk


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


_CAPTURED: dict = {}        # the bundle this process captured for `bundle` to copy, and its dir


def bundle(path: Path, rank: int | None = None, world: int | None = None,
           fresh: bool = False) -> Path:
    """A real bundle of `make_task` at ``path``: captured there (``fresh``), or a copy of the one
    this process captured the first time (a capture hashes the source of every module the
    process imported: a good part of a second in a test worker, and some 90 cases build on
    one)."""
    if fresh:
        path = capture(make_task(), torch.ones(2, 3), path, entry=ENTRY, step=3)
    else:
        if not _CAPTURED:
            _CAPTURED["dir"] = tempfile.TemporaryDirectory(prefix="nanbisect-hostile-")
            _CAPTURED["bundle"] = capture(make_task(), torch.ones(2, 3),
                                          Path(_CAPTURED["dir"].name) / "b", entry=ENTRY, step=3)
        shutil.copytree(_CAPTURED["bundle"], path)
    if rank is not None:
        edit(path, lambda m: m.update(rank=rank, world_size=world))
    return path


def edit(path: Path, change) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m))


def put_file(path: Path, name: str, data: bytes) -> None:
    """Replace a tensor file and make the manifest vouch for it (sha256 and size match), so only
    the file's own contents are hostile."""
    (path / name).write_bytes(data)
    edit(path, lambda m: m["files"].__setitem__(name, {"sha256": hashlib.sha256(data).hexdigest(),
                                                     "bytes": len(data)}))


def multi(path: Path, world: int = 2, fresh: bool = False) -> Path:
    """A real two-rank bundle laid out as guard.coord writes it."""
    path.mkdir()
    ranks = {}
    for r in range(world):
        part = bundle(path / f"rank{r}", rank=r, world=world, fresh=fresh)
        ranks[str(r)] = {"dir": f"rank{r}", "manifest_sha256": sha256(part / "manifest.json"),
                         "observed": None}
    top = {"schema": SCHEMA, "kind": "multi-rank", "entry": ENTRY, "step": 3,
           "world_size": world, "backend": "gloo", "process_groups": {"world": list(range(world))},
           "ranks": ranks, "files": {}}
    (path / "manifest.json").write_text(json.dumps(top))
    return path


def reseal_part(path: Path, rank: int) -> None:
    """After editing a part's manifest: the top manifest vouches for it again."""
    sha = sha256(path / f"rank{rank}" / "manifest.json")
    edit(path, lambda m: m["ranks"][str(rank)].__setitem__("manifest_sha256", sha))


def safetensors_parts() -> tuple[dict, bytes]:
    """The header and data of a real two-tensor safetensors file."""
    raw = save({"a": torch.ones(2, 3), "b": torch.arange(4)})
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


HEAD, DATA = safetensors_parts()   # b: I64 [4] at [0, 32], a: F32 [2, 3] at [32, 56]


def st(head, data: bytes = DATA, n: int | None = None) -> bytes:
    hb = head if isinstance(head, bytes) else json.dumps(head).encode()
    return struct.pack("<Q", len(hb) if n is None else n) + hb + data


def with_tensor(**changes) -> dict:
    return {**HEAD, "a": {**HEAD["a"], **changes}}


def ln(path: Path, target) -> None:
    path.unlink() if path.is_file() else None
    path.symlink_to(target)


def tar_gz(path: Path, members, fmt_=tarfile.PAX_FORMAT, mode="w:gz") -> Path:
    """``members``: (TarInfo-like dict, data or None)."""
    with tarfile.open(path, mode, format=fmt_) as tar:
        for spec, data in members:
            info = tarfile.TarInfo(spec.pop("name"))
            for k, v in spec.items():
                setattr(info, k, v)
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def valid_archive(path: Path) -> Path:
    return tar_gz(path, [({"name": "report/report.json"}, b'{"schema": "nanbisect.report/1"}'),
                         ({"name": "report/repro", "type": tarfile.DIRTYPE}, None),
                         ({"name": "report/repro/repro.py", "mode": 0o4777}, b"print(1)\n"),
                         ({"name": "pack.json"}, b"{}")])


REASON = "on host h: No space left on device; its part was written to /tmp/r/step3-rank1 instead"


def partial(d: Path, value=None) -> Path:
    """A real two-rank bundle whose rank 1 could not write its part, laid out as guard/parts.py
    leaves it (``value``: another ``partial`` in its place)."""
    multi(d)
    shutil.rmtree(d / "rank1")
    edit(d, lambda m: m["ranks"].pop("1"))
    if value is not ...:                         # ...: no `partial`, the part simply not listed
        edit(d, lambda m: m.update(partial={"missing_ranks": [1], "reasons": {"1": REASON}}
                                   if value is None else value))
    return d


# runs the CLI and, at exit, writes its own peak resident memory (VmHWM: this process image
# alone; rusage's ru_maxrss would count the pytest process it was forked from) and the CPU time
# it used
_MEASURE = """
import atexit, os, resource, runpy, sys
def _hwm():
    with open('/proc/self/status') as f:
        kb = [line.split()[1] for line in f if line.startswith('VmHWM:')]
    r = resource.getrusage(resource.RUSAGE_SELF)
    open(os.environ['HWM_FILE'], 'w').write(f"{kb[0] if kb else 'nan'} {r.ru_utime + r.ru_stime}")
atexit.register(_hwm)
sys.argv[0] = 'nanbisect'
runpy.run_module('nanbisect', run_name='__main__', alter_sys=True)
"""


def measured(*args) -> tuple[int, str, str, float, float, float]:
    """``python -m nanbisect ARGS``: (exit code, stdout, stderr, seconds, peak MiB, CPU
    seconds)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to read the peak memory of one process")
    with tempfile.TemporaryDirectory() as d:
        hwm = Path(d) / "hwm"
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, args)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "HWM_FILE": str(hwm)})
        seconds = time.monotonic() - t0
        kb, cpu = hwm.read_text().split()
        return p.returncode, p.stdout, p.stderr, seconds, float(kb) / 1024, float(cpu)


def _modes(root: Path) -> set[tuple[str, int]]:
    out = {("dir", root.stat().st_mode & 0o7777)}
    for p in root.rglob("*"):
        out.add(("dir" if p.is_dir() else "file", p.stat().st_mode & 0o7777))
    return out
