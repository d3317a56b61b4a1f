"""`python -m nanbisect` (nanbisect/__main__.py): the working directory is off sys.path before
any dependency is imported, so `nanbisect inspect .` in a bundle directory runs nothing the
bundle ships; a dotted `--entry pkg.module:func` is resolved against the working directory
explicitly, the same for `python -m nanbisect` and for the `nanbisect` command. Real fresh
interpreters: only they show what `python -m` and a console script put on sys.path.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, ROOT, TASKS

# modules the CLI imports (or Python might, lazily) that a hostile bundle could ship
SHADOWED = ("argparse", "typer", "click", "rich", "json", "typing", "torch", "numpy", "safetensors",
            "jinja2", "nanbisect_marker")


def _hostile(d: Path) -> None:
    """A ``NAME.py`` per `SHADOWED` name in ``d`` that leaves ``PWNED-NAME`` there when
    imported (and is no usable module)."""
    for name in SHADOWED:
        marker = d / f"PWNED-{name}"
        (d / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")


def _env() -> dict:
    """This checkout's nanbisect, whatever the working directory (PYTHONPATH, as a user's
    virtual environment would put it), nothing else changed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _console_script(d: Path) -> Path:
    """What pip writes for ``[project.scripts] nanbisect = "nanbisect.cli:main"`` (its
    directory, not the working directory, goes first on sys.path)."""
    d.mkdir()
    script = d / "nanbisect"
    script.write_text("import re\nimport sys\nfrom nanbisect.cli import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      "    sys.exit(main())\n")
    return script


@pytest.mark.slow
def test_inspect_in_a_bundle_directory_imports_nothing_from_it(tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(FIXTURES / "nan_batch", bundle,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    _hostile(bundle)
    p = subprocess.run([sys.executable, "-m", "nanbisect", "inspect", "."], cwd=bundle,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "checksums ok" in p.stdout and "entry     fixtures/tasks/nan_batch.py:task" \
        in p.stdout
    assert sorted(x.name for x in bundle.glob("PWNED-*")) == []


@pytest.mark.slow
def test_a_dotted_entry_is_found_in_the_working_directory(tmp_path):
    """`--entry mytask:task` where mytask.py lies in the working directory: the report of the
    replay, through `python -m nanbisect` (cwd no longer on sys.path) and through the console
    command (it never was), both at once."""
    bundle = tmp_path / "b"
    shutil.copytree(FIXTURES / "nan_batch", bundle,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    work = tmp_path / "work"
    work.mkdir()
    source = (TASKS / "nan_batch.py").read_text()
    (work / "mytask.py").write_text(source + "\nopen(__file__ + '.imported', 'a').write('x')\n")
    script = _console_script(tmp_path / "bin")
    runs = {how: subprocess.Popen([sys.executable, *argv, "run", str(bundle), "--entry",
                                   "mytask:task", "--out", str(tmp_path / how), "--json",
                                   "--run-top-level"],
                                  cwd=work, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
            for how, argv in (("module", ["-m", "nanbisect"]), ("command", [str(script)]))}
    for how, p in runs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 1, (how, err[-2000:])
        report = json.loads((tmp_path / how / "report.json").read_text())
        assert report["verdict"] == "input-nonfinite", (how, report["verdict"])
        assert json.loads(out)["verdict"] == "input-nonfinite"
    assert (work / "mytask.py.imported").read_text() == "xx"     # once by each
