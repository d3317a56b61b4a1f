"""The emulated NPU (tests/npu: ``import torch_npu`` gives torch an ``npu`` device through
PrivateUse1) for the processes a test starts: never imported into a test worker itself (one
PrivateUse1 backend per process, and a worker that has it would record ``npu`` in every later
capture's manifest).

`environment()` builds the device's C++ extension once per torch version (cached:
tests/npu/torch_npu/_build.py; ``bash scripts/test.sh`` builds it before the full tier) and
returns the environment a process needs to use it (``PYTHONPATH`` with tests/npu). Without a C++
compiler the tests that need the device are skipped with one line saying so, except under
``CI=1`` or ``NANBISECT_REQUIRE_NPU=1`` (.ci/run), where they fail: CI must run them (it installs
a compiler through scripts/setup.sh).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.paths import ROOT

NPU = ROOT / "tests" / "npu"
TRAIN = NPU / "tasks" / "npu_train.py"

_built: dict | None = None


def _required() -> bool:
    """Whether a missing compiler fails instead of skipping (as tests/report/test_html.py does
    for its browser)."""
    return (os.environ.get("CI", "").lower() not in ("", "0", "false")
            or os.environ.get("NANBISECT_REQUIRE_NPU") == "1")


def environment() -> dict:
    """This process's environment with tests/npu first on ``PYTHONPATH``, the device built."""
    global _built
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(NPU), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                 if p])}
    if _built is None:
        p = subprocess.run([sys.executable, "-m", "torch_npu"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            if "NoCompiler" in p.stderr:
                why = p.stderr.strip().splitlines()[-1].split(": ", 1)[-1]
                if not _required():
                    pytest.skip(why)
                pytest.fail(f"{why} (CI=1 or NANBISECT_REQUIRE_NPU=1 requires the device)",
                            pytrace=False)
            raise AssertionError("building the emulated npu device failed:\n" + p.stderr[-3000:])
        _built = env
    return dict(env)
