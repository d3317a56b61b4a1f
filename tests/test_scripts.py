"""The scripts in scripts/ at least parse: benchmarks run rarely, so a typo would sit unseen."""
import py_compile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "x.pyc"), doraise=True)


def test_there_are_scripts():
    assert len(SCRIPTS) >= 4
