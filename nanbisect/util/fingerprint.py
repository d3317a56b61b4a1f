"""What code a Task is made of, as a bundle records it: for its model's class, its ``loss_fn``
(or ``step_fn``) and its optimizer's class, the qualified name and a hash of the code.

A capture records them (``manifest.task.parts``); a replay builds the Task from the entry and
compares (`drift`): a Task made in a notebook with a clamped ``loss_fn`` and captured with an
entry whose file builds an unclamped one replays the file's code, and the report says so. The
hash covers the bytecode, constants and names of the functions (a class: of every function
its own body and its non-torch bases define), not line numbers or file names, so a script's
``__main__`` class and the same file imported by the entry hash alike; it is compared only
between the same Python minor version (bytecode differs between them), else the names are.
Not seen: values a function closes over or reads from globals (a clamp constant passed to a
factory).
"""
from __future__ import annotations

import hashlib
import sys
import types
from typing import Any

PARTS = ("model", "loss_fn", "step_fn", "optimizer")
# how a report's note about a drift starts (the terminal summary shows it as a "code:" line)
DRIFT_NOTE = "the Task the entry builds is not the captured one"
_PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _code_digest(code: types.CodeType, h) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(c, h)
        elif isinstance(c, frozenset):      # (its repr's order follows the string hash seed)
            h.update(repr(sorted(map(repr, c))).encode())
        else:
            h.update(repr(c).encode())


def _functions(obj: Any) -> list[tuple[str, types.CodeType]]:
    """The code objects that make ``obj``: a function's own, a class's methods (its own body and
    its bases' outside torch and the standard library), by qualified name."""
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        return [(fn.__qualname__, fn.__code__)]
    if isinstance(obj, type):
        out = []
        for cls in obj.__mro__:
            if (cls.__module__ or "").split(".")[0] in ("torch", "builtins", "abc", "typing"):
                continue
            for name, v in sorted(vars(cls).items()):
                f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                if isinstance(f, types.FunctionType):
                    out.append((f.__qualname__, f.__code__))
        return out
    call = getattr(type(obj), "__call__", None)     # a callable object: its class's code
    return _functions(type(obj)) if isinstance(call, types.FunctionType) else []


def describe(obj: Any) -> dict | None:
    """``{name, code, python}`` of a function, a class or a callable object (None: nothing to
    describe). ``name`` is ``module.qualname``."""
    if obj is None:
        return None
    fns = _functions(obj)
    named = obj if isinstance(obj, (type, types.FunctionType)) else \
        obj.__func__ if isinstance(obj, types.MethodType) else type(obj)
    # (code exec'd without a module, as a notebook's cell may be: __main__'s)
    name = f"{getattr(named, '__module__', None) or '__main__'}." \
        f"{getattr(named, '__qualname__', '?')}"
    h = hashlib.sha256()
    for qual, code in fns:
        h.update(qual.rsplit(".", 1)[-1].encode())     # its own name, not where it is defined
        _code_digest(code, h)
    return {"name": name[:300], "code": h.hexdigest()[:32], "python": _PY}


def _objects(task: Any) -> dict[str, Any]:
    """What each of `PARTS` is in ``task``: the model's and optimizer's classes, the loss and
    step functions (None: the Task has none)."""
    return {"model": type(task.model) if task.model is not None else None,
            "loss_fn": task.loss_fn, "step_fn": getattr(task, "step_fn", None),
            "optimizer": type(task.optimizer) if task.optimizer is not None else None}


def of_task(task: Any) -> dict:
    """The parts of a Task (`PARTS`), each `describe`'d, those it has."""
    return {k: d for k, v in _objects(task).items() if (d := describe(v)) is not None}


def drift(captured: dict | None, built: dict) -> list[str]:
    """The parts whose code differs between what a capture recorded and what the entry built,
    in words ("loss_fn: captured __main__.<lambda>, the entry builds task.make_task.<locals>.
    <lambda>, other code"); [] when they agree or nothing was recorded."""
    out = []
    for part, was in (captured or {}).items():
        now = built.get(part)
        if not isinstance(was, dict) or now is None:
            continue
        same_python = was.get("python") == now["python"]
        differs = was.get("code") != now["code"] if same_python else \
            _short(was.get("name")) != _short(now["name"])
        if differs:
            out.append(f"{part}: captured {was.get('name')}, the entry builds {now['name']}"
                       + (", other code" if same_python else
                          f" (Python {was.get('python')} at capture, {now['python']} now)"))
    return out


def _short(name: Any) -> str:
    """A name without its module (``__main__.Net`` and ``train.Net`` are the same class)."""
    return str(name).split(".", 1)[-1] if isinstance(name, str) else ""


def drift_note(captured: dict | None, built: dict) -> str | None:
    """A report's note on `drift` (None: none): which parts differ and which code ran."""
    parts = drift(captured, built)
    if not parts:
        return None
    return (f"{DRIFT_NOTE} ({'; '.join(parts)}): the replay ran the code the entry builds, not "
            "the captured run's; give the entry that builds the captured Task (--entry) to "
            "replay what ran")


def foreign(task: Any, entry: str | None) -> list[str]:
    """The parts of ``task`` defined where an entry cannot rebuild them (a notebook's cell, an
    interactive session's ``__main__``) while the capture names an ``entry`` file: what its
    replay then runs instead is the entry's code."""
    if not entry:
        return []
    out = []
    for part, obj in _objects(task).items():
        if part == "optimizer":     # a class the user imports, not defines in a cell
            continue
        fns = _functions(obj) if obj is not None else []
        files = {c.co_filename for _, c in fns}
        if any(f.startswith("<") or "ipykernel" in f for f in files):
            out.append(part)
    return out
