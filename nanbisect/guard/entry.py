"""What a Guard checks before training starts: the entry names a function, ``out`` takes bundles.

Guarantees: `resolve_entry_file` runs no code (it parses the entry file, or finds the module's
spec; a module already imported is asked directly) and refuses only a name bound nowhere in the
file, and an entry that a replay could not import (`refuse_main`: the module ``__main__``, a
notebook's or a script's own namespace; a factory defined in an interactive session);
`check_out` creates ``out`` and writes (then removes) one probe file there. Both raise
`BadInput` naming the fix. Not guaranteed: that the entry function returns a Task (only
running it tells), nor that ``out`` still takes bundles when a step fails (the Guard then writes
to a rescue directory: `nanbisect.guard.freeze.write_or_rescue`).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

from nanbisect.errors import BadInput
from nanbisect.task import gate, split_entry


def resolve_entry_file(entry: str) -> str | None:
    """Check that ``entry`` names a function that exists, without running any code; return the
    absolute path of a file entry. Raises `BadInput` naming the fix."""
    target, func = split_entry(entry)
    refuse_main(entry, target, func)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise BadInput(f"entry '{entry}': {target} does not exist (from {os.getcwd()}); "
                           "give the path of the file that defines the entry function")
        source = path
    else:
        mod = sys.modules.get(target)
        if mod is not None:
            if not callable(getattr(mod, func, None)):
                raise BadInput(f"entry '{entry}': module {target} has no function '{func}'; "
                               "name the function that returns nanbisect.Task")
            return None
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise BadInput(f"entry '{entry}': module {target} cannot be found; install it, add "
                           "its directory to PYTHONPATH, or give the entry as path/to/file.py:func")
        if not spec.origin or not spec.origin.endswith(".py"):
            return None
        source = Path(spec.origin)
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError) as e:
        raise BadInput(f"entry '{entry}': {source} cannot be read as Python ({e}); fix it")
    # every name the module could bind, at any depth (a def inside `if`/`try` at the top level
    # counts; a star import could bind anything): only a name bound nowhere is refused
    names, star = set(), False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            star = star or any(a.name == "*" for a in node.names)
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if func not in names and not star:
        raise BadInput(f"entry '{entry}': {source} defines no '{func}'; name the function that "
                       "returns nanbisect.Task")
    return str(source.resolve()) if target.endswith(".py") else None


def refuse_main(entry: str, target: str, func: str) -> None:
    """`BadInput` for an entry a replay cannot import: one whose module is ``__main__`` (a
    notebook, or a script run as ``python train.py`` whose factory is in the script itself), an
    alias of it, or a module whose ``func`` was defined in ``__main__`` of an interactive session
    (no file). A replay imports the entry in a fresh process, where ``__main__`` is nanbisect.
    An entry naming a script by its path (``train.py:make_task``) is not refused: the replay
    imports that file.

    >>> refuse_main("__main__:make_task", "__main__", "make_task")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: entry '__main__:make_task' names __main__ ...
    """
    main = sys.modules.get("__main__")
    mod = sys.modules.get(target)
    if target != "__main__" and (mod is None or mod is not main):
        fn = getattr(mod, func, None) if mod is not None else None
        if getattr(fn, "__module__", None) != "__main__" or getattr(main, "__file__", None):
            return
    script = getattr(main, "__file__", None)
    if script and str(script).endswith(".py") and Path(script).is_file():
        try:
            shown = os.path.relpath(script)
        except ValueError:      # another drive (Windows)
            shown = str(script)
        fix = f"give the script by its path: entry='{shown}:{func}'"
    else:
        fix = (f"put the task factory in a file (in a notebook: a cell starting with "
               f"`%%writefile task.py` holding the model class and {func}, then "
               f"`from task import {func}` and entry='task.py:{func}')")
    raise BadInput(f"entry '{entry}' names __main__ (a notebook, or a script run as `python "
                   "train.py` whose factory is in the script itself); a replay imports the entry "
                   f"in a fresh process, where __main__ is nanbisect: {fix}")


def check_out(out: Path) -> None:
    """Bundles can be written into ``out``: create it and write (then remove) a probe file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".nanbisect-probe-"):
            pass
    except OSError as e:
        raise BadInput(f"Guard(out='{out}'): bundles cannot be written there ({e.strerror}); "
                       "pass a directory you can write to") from None


SNAPSHOT_MODES = ("rebuild", "every-step")


def check_modes(max_scaler_skips: int, snapshot: str, snapshot_every: int | None,
                 snapshot_stream: bool) -> None:
    """`BadInput` for a Guard option out of its range (what each may be: the message)."""
    if max_scaler_skips < 1:
        raise BadInput(f"Guard(max_scaler_skips={max_scaler_skips}): give a count >= 1")
    if snapshot not in SNAPSHOT_MODES:
        raise BadInput(f"Guard(snapshot={snapshot!r}): give 'rebuild' (the default: no copy "
                       "of the state) or 'every-step' (an exact copy before every step)")
    if snapshot_every is not None and (type(snapshot_every) is not int or
                                       snapshot_every < 1):
        raise BadInput(f"Guard(snapshot_every={snapshot_every!r}): give a number of steps "
                       ">= 1 (None: chosen from the snapshot's cost)")
    if not isinstance(snapshot_stream, bool):
        raise BadInput(f"Guard(snapshot_stream={snapshot_stream!r}): give True or False")


def warn_top_level(entry_file: str | None, task: object, who: str) -> None:
    """Warn, at capture, when the entry file's top level acts at import: a replay will
    refuse to import it (`nanbisect.task.gate`) unless the run opts in. Nothing when the task
    already opts in (``Task(run_top_level=True)``) or the entry is a module."""
    if entry_file is None or getattr(task, "run_top_level", False):
        return
    try:
        gate(Path(entry_file))
    except BadInput as e:
        warnings.warn(f"{who}: {e}; a replay will refuse this entry until then", stacklevel=3)


def warn_foreign_parts(entry: str | None, task: object, who: str) -> None:
    """Warn, at capture, when the Task holds parts its entry cannot rebuild (defined in a
    notebook cell or an interactive ``__main__``: `nanbisect.util.fingerprint.foreign`): a
    replay builds the Task from the entry and runs that code instead (its report says so)."""
    from nanbisect.errors import TaskNotFromEntry
    from nanbisect.util import fingerprint

    try:
        parts = fingerprint.foreign(task, entry)
    except Exception:  # noqa: BLE001 - a warning's check never fails a capture
        return
    if parts:
        warnings.warn(TaskNotFromEntry(
            f"{who}: the Task's {' and '.join(parts)} {'is' if len(parts) == 1 else 'are'} "
            f"defined in a notebook cell or an interactive session, not in the entry "
            f"'{entry}': a replay runs what the entry builds instead; give an entry whose code "
            "builds this Task"), stacklevel=3)
