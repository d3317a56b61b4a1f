"""`nanbisect inspect`: what a bundle holds, read from its manifest and safetensors headers.

Guarantees: imports no user code, unpickles nothing, loads no tensor data (headers only), and
verifies every file's sha256 first, so it is safe on bundles from anyone.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise BadInput(f"{path}: not a safetensors file; re-capture the bundle")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise BadInput(f"{path}: safetensors header claims {n} bytes; the file is damaged")
        try:
            head = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadInput(f"{path}: unreadable safetensors header; re-capture the bundle") from None
    head.pop("__metadata__", None)
    return head


def summarize(path: str | Path) -> dict:
    """A JSON-able summary of a verified bundle.

    >>> summarize("fixtures/bundles/healthy")["entry"]
    'fixtures/tasks/healthy.py:task'
    """
    b = read_bundle(path)
    m = b.manifest
    if b.multi_rank:
        parts = {str(r): summarize(b.path / info["dir"]) for r, info in m["ranks"].items()}
        first = parts["0"]
        return {**first, "bundle": str(b.path), "world_size": m["world_size"], "rank": "all",
                "backend": m.get("backend"), "process_groups": m.get("process_groups"),
                "observed": {r: p["observed"] for r, p in parts.items()},
                "files": {f"rank{r}/{n}": f for r, p in parts.items()
                          for n, f in p["files"].items()}}
    files = {}
    for name, info in m["files"].items():
        head = _header(b.path / name)
        dtypes: dict[str, int] = {}
        for t in head.values():
            dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + 1
        files[name] = {"bytes": info["bytes"], "tensors": len(head), "dtypes": dtypes}
    opt = m.get("optimizer")
    return {
        "bundle": str(b.path), "schema": m["schema"], "created": m.get("created"),
        "entry": m["entry"], "step": m.get("step"), "world_size": m.get("world_size"),
        "rank": m.get("rank"), "environment": m.get("environment"), "devices": m.get("devices"),
        "dtypes": m.get("dtypes"), "observed": m.get("observed"),
        "model": {"parameters": len(m["model"]["params"]), "buffers": len(m["model"]["buffers"]),
                  "tied": m["model"]["aliases"]},
        "optimizer": None if opt is None else {"class": opt["class"],
                                               "param_groups": len(opt["param_groups"])},
        "files": files, "checksums": "ok",
    }


def summary_text(info: dict) -> str:
    env = info.get("environment") or {}
    obs = info.get("observed")
    lines = [f"bundle    {info['bundle']}  ({info['schema']}, checksums {info['checksums']})",
             f"entry     {info['entry']}", f"step      {info['step']}   world size "
             f"{info['world_size']}   rank {info['rank']}",
             f"captured  {info['created']} on {(info.get('devices') or {}).get('captured_on')} "
             f"with torch {env.get('torch')}, python {env.get('python')}",
             f"model     {info['model']['parameters']} parameters, {info['model']['buffers']} "
             f"buffers, dtypes {info['dtypes']}" + (f", tied {info['model']['tied']}"
                                                    if info['model']['tied'] else ""),
             f"optimizer {info['optimizer']['class'] if info['optimizer'] else '-'}",
             "observed  " + _observed_text(obs)]
    groups = info.get("process_groups")
    if groups and len(groups) > 1:   # more than the world: the job's layout
        lines.append("groups    " + "; ".join(f"{n}: {r}" for n, r in groups.items()))
    for name, f in info["files"].items():
        lines.append(f"  {name:<22} {f['bytes']:>10} bytes  {f['tensors']:>4} tensors  "
                     f"{f['dtypes']}")
    return "\n".join(lines)


def _observed_text(obs) -> str:
    if not obs:
        return "- (captured on demand, no failure recorded)"
    if "summary" not in obs:  # multi-rank: one entry per rank
        return "; ".join(f"rank {r}: {_observed_text(o)}" for r, o in obs.items())
    return json.dumps(obs.get("summary")) + f" (first bad: {obs.get('first')})"
