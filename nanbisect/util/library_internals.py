"""The private names of CPython and of libraries other than torch that nanbisect uses, in one
room (torch's are `nanbisect.util.torch_internals`), each behind a function that says what it
does and the versions it was checked on. Importing this module imports nothing but the
standard library: the command line's first stage (no torch) and nightly triage's process use it.

Guarantees: each function fails soft where the private name has moved, as its docstring says.
Not guaranteed: that a private name still means what it did in a version not listed.
"""
from __future__ import annotations

from types import ModuleType


def exit_as_the_interpreter() -> None:
    """What the interpreter's own exit does before it ends, for a forked child that then leaves
    with ``os._exit``: the non-daemon threads joined (``threading._shutdown``), then the atexit
    functions run (``atexit._run_exitfuncs``). Checked on CPython 3.11."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


def joblib_dask_backend() -> type | None:
    """joblib's Dask backend class (``joblib._dask.DaskDistributedBackend``), to subclass where
    its slot count must differ; None where joblib moved it (the plain registered ``"dask"``
    backend is then the caller's). joblib offers no public name for the class. Checked on
    joblib 1.6."""
    try:
        from joblib._dask import DaskDistributedBackend
    except ImportError:
        return None
    return DaskDistributedBackend


def click_exceptions() -> ModuleType:
    """The exceptions module of the click that typer's commands raise through: a recent typer
    carries its own copy (``typer._click``, no public name), an older one uses click itself.
    Checked on typer 0.16 and 0.29.

    >>> click_exceptions().UsageError.__name__
    'UsageError'
    """
    try:
        from typer._click import exceptions
    except ImportError:         # pragma: no cover - an older typer
        from click import exceptions
    return exceptions


def thread_frame(ident: int):
    """The frame the thread ``ident`` is running now (``sys._current_frames``), None when it
    has ended. Checked on CPython 3.11; fails soft (None) where the name is gone."""
    import sys

    frames = getattr(sys, "_current_frames", None)
    return frames().get(ident) if frames is not None else None
