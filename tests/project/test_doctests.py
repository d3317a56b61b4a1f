"""Every ``>>>`` example in the package runs and says what its docstring says (from the
repository root, where the examples find fixtures/)."""
from __future__ import annotations

import doctest
import importlib

import pytest

from helpers import ROOT

PKG = ROOT / "nanbisect"
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in PKG.rglob("*.py") if ">>>" in p.read_text())


def test_examples_are_found():
    assert len(MODULES) >= 10


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} mentions >>> but has no examples doctest can find"
    for t in tests:
        runner.run(t)
    failed, attempted = runner.summarize(verbose=False)
    assert failed == 0, f"{failed} of {attempted} examples failed in {name} (see output above)"
