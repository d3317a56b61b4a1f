"""The Python API (`nanbisect.run`, `nanbisect.triage`): the command's code path in this
process, the command's report, the command's one-line refusals as `BadInput` (never
`SystemExit`), and names that mean one thing whatever was imported before."""
from __future__ import annotations

import json
import shutil

import pytest

import nanbisect
from helpers import FIXTURES, ROOT, invoke, run_python, same_run
from nanbisect import BadInput
from nanbisect.pipeline import STAGES
from nanbisect.util.recordjson import dumps

SQRT = "forward_nan_behind_mask"      # its planted culprit: aten.sqrt.default


def _copy(name: str, dest) -> str:
    shutil.copytree(FIXTURES / name, dest, ignore=shutil.ignore_patterns("nanbisect-report"))
    return str(dest)


def _as_written(report) -> dict:
    """``report.to_json()`` as report.json holds it (non-finite floats as strings)."""
    return json.loads(dumps(report.to_json()))


def test_run_writes_the_report_directory_and_returns_its_report(fixture_bundle):
    bundle = fixture_bundle(SQRT)
    told: list[tuple[str, str]] = []
    report = nanbisect.run(bundle, repro=False, progress=lambda k, t: told.append((k, t)))
    assert (report.verdict, report.culprit.op, report.exit_code) == \
        ("culprit", "aten.sqrt.default", 1)
    assert report.culprit.module == "blocks.1.mlp.act" and report.culprit.module_call == 2
    written = json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert written == _as_written(report)                       # the default out, the same report
    assert report.remedies and all(r.sentence() for r in report.remedies)   # budget 1 (conftest)
    keys = [k for k, _ in told]
    assert {"module-pass", "op-recording"} <= set(keys) and all(t for _, t in told)
    assert keys == sorted(keys, key=STAGES.index)               # announced in the pipeline's order
    # the culprit is told the moment it is known, before its remedies: the report's headline
    # and source line; a moment, not a pass (not in the timings)
    from nanbisect.report.prose import headline

    assert keys.count("culprit") == 1 and keys.index("culprit") < keys.index("remedies")
    assert dict(told)["culprit"] == f"{headline(report)}; source {report.culprit.source}"
    assert "culprit" not in report.timings and "remedies" in report.timings


def test_remedies_off_and_a_budget(fixture_bundle, tmp_path):
    bundle = fixture_bundle(SQRT)
    off = nanbisect.run(bundle, repro=False, remedies=False, out=tmp_path / "off")
    assert off.remedies == [] and off.culprit.op == "aten.sqrt.default"
    two = nanbisect.run(bundle, repro=False, remedies=2, out=tmp_path / "two")
    assert 1 <= len([r for r in two.remedies if r.outcome != "skipped"]) <= 2
    assert json.loads((tmp_path / "two" / "report.json").read_text()) == _as_written(two)


@same_run(SQRT)
def test_the_same_report_json_as_the_command(replayed, fixture_bundle):
    """``nanbisect run --json`` (its own process) and `nanbisect.run` (this one) on two copies
    of one bundle: every field the same but the bundle's path and the passes' timings."""
    cli_bundle, cli = replayed(SQRT)
    bundle = fixture_bundle(SQRT)
    api = _as_written(nanbisect.run(bundle))
    assert set(api) == set(cli)
    assert (cli["bundle"], api["bundle"]) == (str(cli_bundle), str(bundle))
    assert set(api["timings"]) == set(cli["timings"])           # the same passes ran
    differ = [k for k in cli if k not in ("bundle", "timings") and api[k] != cli[k]]
    assert not differ, {k: (api[k], cli[k]) for k in differ}
    assert api["culprit"]["op"] == "aten.sqrt.default" and api["repro_result"] is not None


def _cli_line(*args) -> str:
    res = invoke(*map(str, args))
    assert res.code == 2, res.stdout + res.stderr
    return res.stderr.strip()


