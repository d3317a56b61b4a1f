"""`nanbisect inspect`: what a bundle holds, read from its manifest and safetensors headers.

Guarantees: imports no user code, unpickles nothing, loads no tensor data (headers only), and
verifies every file's sha256 first, so it is safe on bundles from anyone.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from .bundle import read_bundle
from .errors import BadInput


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
             "observed  " + (json.dumps(obs.get("summary")) + f" (first bad: {obs.get('first')})"
                             if obs else "- (captured on demand, no failure recorded)")]
    for name, f in info["files"].items():
        lines.append(f"  {name:<22} {f['bytes']:>10} bytes  {f['tensors']:>4} tensors  "
                     f"{f['dtypes']}")
    return "\n".join(lines)
