"""Whose a source file is, for the places that look at stack frames: nanbisect's, torch's, the
standard library's (frozen and generated ``<...>`` code too), an installed package's, or the
user's. One rule for them all (`kind`).

NB: in a virtual environment made with ``--system-site-packages`` (scripts/env.sh's ``.venv``)
the base interpreter's site-packages, where torch may live, lies under the standard library's
directory and is not the venv's purelib: a ``site-packages`` or ``dist-packages`` component says
"installed package" wherever it is. Paths are compared as given (made absolute, not resolved:
a frame names the file as it was imported).
"""
from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path
from typing import Any

from nanbisect.util.torch_internals import TORCH_DIR

OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep     # nanbisect/
TORCH = TORCH_DIR
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k])) + os.sep for k in ("stdlib", "platstdlib")})
_SITE = tuple({str(Path(sysconfig.get_paths()[k])) + os.sep for k in ("purelib", "platlib")}
              | {str(Path(p)) + os.sep for p in getattr(site, "getsitepackages", lambda: [])()})


def kind(path: str) -> str:
    """"nanbisect", "torch", "stdlib", "installed" or "user".

    >>> kind(TORCH + "nn/modules/linear.py"), kind(OWN + "task.py"), kind("<frozen os>")
    ('torch', 'nanbisect', 'stdlib')
    >>> kind(_STDLIB[0] + "json/decoder.py"), kind("/u/train.py")
    ('stdlib', 'user')
    >>> kind("/opt/venv/lib/python3.11/site-packages/transformers/trainer.py")
    'installed'
    """
    if path.startswith("<"):
        return "stdlib"
    path = os.path.abspath(path)
    if path.startswith(OWN):
        return "nanbisect"
    if path.startswith(TORCH):
        return "torch"
    if path.startswith(_SITE) or any(f"{os.sep}{d}{os.sep}" in path
                                     for d in ("site-packages", "dist-packages")):
        return "installed"
    return "stdlib" if path.startswith(_STDLIB) else "user"


# nanbisect's files that run the user's work rather than decide anything: the dispatch
# pass-through that executes each op under the tool's modes, and the step runner that calls
# the Task's loss, backward, clipping and optimizer (an op they run fails as the user's op)
_RUNS_USER_WORK = tuple(OWN + f for f in (os.path.join("util", "torch_internals.py"), "step.py"))


def failing_side(frames: list[tuple[str, int]]) -> str:
    """Whose failure a traceback is (``frames`` outermost first, as ``traceback.extract_tb``
    lists them): "user" when its innermost frame outside torch and the standard library is the
    user's (an installed package's too: model code), or one of nanbisect's that only runs the
    user's work (`_RUNS_USER_WORK`); "nanbisect" when it is the tool's own (its statistics,
    recorder, catcher: a bug of nanbisect's, never the user's to fix).

    >>> T = TORCH + "nn/functional.py"
    >>> failing_side([(OWN + "chain.py", 1), ("/u/model.py", 2), (T, 3)])
    'user'
    >>> failing_side([("/u/model.py", 2), (T, 3), (OWN + "replay/recorder.py", 4), (T, 5)])
    'nanbisect'
    >>> failing_side([("/u/model.py", 2), (OWN + "util/torch_internals.py", 3)])
    'user'
    """
    for path, _ in reversed(frames):
        k = kind(path)
        if k in ("torch", "stdlib"):
            continue
        if k == "nanbisect" and os.path.abspath(path).startswith(_RUNS_USER_WORK):
            continue
        return "nanbisect" if k == "nanbisect" else "user"
    return "user"


def function_at(source: str | None) -> str | None:
    """The module-qualified name of the function a ``"path:line"`` source line is in (a
    signature's code site: it survives edits that move the line): the module's name as this
    process imported that file (else the file's stem), then the classes and functions that
    enclose the line (``<lambda>`` for a lambda on it; the module alone at top level). None
    when the file cannot be read or parsed here.

    >>> function_at(__file__ + ":" + str(function_at.__code__.co_firstlineno + 2))
    'nanbisect.util.frames.function_at'
    """
    if not isinstance(source, str):
        return None
    path, sep, line = source.rpartition(":")
    if not sep or not line.isdigit():
        return None
    names = _enclosing(os.path.abspath(path), int(line))
    if names is None:
        return None
    return ".".join([_module_name(os.path.abspath(path)), *names])


# (absolute path, mtime, size) -> its ast (None: not readable or parsable); a file edited
# since (a notebook's second run) is parsed again
_PARSED: dict[tuple, Any] = {}


def _enclosing(path: str, line: int) -> list[str] | None:
    """The names of the definitions that enclose ``line`` of ``path``, outermost first."""
    import ast

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _PARSED:
        try:
            _PARSED[key] = ast.parse(Path(path).read_text(encoding="utf-8"), path)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            _PARSED[key] = None
    tree = _PARSED[key]
    if tree is None:
        return None
    out: list[str] = []
    node = tree
    while True:
        inner = next((n for n in ast.iter_child_nodes(node)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.lineno <= line <= (n.end_lineno or n.lineno)), None)
        if inner is None:
            break
        out.append(inner.name)
        node = inner
    lam = next((n for n in ast.walk(node) if isinstance(n, ast.Lambda) and n.lineno == line),
               None)
    if lam is not None:
        out.append("<lambda>")
    return out


def _module_name(path: str) -> str:
    """The name this process imported ``path`` under, else its file's stem."""
    import sys

    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and os.path.abspath(f) == path:
            return name
    return Path(path).stem
