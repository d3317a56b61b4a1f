"""What runs inside a forked child: its target run as ``python`` would run it, then its end.

A fork of a process that imported torch once costs milliseconds where a fresh interpreter costs
seconds. What makes the fork safe: the process that forks has imported modules and run no torch
op and started no thread, so the child inherits no OpenMP pool (GNU OpenMP's does not survive a
fork) and no lock held by a thread that is not there. Environment variables torch reads when it
is imported (``OMP_NUM_THREADS``, ``ATEN_CPU_CAPABILITY``: `IMPORT_TIME`) are the forking
process's: a child that needs other values needs a fresh interpreter.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

# what torch (or Python) reads when it is imported: a child forked from a server would not see
# another value of these than the server's
IMPORT_TIME = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|ATEN_|TORCH|PYTORCH_|CUDA_|PYTHON|LD_)")


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that torch or Python read when they are imported."""
    return {k: v for k, v in env.items() if IMPORT_TIME.match(k)}


def run_target(target: list[str]) -> int:
    """Run ``target`` (``["-m", MODULE, ARG...]`` or ``[SCRIPT, ARG...]``) in this (forked)
    process as ``python`` would run it as its main program; its exit status (a traceback printed
    and 1 for an uncaught exception). For a module, ``sys.path[0]`` is the caller's to set
    (``python -m`` puts the working directory there). Runs neither atexit nor thread joins:
    `run_main` does."""
    import runpy
    import traceback
    import warnings

    try:
        if target[0] == "-m":
            sys.argv = [target[1], *target[2:]]
            with warnings.catch_warnings():   # preloaded: "found in sys.modules" is expected
                warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path[0] = str(Path(target[0]).resolve().parent)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then exit 1
        traceback.print_exc()
        return 1
    return 0


def run_main(target: list[str]) -> int:
    """`run_target`, then end as the interpreter's exit does (non-daemon threads joined, then
    atexit); its exit status."""
    code = run_target(target)
    # torch is loaded wherever a forked child runs a target (the fork server preloaded it, the
    # spawner imported it): the room of private names costs nothing more here
    from nanbisect.util.library_internals import exit_as_the_interpreter

    exit_as_the_interpreter()             # as the interpreter's exit does: threads, then atexit
    return code


def end_child(code: int) -> None:
    """Leave a forked child: flush what it printed, never return into the parent's code."""
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


def preload() -> None:
    """What every forked replay would import first (torch, and ``torch._dynamo``, which building
    an optimizer imports: 1.4 s more), imported without running an op."""
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    from nanbisect.util.torch_internals import preload_dynamo
    preload_dynamo()
    with contextlib.suppress(ImportError):
        import setproctitle  # noqa: F401


def title(target: list[str]) -> None:
    """Show the child in ``ps`` (and /proc/PID/cmdline) as the command it runs, not as the
    server's; needs ``setproctitle`` (a dependency; without it the server's line stays)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join([sys.executable, *target]))
