"""What report.md, the terminal summary and report.html say (report/prose.py, report/plots.py):
an op born in the Task's ``loss_fn`` (outside any module call) is named ``loss_fn``, never an
empty module cell or "call None"; ``classification: unknown`` from a run without a reference
says why and gives the flag that decides it, and a run with the reference decides it; in the
module plot, calls that passed bad values through are drawn and labelled as such, not as born.
Each fault is planted in a task written here and found by the tool.
"""
from __future__ import annotations

import json
import re
import textwrap

import pytest
from helpers import cli

import nanbisect
from nanbisect.task import import_target

# a NaN born in loss_fn, outside any module call: sqrt of a pair's squared distance, which is 0
# for a duplicated pair (row 0): sqrt's backward divides by 0 (inf), times the 0 the pair's
# difference gives: NaN in backward
TASK = textwrap.dedent('''
    import torch, nanbisect

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x)

    def loss_fn(model, batch):
        a, b = model(batch[0]), model(batch[1])
        return ((a - b) ** 2).sum(-1).sqrt().mean()

    def make_task():
        torch.manual_seed(0)
        m = Encoder()
        return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_fn)

    def batch():
        torch.manual_seed(1)
        x = torch.randn(2, 4)
        y = x.clone()
        y[1] += 1                   # row 0 is a duplicated pair: distance 0
        return (x, y)
''')
UNKNOWN = ("classification: unknown (no reference: give --reference cpu to tell a device fault "
           "from a numerics one)")


@pytest.fixture(scope="module")
def loss_fn_run(tmp_path_factory):
    """The planted loss_fn bundle, run without a reference: (report dir, the CLI's result)."""
    d = tmp_path_factory.mktemp("lossfn")
    (d / "siamese.py").write_text(TASK)
    mod = import_target(str(d / "siamese.py"))
    bundle = nanbisect.capture(mod.make_task(), mod.batch(), d / "b",
                               entry=f"{d / 'siamese.py'}:make_task")
    res = cli("run", bundle, "--out", d / "r", cwd=d)
    assert res.code == 1, res.stdout[-3000:] + res.stderr
    return d, bundle, res


def test_an_op_born_in_loss_fn_is_named_loss_fn(loss_fn_run):
    d, _, res = loss_fn_run
    rep = json.loads((d / "r" / "report.json").read_text())
    c = rep["culprit"]
    assert (c["phase"], c["module"] or "", c["module_call"]) == ("backward", "", None), c
    md = (d / "r" / "report.md").read_text()
    assert "| module | `loss_fn` (the loss function, outside any module call) |" in md
    assert "| module | `` |" not in md and "call None" not in md
    assert "in backward in loss_fn (the loss function, outside any module call)" in md
    rows = [ln for ln in md.splitlines() if ln.startswith(f"| {c['op_index']} |")]
    assert rows and "| `loss_fn` |" in rows[0], rows        # the ops table's module cell
    if rep.get("inf_origin"):
        assert "(op #%d, backward, loss_fn)" % rep["inf_origin"]["op_index"] in md
    out = res.stdout
    assert "module=loss_fn call=-" in out and "call None" not in out, out
    page = (d / "r" / "report.html").read_text()
    assert re.search(r"<th>module</th><td><code>loss_fn</code> \(the loss function", page)


def test_unknown_without_a_reference_says_why_and_the_flag(loss_fn_run):
    d, bundle, res = loss_fn_run
    assert json.loads((d / "r" / "report.json").read_text())["classification"] == "unknown"
    assert f"- {UNKNOWN}" in (d / "r" / "report.md").read_text()
    assert f"  {UNKNOWN}; report: " in res.stdout, res.stdout
    # with the reference the flag names, the run decides, and the explanation is gone
    ref = cli("run", bundle, "--reference", "cpu", "--out", d / "ref", cwd=d)
    assert ref.code == 1, ref.stdout[-3000:] + ref.stderr
    decided = json.loads((d / "ref" / "report.json").read_text())["classification"]
    assert decided == "numerics", decided
    assert "no reference:" not in ref.stdout + (d / "ref" / "report.md").read_text()


def test_the_module_plot_marks_calls_that_passed_bad_values_through(fixture_bundle, tmp_path):
    """fully_masked_row: the NaN is born in attention's own forward (its softmax), then its
    output projection, a child that finishes before it, passes it on: that bar precedes the
    culprit's and is drawn and labelled as passed through."""
    res = cli("run", fixture_bundle("fully_masked_row"), "--out", tmp_path / "r")
    assert res.code == 1, res.stdout[-3000:] + res.stderr
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    c = rep["culprit"]
    passing = [t for t in rep["backtrace"] if t["role"] == "propagator"]
    assert passing, rep["backtrace"]
    page = (tmp_path / "r" / "report.html").read_text()
    bars = re.findall(r'<rect class="bar( bar-passed)?"[^>]*><title>#\d+ ([^ ]+) call (\d+): '
                      r'(nan|inf) \d+([^<]*)</title>', page)
    seen = {(m, int(k)): (bool(p), how) for p, m, k, _, how in bars}
    for t in passing:
        hatched, how = seen[(t["module"], t["call"])]
        assert hatched and "passed through" in how and "not born here" in how, (t, how)
    hatched, how = seen[(c["module"], c["module_call"])]
    assert not hatched and "born here" in how
    assert page.count("legend-passed") == 2       # the wide and the narrow drawing
