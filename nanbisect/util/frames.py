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
