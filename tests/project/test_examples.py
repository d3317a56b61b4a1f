"""examples/: the README's quick start run as written from a fresh clone, and the custom-loop
example replayed. (The Lightning and Hugging Face examples are run by tests/integrations/test_integrations.py,
which imports them.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, cli
from nanbisect.task import import_target

MARK = "<!-- quick start: tests/project/test_examples.py"
EXCERPT = "<!-- excerpt of examples/train.py: tests/project/test_examples.py"


def _block(readme: str, marker: str) -> str:
    """The first fenced block after ``marker``."""
    return re.search(r"```[a-z]*\n(.*?)```", readme[readme.index(marker):], re.S).group(1)


def quick_start(readme: str) -> list[tuple[str, list[str]]]:
    """The README's quick start: [(command, the output lines it shows)] from the fenced block
    after MARK; a ``$ `` line is a command, ``...`` stands for lines not shown."""
    block = _block(readme, MARK)
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif line.strip() and line.strip() != "...":
            steps[-1][1].append(line.strip())
    return steps


def _in_order(shown: list[str], got: str) -> list[str]:
    """The lines of ``shown`` that are not found, in order, among the lines of ``got``."""
    lines = [x.strip() for x in got.splitlines()]
    i, missing = 0, []
    for want in shown:
        j = next((k for k in range(i, len(lines)) if lines[k] == want), None)
        if j is None:
            missing.append(want)
        else:
            i = j + 1
    return missing


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written_from_a_fresh_clone(tmp_path):
    """Clone the committed HEAD, run the README's quick-start commands from the clone's root
    with its own nanbisect (PYTHONPATH: the README's pip install is what puts it there for a
    user) and find what the README shows; the replay does not train again."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    clone = tmp_path / "nanbisect"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    bin_ = tmp_path / "bin"                  # `python` and `nanbisect` as an install gives them
    bin_.mkdir()
    # a script, not a symlink: a symlink to a venv's python starts the base interpreter (the
    # venv is found beside the path it was started by), which may have no torch
    (bin_ / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_ / "python").chmod(0o755)
    (bin_ / "nanbisect").write_text(f'#!/bin/sh\nexec {sys.executable} -m nanbisect "$@"\n')
    (bin_ / "nanbisect").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANBISECT_")}
    env.update(PYTHONPATH=str(clone), PATH=f"{bin_}{os.pathsep}{env['PATH']}")

    steps = quick_start((clone / "README.md").read_text())
    assert [c.split()[0] for c, _ in steps] == ["python", "nanbisect"], steps
    runs = []
    for command, shown in steps:
        p = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=600)
        assert not _in_order(shown, p.stdout + p.stderr), (command, _in_order(
            shown, p.stdout + p.stderr), p.stdout[-3000:] + p.stderr[-3000:])
        runs.append(p)
    train, replay = runs
    bundles = sorted((clone / "nanbisect-bundles").iterdir())
    assert [b.name for b in bundles] == ["step000007"] and train.returncode == 1
    assert replay.returncode == 1                       # a culprit
    assert not re.search(r"^step \d+: loss", replay.stdout + replay.stderr, re.M)   # no retraining
    rep = json.loads((bundles[0] / "nanbisect-report" / "report.json").read_text())
    assert (rep["culprit"]["op"], rep["culprit"]["module"]) == ("aten.sqrt.default", "features")
    assert rep["culprit"]["samples"] == [5]             # the corrupted row of step 7's batch


def test_the_custom_loop_example_is_caught_and_replayed(tmp_path):
    """custom_loop.py's own loop under Guard.watch: the step of the corrupted batch is bundled,
    and the replay (through the Task, not the loop) names the op and the row."""
    custom = import_target(str(ROOT / "examples" / "custom_loop.py"))
    bundle = custom.main(tmp_path / "out")
    assert bundle is not None and bundle.name == "step000007"
    res = cli("run", bundle, "--no-remedies", "--json")
    assert res.code == 1, res.stderr
    rep = json.loads(res.stdout)
    assert (rep["culprit"]["op"], rep["culprit"]["module"], rep["culprit"]["phase"]) == (
        "aten.sqrt.default", "features", "forward")
    assert rep["culprit"]["samples"] == [5]


def test_the_readme_shows_lines_of_the_example_it_names():
    """The README's excerpt of examples/train.py is that file's text (`...` for what it leaves
    out), so the two cannot drift apart."""
    shown = [x.strip() for x in _block((ROOT / "README.md").read_text(), EXCERPT).splitlines()
             if x.strip() and x.strip() != "..."]
    assert len(shown) > 20
    assert not _in_order(shown, (ROOT / "examples" / "train.py").read_text())


def test_the_readmes_ticket_example_replays_on_another_machine(tmp_path):
    """The README's ``pack`` and ``unpack`` lines, as written, on a copy of a shipped bundle:
    the unpacked ticket replays (the README promises it does; without ``--full`` it held no
    model or optimizer state and the replay stopped with one line)."""
    readme = (ROOT / "README.md").read_text()
    pack = next(line for line in readme.splitlines() if line.startswith("nanbisect pack "))
    unpack = next(line for line in readme.splitlines() if line.startswith("nanbisect unpack "))
    src = tmp_path / "src"
    shutil.copytree(ROOT / "fixtures" / "bundles" / "forward_nan_behind_mask", src,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    assert cli("run", src, "--no-remedies").code == 1      # the report a ticket carries
    args = pack.split()[2:]
    args[0] = str(src)                                   # the README's bundle path: this copy
    args = [str(tmp_path / a) if a.endswith(".tar.gz") else a for a in args]
    assert cli("pack", *args).code == 0
    archive, dest = unpack.split()[2:]
    assert cli("unpack", tmp_path / archive, tmp_path / dest).code == 0
    res = cli("run", tmp_path / dest / "bundle", "--no-remedies")
    assert res.code == 1 and "aten.sqrt.default" in res.stdout + res.stderr, res.stderr[-1500:]
