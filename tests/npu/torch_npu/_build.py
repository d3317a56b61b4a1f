"""Build (once per torch version and source) and load the emulated NPU's C++ extension.

The shared library is cached under ``$NANBISECT_NPU_CACHE`` (default
``~/.cache/nanbisect/npu``), in a directory named by torch's version, Python's and a hash of the
sources: another torch, or an edited source, builds afresh; every later process (a test worker,
a ``nanbisect run`` subprocess) loads the built library directly, without a compiler. Concurrent
first builds wait on one lock (the builders' own; `torch.utils.cpp_extension` takes it).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "nb_npu_C"
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.[ch]*"))
FLAGS = ["-O1"]


class NoCompiler(RuntimeError):
    """No C++ compiler here: the device cannot be built (its message says how to get one)."""


def key() -> str:
    h = hashlib.sha256()
    for p in SOURCES:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join(FLAGS).encode())
    py = "py%d%d" % sys.version_info[:2]
    return f"torch{torch.__version__}-{py}-{h.hexdigest()[:12]}"


def directory() -> Path:
    root = os.environ.get("NANBISECT_NPU_CACHE") or Path.home() / ".cache" / "nanbisect" / "npu"
    return Path(root) / key()


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


# how the last `load` went (``python -m torch_npu`` says it): "built" or "cached", its seconds
LOADED: tuple[str, float] | None = None


def load():
    """The extension module, built first when this torch and these sources have none."""
    global LOADED
    t0 = time.perf_counter()
    where = directory()
    built = where / f"{NAME}.so"
    if (where / "done").exists():
        mod = _import(built)
        LOADED = ("cached", time.perf_counter() - t0)
        return mod
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        raise NoCompiler("the emulated npu device needs a C++ compiler (g++) to build once; "
                         "`bash scripts/setup.sh test` installs one (apt-get, as root)")
    try:                                   # ninja from PyPI (the test extras) when not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    mod = cpp_extension.load(NAME, [str(p) for p in SOURCES if p.suffix == ".cpp"],
                             build_directory=str(where), extra_cflags=FLAGS, verbose=False)
    (where / "done").write_text("built\n")
    LOADED = ("built", time.perf_counter() - t0)
    return mod
