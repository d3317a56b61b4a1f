"""`Task` and entry strings: how nanbisect reaches the user's model, optimizer and loss.

An entry is ``pkg.module:function`` or ``path/to/file.py:function``; calling ``function()`` returns a
`Task`. A file is imported once per resolved path, under a module name derived from that path, so
two entries naming the same file share one module. Importing an entry runs user code: only
`load_task` does that, never `nanbisect inspect`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from nanbisect.errors import BadInput


@dataclass
class Task:
    """What one training step needs.

    ``loss_fn(model, batch)`` returns a scalar loss tensor; the model is built on CPU.

    >>> task = Task(model=torch.nn.Linear(2, 1), optimizer=None, loss_fn=lambda m, b: m(b).sum())
    >>> task.loss_fn(task.model, torch.ones(3, 2)).shape
    torch.Size([])
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]


def split_entry(entry: str) -> tuple[str, str]:
    target, sep, func = entry.rpartition(":")
    if not sep or not target or not func.isidentifier():
        raise BadInput(f"entry '{entry}' is not of the form 'pkg.module:function' or "
                       "'path/to/file.py:function'; pass --entry with that form")
    return target, func


def _user_frame(exc: BaseException) -> str:
    """'file:line' of the innermost traceback frame, for one-line error messages."""
    tb = traceback.extract_tb(exc.__traceback__)
    return f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""


def _import_file(path: Path, shown: str) -> Any:
    """Import ``path`` once per process, under its own stem when that name is free (so a task
    file and an inject file that both ``import moe`` share one ``moe``), else a derived name."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve() == path:
            return mod
    name = path.stem
    if name in sys.modules or not name.isidentifier():
        name = "nanbisect_entry_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        raise BadInput(f"entry file '{shown}' failed to import: {type(e).__name__}: {e}"
                       f"{_user_frame(e)}; fix that file or pass another --entry") from None
    return module


def import_target(target: str, search: list[Path] = ()) -> Any:
    """Import a module by dotted name or by file path (tried as given, then under ``search``)."""
    if target.endswith(".py"):
        candidates = [Path(target)] + [Path(d) / target for d in search]
        path = next((c.resolve() for c in candidates if c.is_file()), None)
        if path is None:
            raise BadInput(f"entry file '{target}' not found (looked in the working directory"
                           f"{' and ' + ', '.join(map(str, search)) if search else ''}); run from "
                           "the directory the entry is relative to, or pass --entry with its path")
        return _import_file(path, target)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise BadInput(f"entry module '{target}' cannot be imported ({e}); install it or add its "
                       "directory to PYTHONPATH") from None
    except BaseException as e:
        raise BadInput(f"entry module '{target}' failed to import: {type(e).__name__}: {e}"
                       f"{_user_frame(e)}; fix that module") from None


def load_task(entry: str, search: list[Path] = ()) -> Task:
    """Import the entry and call it; check that it returned a usable `Task`.

    >>> type(load_task("fixtures/tasks/healthy.py:task").model).__name__
    'TinyGPT'
    """
    target, func = split_entry(entry)
    module = import_target(target, list(search))
    fn = getattr(module, func, None)
    if not callable(fn):
        raise BadInput(f"entry '{entry}': '{func}' is not a function in {target}; name the "
                       "function that returns nanbisect.Task")
    try:
        task = fn()
    except BaseException as e:
        raise BadInput(f"entry '{entry}' raised {type(e).__name__}: {e}{_user_frame(e)}; fix the "
                       "entry function") from None
    if not isinstance(task, Task):
        raise BadInput(f"entry '{entry}' returned {type(task).__name__}, not nanbisect.Task; "
                       "return Task(model=..., optimizer=..., loss_fn=...)")
    if not isinstance(task.model, torch.nn.Module) or not callable(task.loss_fn):
        raise BadInput(f"entry '{entry}': Task.model must be an nn.Module and Task.loss_fn "
                       "callable; fix the entry function")
    return task


def load_inject(spec: str) -> Callable[[], ContextManager]:
    """``FILE.py:FUNC`` -> FUNC, a factory of the context manager wrapped around target runs."""
    target, func = split_entry(spec)
    fn = getattr(import_target(target), func, None)
    if not callable(fn):
        raise BadInput(f"--inject '{spec}': '{func}' is not a function in {target}; name a "
                       "function that returns a context manager")
    return fn
