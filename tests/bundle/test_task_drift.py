"""A Task that is not what its entry builds: a notebook's clamped ``loss_fn`` captured with an
entry whose file builds an unclamped one. The capture says so in one line; the replay (which
runs the file's code) compares the code it built with what the capture recorded and its report
says which code ran."""
from __future__ import annotations

import warnings

import pytest
import torch

import nanbisect
from nanbisect.errors import TaskNotFromEntry
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.report.prose import terminal
from nanbisect.task import load_task
from nanbisect.util.fingerprint import DRIFT_NOTE

TASK = '''
import torch
import nanbisect


def make_task():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: torch.sqrt(m(b)).mean())
'''
# what a notebook's cell defines: its code's file name is the cell's, not a file on disk
CELL = "loss_fn = lambda m, b: torch.sqrt(m(b).clamp(min=0)).mean()\n"


def _batch():
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(0))


def test_a_notebooks_task_captured_with_another_entry_is_said_at_capture_and_run(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    entry = f"{tmp_path / 'task.py'}:make_task"
    task = load_task(entry)
    cell = {"torch": torch}
    exec(compile(CELL, "<ipython-input-3-5f2c>", "exec"), cell)
    task.loss_fn = cell["loss_fn"]                  # the notebook's own, clamped and finite
    assert torch.isfinite(task.loss_fn(task.model, _batch()))
    with pytest.warns(TaskNotFromEntry, match="loss_fn is defined in a notebook cell"):
        nanbisect.capture(task, _batch(), tmp_path / "bundle", entry=entry)
    r = run_bundle(tmp_path / "bundle", RunOptions(run_repro=False, remedies=0),
                   tmp_path / "report")
    assert r.verdict == "culprit" and r.culprit.op == "aten.sqrt.default"   # the file's code
    note = next(n for n in r.notes if n.startswith(DRIFT_NOTE))
    assert ("loss_fn: captured __main__.<lambda>, the entry builds "
            "task.make_task.<locals>.<lambda>, other code") in note and "--entry" in note
    assert f"  code: {DRIFT_NOTE}" in terminal(r, tmp_path / "report")


def test_the_entrys_own_task_is_neither_warned_nor_noted(tmp_path):
    (tmp_path / "task.py").write_text(TASK)
    entry = f"{tmp_path / 'task.py'}:make_task"
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskNotFromEntry)
        nanbisect.capture(load_task(entry), _batch(), tmp_path / "bundle", entry=entry)
    r = run_bundle(tmp_path / "bundle", RunOptions(run_repro=False, remedies=0),
                   tmp_path / "report")
    assert r.verdict == "culprit" and not any(n.startswith(DRIFT_NOTE) for n in r.notes)


def test_the_code_hash_is_the_same_in_another_process():
    """A capture's process and a replay's hash the same code alike: not by the string hash seed
    (a set literal's frozenset), nor by where a function is defined (a notebook's module level
    or a factory's body: the same lambda)."""
    import subprocess
    import sys

    probe = ("from nanbisect.util.fingerprint import describe\n"
             "def loss(m, b):\n"
             "    return 1 if b in {'x', 'y', 'z', 'w'} else 2\n"
             "print(describe(loss)['code'])\n")
    got = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONHASHSEED": seed},
                          check=True).stdout for seed in ("1", "2")}
    assert len(got) == 1
    from nanbisect.util.fingerprint import describe

    def factory():
        return lambda m, b: m(b).sum()
    top = lambda m, b: m(b).sum()  # noqa: E731
    assert describe(factory())["code"] == describe(top)["code"]
