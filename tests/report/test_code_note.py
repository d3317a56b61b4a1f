"""The terminal summary says when the bundle's copy of the code ran (report/prose.py
`terminal`): after a fix made here to a sibling of the entry, `nanbisect run` replays the
captured code by default and finds the planted sqrt again; its second line says so, naming the
file that differs and ``--code local``; with ``--code local`` the fix runs and no such line is
printed."""
from __future__ import annotations

import json
import textwrap

from helpers import cli, run_python

LAYERS = """\
import torch, torch.nn as nn
class Act(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 100.0)           # the planted fault: NaN for every x < 100
"""
TRAIN = """\
import torch, torch.nn as nn
import nanbisect
from layers import Act

def loss(m, b):
    return m(b).sum()

def task():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), Act())
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=loss)
"""
CAPTURE = """\
import sys, torch
sys.path.insert(0, {tasks!r})
import nanbisect, train
nanbisect.capture(train.task(), torch.ones(2, 4), {out!r}, entry={entry!r})
"""


def test_the_terminal_says_the_bundles_copy_ran_after_a_local_fix(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "layers.py").write_text(LAYERS)
    (tasks / "train.py").write_text(TRAIN)
    bundle = tmp_path / "bundle"
    script = tmp_path / "capture.py"
    script.write_text(CAPTURE.format(tasks=str(tasks), out=str(bundle),
                                     entry=f"{tasks / 'train.py'}:task"))
    res = run_python([str(script)], cwd=tmp_path, fresh=True)
    assert res.code == 0, res.stderr[-3000:]

    layers = tasks / "layers.py"
    layers.write_text(layers.read_text().replace("(x - 100.0)", "((x - 100.0).abs())"))
    res = cli("run", bundle, "--no-remedies", "--out", tmp_path / "r1", cwd=tmp_path)
    assert res.code == 1, res.stdout + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[1].startswith("  code: the bundle's copy of the code ran: 1 file(s) here "
                               "differ from the captured ones"), res.stdout
    assert "layers.py" in lines[1] and "--code local" in lines[1], lines[1]
    rep = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert rep["culprit"]["op"] == "aten.sqrt.default", rep["culprit"]

    res = cli("run", bundle, "--no-remedies", "--code", "local", "--out", tmp_path / "r2",
              cwd=tmp_path)
    assert "the bundle's copy" not in res.stdout, res.stdout
    rep = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert (rep.get("culprit") or {}).get("op") != "aten.sqrt.default", textwrap.shorten(
        res.stdout, 2000)
