"""The scripts in scripts/ at least parse: benchmarks run rarely, so a typo would sit unseen."""
import py_compile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_there_are_scripts():
    assert len(SCRIPTS) >= 4


def test_setup_skips_pip_only_when_everything_is_there():
    """scripts/setup_satisfied.py, which lets scripts/setup.sh skip pip: true here (the suite
    runs after the set-up), false for an extra pyproject.toml does not have, and each
    requirement judged by the installed version (extras one level deep)."""
    import sys

    sys.path.insert(0, str(SCRIPTS[0].parent))
    import setup_satisfied as s
    from pip._vendor.packaging.requirements import Requirement

    assert s.satisfied(".[test]") and s.satisfied(".")
    assert not s.satisfied(".[no_such_extra]") and not s.satisfied("x")
    assert s._met(Requirement("pytest>=7")) and s._met(Requirement("dask[distributed]>=2023.1"))
    assert not s._met(Requirement("pytest>=999")) and not s._met(Requirement("no-such-dist"))