def _refused(bundle, **kw) -> str:
    with pytest.raises(BadInput) as e:      # a SystemExit would escape this and fail the test
        nanbisect.run(bundle, repro=False, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("kw, flags", [
    ({"reference": "gpu9"}, ["--reference", "gpu9"]),
    ({"target": "cuda:x"}, ["--target", "cuda:x"]),
    ({"inject": "nocolon"}, ["--inject", "nocolon"]),
    ({"entry": "no_function_here"}, ["--entry", "no_function_here"]),
    ({"ranks": "0,zero"}, ["--ranks", "0,zero"]),
    ({"code": "elsewhere"}, ["--code", "elsewhere"]),
])
def test_a_bad_option_is_the_commands_line(fixture_bundle, kw, flags):
    bundle = fixture_bundle(SQRT)
    line = _refused(bundle, **kw)
    assert f"nanbisect: error: {line}" == _cli_line("run", bundle, *flags)
    assert not (bundle / "nanbisect-report").exists()           # nothing written


def test_a_bad_path_is_the_commands_line(fixture_bundle, tmp_path):
    missing = tmp_path / "step000123"
    assert f"nanbisect: error: {_refused(missing)}" == _cli_line("run", missing)
    bundle = fixture_bundle(SQRT)
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    line = _refused(bundle, out=mine)
    assert f"nanbisect: error: {line}" == _cli_line("run", bundle, "--out", mine)
    assert mine.read_text() == "mine"
    report_dir = tmp_path / "r"
    nanbisect.run(bundle, repro=False, remedies=0, out=report_dir)
    assert "is a report directory" in _refused(report_dir)      # not re-capture: its bundle


@pytest.mark.parametrize("kw, keyword, flags", [
    ({"steps": 0}, "steps=0", ["--steps", "0"]),
    ({"remedies": -1}, "remedies=-1", ["--remedy-budget", "-1"]),
])
def test_a_bad_number_names_the_keyword_with_the_commands_range(fixture_bundle, kw, keyword,
                                                                flags):
    bundle = fixture_bundle(SQRT)
    line = _refused(bundle, **kw)
    assert line.startswith(f"run: {keyword} ")
    cli = _cli_line("run", bundle, *flags)
    assert line.split(": give ")[1] in cli                      # the same range, in the same words


def test_other_bad_values(fixture_bundle):
    bundle = fixture_bundle(SQRT)
    assert "not callable" in _refused(bundle, progress="yes")
    assert "is not a path" in _refused(42)
    assert "ranks" in _refused(bundle, ranks=5)
    assert not (bundle / "nanbisect-report").exists()


def test_the_task_exiting_is_bad_input_not_system_exit(fixture_bundle, tmp_path):
    """A ``sys.exit`` in the task's code while the step replays (here its loss function) is a
    `BadInput` naming it, never a `SystemExit` out of a notebook's cell."""
    entry = tmp_path / "exits.py"
    entry.write_text(
        "import sys\n\n\n"
        "def make_task():\n"
        f"    sys.path.insert(0, {str(FIXTURES.parent / 'tasks')!r})\n"
        f"    from {SQRT} import task\n\n"
        "    t = task()\n"
        "    t.loss_fn = lambda *a, **k: sys.exit(3)\n"
        "    return t\n")
    bundle = fixture_bundle(SQRT)
    line = _refused(bundle, entry=f"{entry}:make_task")
    assert "SystemExit(3)" in line and "must return, not exit" in line
    assert not (bundle / "nanbisect-report").exists()


def test_triage_of_two_directories(tmp_path):
    night = tmp_path / "night"
    sqrt = _copy(SQRT, tmp_path / "job1" / "step000003")
    batch = _copy("nan_batch", tmp_path / "job2" / "step000005")
    told: list[tuple[int, int]] = []
    found = nanbisect.triage([tmp_path / "job1", tmp_path / "job2"], out=night, jobs=2,
                             progress=lambda d, t: told.append((d, t)))
    assert found.exit_code == 3 and found.out == night                  # new signatures
    assert sorted(g.count for g in found.groups) == [1, 1]
    assert not any(g.known for g in found.groups)
    assert sorted(b for g in found.groups for b in g.bundles) == sorted(found.reports)
    assert found.reports[sqrt].culprit.op == "aten.sqrt.default"
    assert found.reports[batch].verdict == "input-nonfinite"
    assert found.errors == () and (told[0], told[-1]) == ((0, 2), (2, 2))
    assert found.to_json() == json.loads((night / "triage.json").read_text())
    for row in found.to_json()["bundles"]:                              # the reports kept on disk
        kept = json.loads((night / row["report_dir"] / "report.json").read_text())
        assert kept == _as_written(found.reports[row["bundle"]])
    # known signatures, as a list or as last night's triage.json: exit 1 (from the cache)
    again = nanbisect.triage([tmp_path / "job1", tmp_path / "job2"], out=night,
                             known=[g.signature for g in found.groups])
    assert again.exit_code == 1 and all(g.known for g in again.groups)
    assert all(row["cached"] for row in again.to_json()["bundles"])
    (night / again.to_json()["bundles"][0]["report_dir"] / "report.json").unlink()
    with pytest.raises(BadInput, match="cannot be read"):      # read when asked for, not before
        again.reports[again.to_json()["bundles"][0]["bundle"]]
    shutil.copy(night / "triage.json", tmp_path / "last.json")
    assert nanbisect.triage(tmp_path / "job1", out=night, known=tmp_path / "last.json"
                            ).exit_code == 1


def test_triage_refuses_as_the_command(tmp_path):
    missing = tmp_path / "nights"
    for kw, flags in [({}, []), ({"backend": "spark"}, ["--backend", "spark"])]:
        root = missing if not kw else tmp_path
        with pytest.raises(BadInput) as e:
            nanbisect.triage(root, out=tmp_path / "t", **kw)
        assert f"nanbisect: error: {e.value}" == \
            _cli_line("triage", root, "--out", tmp_path / "t", *flags)
    with pytest.raises(BadInput, match=r"^triage: timeout=0 "):
        nanbisect.triage(tmp_path, out=tmp_path / "t", timeout=0)
    assert not (tmp_path / "t").exists()


IMPORTED_FIRST = """
import sys
import nanbisect.nightly.summary, nanbisect.nightly.find   # the night's package first
import nanbisect
assert callable(nanbisect.run) and callable(nanbisect.triage), nanbisect.triage
assert nanbisect.triage is nanbisect.api.triage           # the function, not a package
from nanbisect.nightly import discover                    # the package imports
import nanbisect.nightly.one_bundle as worker                 # and its modules, by any form
from nanbisect import triage
try:
    triage("/nonexistent-dir")
except nanbisect.BadInput as e:
    print("BadInput" if "nonexistent-dir" in str(e) else e)
print(nanbisect.run.__module__, discover.__module__, worker.__name__,
      type(nanbisect.triage).__name__)
"""

NO_TORCH = """
import sys
import nanbisect
nanbisect.run, nanbisect.triage, nanbisect.api.triage
print("torch" in sys.modules)
"""


def test_the_names_mean_one_thing_whatever_was_imported_first():
    for name in ("run", "triage"):      # no module could be bound to the names
        assert not (ROOT / "nanbisect" / f"{name}.py").exists()
        assert not (ROOT / "nanbisect" / name).exists()
    res = run_python(["-c", IMPORTED_FIRST], fresh=True)
    assert res.code == 0, res.stderr
    assert res.stdout.split() == ["BadInput", "nanbisect.api", "nanbisect.nightly.find",
                                  "nanbisect.nightly.one_bundle", "function"]
    res = run_python(["-c", NO_TORCH], fresh=True)
    assert (res.code, res.stdout.strip()) == (0, "False"), res.stderr     # loading them is light
    assert "run" in nanbisect.__all__ and "triage" in nanbisect.__all__
    assert nanbisect.triage is nanbisect.api.triage


# issue 43's finding: two trees whose entries import a same-named sibling, run in one process
TREE_TRAIN = """\
import torch
import nanbisect
from layers_43 import Act

def loss(m, b):
    return m(b).sum()

def task():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Act())
    return nanbisect.Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                          loss_fn=loss)
"""
TREE_LAYERS = """\
import torch
class Act(torch.nn.Module):
    def forward(self, x):
        return torch.{op}(x - 100.0)
"""
TREE_CAPTURE = """\
import sys, torch
tree = sys.argv[1]
sys.path.insert(0, tree + "/tasks")
import nanbisect, train_43
nanbisect.capture(train_43.task(), torch.randn(2, 4), tree + "/bundle",
                  entry=tree + "/tasks/train_43.py:task", step=1)
"""
TREE_RUNS = """\
import sys, tempfile
from pathlib import Path
import nanbisect

def culprit(tree, **kw):
    r = nanbisect.run(tree + "/bundle", repro=False, remedies=False,
                      out=Path(tempfile.mkdtemp()) / "r", **kw)
    return r.culprit.op if r.culprit else r.verdict

if sys.argv[1] == "two":
    a, b = sys.argv[2:4]
    print(culprit(a), culprit(b), culprit(a), culprit(b, code="bundle"))
    print(any(p.startswith((a, b)) for p in sys.path))
else:                                   # the fix loop: fix the sibling on disk, run again
    tree = sys.argv[2]
    first = culprit(tree, code="local")
    layers = Path(tree, "tasks", "layers_43.py")
    layers.write_text(layers.read_text().replace("(x - 100.0)", "((x - 100.0).abs() + 1.0)"))
    print(first, culprit(tree, code="local"))
"""


def _runs(tmp_path, *args: str):
    (tmp_path / "runs_43.py").write_text(TREE_RUNS)
    return run_python([str(tmp_path / "runs_43.py"), *args])


def _tree(root, op: str) -> str:
    """A tree whose entry tasks/train_43.py imports its sibling layers_43 (torch.OP of x - 100,
    so NaN for small x), captured in a process of its own."""
    (root / "tasks").mkdir(parents=True)
    (root / "tasks" / "train_43.py").write_text(TREE_TRAIN)
    (root / "tasks" / "layers_43.py").write_text(TREE_LAYERS.format(op=op))
    (root / "capture_43.py").write_text(TREE_CAPTURE)
    res = run_python([str(root / "capture_43.py"), str(root)])
    assert res.code == 0, res.stderr
    return str(root)


def test_two_trees_with_a_same_named_sibling_in_one_process(tmp_path):
    """Each run imports its own tree's sibling, not the module of that name a run before
    imported; sys.path is as it was after each run."""
    a, b = _tree(tmp_path / "A", "sqrt"), _tree(tmp_path / "B", "log")
    res = _runs(tmp_path, "two", a, b)
    assert res.code == 0, res.stderr
    assert res.stdout.split() == ["aten.sqrt.default", "aten.log.default", "aten.sqrt.default",
                                  "aten.log.default", "False"]


def test_a_fix_on_disk_is_what_the_next_run_in_the_process_replays(tmp_path):
    """The "did my fix work" loop: code="local", the sibling fixed, run again: the fixed module
    runs (the step is finite), not the one the first run imported."""
    a = _tree(tmp_path / "A", "sqrt")
    res = _runs(tmp_path, "fix", a)
    assert res.code == 0, res.stderr
    assert res.stdout.split() == ["aten.sqrt.default", "clean"]
