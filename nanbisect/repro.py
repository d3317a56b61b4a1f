"""The standalone repro: catch the culprit op's inputs, write ``repro/``, run it once.

`InputCatcher` replays the step and, at the culprit (the same op, at the same occurrence among
calls of that op in its phase), clones the op's arguments, the RNG state (for dropout, ``rand_like``, ...) and the
user source line: the innermost frame outside torch and nanbisect; for a backward formula, the
line in forward that created its autograd node (anomaly mode records it during this pass only).
`write_repro` renders ``repro.py`` from a template and saves the inputs, with the call's non-tensor
arguments as JSON in the safetensors metadata. The repro needs only torch and safetensors.
"""
from __future__ import annotations

import json
import os
import re
import string
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from . import __version__
from .oprecord import SKIP
from .state import encode, local

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_FRAME = re.compile(r'File "(.+)", line (\d+)')


def _is_user(path: str) -> bool:
    path = os.path.abspath(path)
    return not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR) or path.startswith("<")
                or "/lib/python3" in path and "site-packages" not in path)


def _short(path: str, line: int) -> str:
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{line}"


def user_frame(frames: list[tuple[str, int]]) -> str | None:
    """'file:line' of the innermost frame outside torch, nanbisect and the standard library."""
    for path, line in reversed(frames):
        if _is_user(path):
            return _short(path, line)
    return None


@dataclass
class Caught:
    op: str = ""
    args: Any = None
    kwargs: Any = None
    mutated: list[int] = field(default_factory=list)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str | None = None


class InputCatcher(TorchDispatchMode):
    """Clone the arguments of the ``occurrence``-th call of ``op`` in ``phase``.

    NB: matched by op and occurrence within the phase, not by the step-wide op index: a wrapper
    with per-iteration state (DDP rebuilds its buckets on its second iteration) adds ops between
    replays, which shifts global indices but not the culprit's place among its own kind.
    """

    def __init__(self, op: str, phase: str, occurrence: int) -> None:
        super().__init__()
        self.op, self.target_phase, self.occurrence = op, phase, occurrence
        self.phase = "forward"
        self.seen = 0
        self.caught: Caught | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self.caught is None and self.phase == self.target_phase and func not in SKIP
                and str(func) == self.op):
            if self.seen == self.occurrence:
                self._catch(func, args, kwargs)
            self.seen += 1
        return func(*args, **kwargs)

    def _catch(self, func, args, kwargs) -> None:
        def clone(x):
            if isinstance(x, torch.Tensor):
                return local(x).detach().clone()   # a DTensor's shard: what the kernel ran on
            return None if isinstance(x, torch.Generator) else x

        c = Caught(op=str(func))
        c.args = torch.utils._pytree.tree_map(clone, list(args))
        c.kwargs = torch.utils._pytree.tree_map(clone, dict(kwargs))
        c.mutated = [i for i, a in enumerate(func._schema.arguments[:len(args)])
                     if a.alias_info is not None and a.alias_info.is_write]
        c.rng["rng/cpu"] = torch.get_rng_state()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"):
                mod = getattr(torch, t.device.type, None)
                if mod is not None and hasattr(mod, "get_rng_state"):
                    c.rng[f"rng/{t.device.type}"] = mod.get_rng_state(t.device)
                break
        stack = [(f.filename, f.lineno) for f in traceback.extract_stack()]
        c.source = user_frame(stack)
        node = torch._C._current_autograd_node()
        if node is not None and c.source is None:  # a backward formula: where forward made it
            tb = (node.metadata or {}).get("traceback_") or []
            frames = [(m.group(1), int(m.group(2))) for line in tb
                      for m in [_FRAME.search(line)] if m]
            c.source = user_frame(frames)
        self.caught = c


def write_repro(out: Path, caught: Caught, *, culprit: dict, kind: str, target: str,
                imports: list[str]) -> Path:
    """Write ``out/repro.py`` and ``out/inputs.safetensors``; return the script's path."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"op": caught.op, "args": encode(caught.args, "args", tensors),
            "kwargs": encode(caught.kwargs, "kwargs", tensors), "mutated": caught.mutated}
    tensors.update({k: v.contiguous() for k, v in caught.rng.items()})
    save_file(tensors, str(out / "inputs.safetensors"), metadata={"nanbisect": json.dumps(meta)})
    template = string.Template(
        resources.files("nanbisect").joinpath("templates/repro.py.tmpl").read_text())
    text = template.substitute(
        version=__version__, op=caught.op, phase=culprit["phase"], module=culprit["module"],
        module_call=culprit["module_call"], op_index=culprit["op_index"],
        source=culprit.get("source"), kind=kind, target=target, imports=repr(imports))
    (out / "repro.py").write_text(text)
    return out / "repro.py"


def run_repro(script: Path, device: str, timeout: int = 300) -> dict:
    """Run the repro once in a fresh interpreter, from another directory; report what it said."""
    try:
        p = subprocess.run([sys.executable, str(script.resolve()), "--device", device],
                           cwd=str(script.parent.parent), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": True, "reproduced": False, "exit_code": None,
                "output": f"timed out after {timeout}s"}
    tail = (p.stdout + p.stderr).strip().splitlines()[-6:]
    return {"ran": True, "reproduced": p.returncode == 1, "exit_code": p.returncode,
            "output": "\n".join(tail)}


def write_module_repro(out: Path, mc, *, culprit: dict, kind: str, target: str,
                       entry: str) -> Path:
    """Write ``out/module_repro.py`` and ``out/module_inputs.safetensors`` (the fallback)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"args": encode(mc.args, "args", tensors), "kwargs": encode(mc.kwargs, "kwargs",
                                                                         tensors),
            "grad_out": (encode(mc.grad_out, "grad_out", tensors) if mc.grad_out is not None
                         else None)}
    tensors.update({f"state/{k}": v.contiguous() for k, v in mc.state.items()})
    tensors.update({k: v.contiguous() for k, v in mc.rng.items()})
    save_file(tensors, str(out / "module_inputs.safetensors"),
              metadata={"nanbisect": json.dumps(meta)})
    target_file, _, func = entry.rpartition(":")
    template = string.Template(
        resources.files("nanbisect").joinpath("templates/module_repro.py.tmpl").read_text())
    text = template.substitute(
        version=__version__, op=culprit["op"], phase=culprit["phase"], module=mc.module,
        module_call=mc.call, kind=kind, target=target, entry=entry,
        entry_file=repr(str(Path(target_file).resolve())), entry_func=repr(func))
    (out / "module_repro.py").write_text(text)
    return out / "module_repro.py"
