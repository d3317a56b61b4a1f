"""A model under ``torch.compile``: what it was compiled with, and compiling it again.

`compile_args` reads ``{backend, mode, options}`` from a ``torch._dynamo`` ``OptimizedModule``
(what ``torch.compile(model, ...)`` returns): torch keeps the backend object, and for inductor the
mode and options merged into one dict (``mode`` is given back when the merged dict is exactly one
mode's options). `compile_model` compiles an eager module with such a record. Every name
nanbisect shows is the eager module's (``model._orig_mod``), never ``_orig_mod.``-prefixed.

Not covered: a model compiled in place (``model.compile()``) or a ``loss_fn`` compiled by the user;
the Task declares those (``Task(compiled={...})``, README "NaN only when compiled").
"""
from __future__ import annotations

import json
from typing import Any

import torch

_MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def is_compiled(model: Any) -> bool:
    """Is ``model`` what ``torch.compile(module)`` returned?

    >>> is_compiled(torch.nn.Linear(1, 1))
    False
    """
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module)


def _recordable(d: dict) -> dict:
    """The options a bundle keeps: numbers and booleans (what the manifest's schema accepts: a
    string or a callable could name a program a replay would run)."""
    return {str(k): v for k, v in d.items()
            if v is None or (isinstance(v, (bool, int, float)) and json.dumps(v))}


def compile_args(model: torch.nn.Module) -> dict:
    """``{backend, mode, options}`` of an ``OptimizedModule`` (options that are not numbers or
    booleans, such as custom pass callables or paths, are left out)."""
    from torch._dynamo.eval_frame import innermost_backend

    try:
        backend = innermost_backend(model.dynamo_ctx.callback)
    except Exception:  # noqa: BLE001 - a torch whose internals moved: the default backend
        backend = None
    name = (getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
            or "inductor")
    config = dict(getattr(backend, "config", None) or {})
    mode = None
    if name == "inductor" and config:
        from torch._inductor import list_mode_options

        mode = next((m for m in _MODES if list_mode_options(m) == config), None)
    options = {} if mode else _recordable(config)
    return {"backend": str(name), "mode": mode, "options": options or None}


def compile_model(model: torch.nn.Module, spec: dict, backend: str | None = None
                  ) -> torch.nn.Module:
    """``torch.compile(model, ...)`` as ``spec`` ({backend, mode, options}) says; ``backend``
    replaces the spec's (mode and options apply to inductor only). An active
    ``CompilerBisector`` replaces the backend again, as torch.compile always lets it."""
    name = backend or spec.get("backend") or "inductor"
    kw: dict = {}
    if name == "inductor":
        if spec.get("mode"):
            kw["mode"] = spec["mode"]
        elif spec.get("options"):
            kw["options"] = dict(spec["options"])
    return torch.compile(model, backend=name, **kw)
