"""The root module has one spelling in each form: "" in the `Report` object and in report.json
(as ``named_modules()`` spells it), ``<root>`` wherever text names it (headline, report.md,
report.html, the terminal, the remedies); ``loss_fn`` only for an op that ran outside any module
call (JSON module "", module_call null), never for the model's own forward."""
from __future__ import annotations

import html
import json

import pytest

import nanbisect
import root_module as tasks
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.report.prose import terminal, to_markdown

TASK = TEST_TASKS / "root_module.py"


@pytest.mark.parametrize("func, call, says, never", [
    ("forward_root", 0, "<root>", "loss_fn"),
    ("backward_root", 0, "<root>", "loss_fn"),
    ("in_loss", None, "loss_fn", None),     # the model's own ops are <root> in its tables
])
def test_the_root_module_is_spelled_one_way_in_each_form(tmp_path, func, call, says, never):
    nanbisect.capture(getattr(tasks, func)(), tasks.batch(), tmp_path / "b",
                      entry=f"{TASK}:{func}")
    out = tmp_path / "r"
    r = run_bundle(tmp_path / "b", RunOptions(run_repro=False, remedies=4), out)
    saved = json.loads((out / "report.json").read_text())["culprit"]
    assert (r.culprit.op, r.culprit.phase) == ("aten.sqrt.default", "forward")
    assert (r.culprit.module, r.culprit.module_call) == ("", call)
    assert (saved["module"], saved["module_call"]) == ("", call)
    texts = [terminal(r, out), to_markdown(r), html.unescape((out / "report.html").read_text()),
             *[m.sentence() for m in r.remedies]]
    assert all(says in t for t in texts[:3])
    assert never is None or not any(never in t for t in texts)
    assert not any("the model's forward" in t for t in texts)
