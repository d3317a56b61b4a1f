"""A task factory defined in ``__main__`` (a notebook's cells, or a script's own namespace) is
refused by ``Guard(...)`` and ``nanbisect.capture(...)`` before the first step, with one line that
says how to move it into a file (guard/entry.py `refuse_main`): a replay imports the entry in a
fresh process, where ``__main__`` is nanbisect. The fix it names works: the factory written to
task.py by a cell, imported, and given as ``task.py:make_task`` trains, bundles and replays to the
planted op. A script that names itself by its path (``train.py:make_task``) is not refused.

The notebook is imitated the way Jupyter runs cells: source strings compiled as ``<cell>`` and
executed in the ``__main__`` of a fresh interpreter (``python -c``), which has no file.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from helpers import cli, run_python

# the model and its factory as a notebook's cell holds them: a log of a row that is all zeros
MODEL_CELL = textwrap.dedent('''
    import torch, nanbisect

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.log(self.lin(x) * x[:, :1])      # row 1 of x is 0: log(0) = -inf

    def make_task():
        torch.manual_seed(0)
        m = Net()
        return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.1),
                              lambda model, b: model(b).mean())

    def batch():
        x = torch.ones(2, 4)
        x[1] = 0
        return x
''')


def run_cells(cells: list[str], cwd: Path):
    """Execute ``cells`` one after the other in ``__main__`` of a fresh interpreter, each
    compiled as ``<cell>`` (as Jupyter does); the process's result."""
    prog = "".join(f"exec(compile({c!r}, '<cell>', 'exec'))\n" for c in cells)
    return run_python(["-c", prog], cwd=cwd, fresh=True, timeout=120)


def refusal(res) -> str:
    """The one line a cell printed for the BadInput it caught (and the process ended 0)."""
    assert res.code == 0, res.stdout + res.stderr
    said = json.loads(res.stdout.strip().splitlines()[-1])
    line = said["refused"]
    assert line is not None and "\n" not in line, said
    return line


CATCH = '''
import json
try:
    {call}
    said = None
except nanbisect.BadInput as e:
    said = str(e)
print(json.dumps({{"refused": said}}))
'''


def test_guard_in_a_notebook_is_refused_before_the_first_step(tmp_path):
    out = tmp_path / "bundles"
    call = f"g = nanbisect.Guard(make_task(), entry='__main__:make_task', out={str(out)!r})"
    line = refusal(run_cells([MODEL_CELL, CATCH.format(call=call)], tmp_path))
    assert line.startswith("entry '__main__:make_task' names __main__"), line
    assert "where __main__ is nanbisect" in line
    assert "%%writefile task.py" in line and "entry='task.py:make_task'" in line, line
    assert not out.exists()         # refused before `out` was made: nothing written


def test_capture_in_a_notebook_is_refused_with_nothing_written(tmp_path):
    path = tmp_path / "b"
    call = (f"nanbisect.capture(make_task(), batch(), {str(path)!r}, "
            "entry='__main__:make_task')")
    line = refusal(run_cells([MODEL_CELL, CATCH.format(call=call)], tmp_path))
    assert "names __main__" in line and "%%writefile task.py" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_factory_defined_in_the_session_is_refused_under_another_module_name(tmp_path):
    """A module that re-exports a factory the session defined is refused too: a replay imports
    that module, not the session."""
    alias = ("import sys, types; m = types.ModuleType('mytasks'); m.make_task = make_task; "
             "sys.modules['mytasks'] = m")
    call = f"nanbisect.Guard(make_task(), entry='mytasks:make_task', out={str(tmp_path / 'o')!r})"
    line = refusal(run_cells([MODEL_CELL, alias, CATCH.format(call=call)], tmp_path))
    assert "names __main__" in line, line
    assert not (tmp_path / "o").exists()


def test_the_fix_the_refusal_names_trains_bundles_and_replays(tmp_path):
    """%%writefile task.py, `from task import make_task`, entry='task.py:make_task': the bundle
    replays in a fresh process to the planted op."""
    writefile = f"open('task.py', 'w').write({MODEL_CELL!r})"
    train = textwrap.dedent(f'''
        from task import make_task, batch
        import json, nanbisect
        g = nanbisect.Guard(make_task(), entry='task.py:make_task', out={str(tmp_path / "b")!r})
        try:
            g.step(batch())
        except nanbisect.NonFiniteStep as e:
            print(json.dumps({{"bundle": str(e.bundle)}}))
    ''')
    res = run_cells([writefile, train], tmp_path)
    assert res.code == 0, res.stdout + res.stderr
    bundle = json.loads(res.stdout.strip().splitlines()[-1])["bundle"]
    rep = cli("run", bundle, "--json", "--out", tmp_path / "r", cwd=tmp_path)
    assert rep.code == 1, rep.stdout[-2000:] + rep.stderr
    culprit = json.loads(rep.stdout)["culprit"]
    assert culprit["op"] == "aten.log.default" and culprit["source"].endswith("task.py:10")


SCRIPT = MODEL_CELL + textwrap.dedent('''
    if __name__ == "__main__":
        import json, sys
        try:
            g = nanbisect.Guard(make_task(), entry=sys.argv[1], out="bundles")
            g.step(batch())
            said = None
        except nanbisect.BadInput as e:
            said = str(e)
        except nanbisect.NonFiniteStep as e:
            said = "bundle " + str(e.bundle)
        print(json.dumps({"refused": said}))
''')


def test_a_script_naming_itself_by_its_path_is_fine_and_by_main_is_refused(tmp_path):
    """``python train.py`` with entry='train.py:make_task' trains, bundles and replays; with
    entry='__main__:make_task' the line names the script's own path as the fix."""
    (tmp_path / "train.py").write_text(SCRIPT)
    ok = run_python(["train.py", "train.py:make_task"], cwd=tmp_path, fresh=True, timeout=120)
    assert ok.code == 0 and refusal(ok) == "bundle bundles/step000000", ok.stdout + ok.stderr
    rep = cli("run", "bundles/step000000", "--json", "--out", tmp_path / "r", cwd=tmp_path)
    assert rep.code == 1, rep.stdout[-2000:] + rep.stderr
    assert json.loads(rep.stdout)["culprit"]["op"] == "aten.log.default"
    res = run_python(["train.py", "__main__:make_task"], cwd=tmp_path, fresh=True, timeout=120)
    line = refusal(res)
    assert "names __main__" in line and "entry='train.py:make_task'" in line, line
