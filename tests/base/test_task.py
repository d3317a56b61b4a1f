"""Entries (`nanbisect.task`): an entry that trains when imported is stopped before its first
step, with one line naming its file and line and the fix, and nothing written; torch is left as
it was."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from helpers import TEST_TASKS, cli, one_line_exit_2
from nanbisect.errors import BadInput
from nanbisect.task import import_target, load_task

HEAD = """\
import torch
import nanbisect
from trap_events import events

def make_task():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).pow(2).mean())

task = make_task()
"""

# the loops users write at module level; each tells `events` how far it got ("step" after a
# step's training call). The line each must be stopped at is marked `# <- here`.
LOOPS = {
    "Guard(...)": """\
guard = nanbisect.Guard(task, entry=__file__ + ":make_task", out=OUT)  # <- here
for i in range(3):
    guard.step(torch.ones(4, 2))
    events.append("step")
""",
    "Tensor.backward": """\
for i in range(3):
    try:
        task.optimizer.zero_grad()
        task.loss_fn(task.model, torch.ones(4, 2)).backward()  # <- here
        task.optimizer.step()
        events.append("step")
    except Exception:   # a loop that swallows errors must still be stopped
        events.append("swallowed")
""",
    "torch.autograd.backward": """\
loss = task.loss_fn(task.model, torch.ones(4, 2))
torch.autograd.backward([loss])  # <- here
events.append("step")
""",
    "SGD.step": """\
for p in task.model.parameters():
    p.grad = torch.ones_like(p)
task.optimizer.step()  # <- here
events.append("step")
""",
    "nanbisect.capture(...)": """\
nanbisect.capture(task, torch.ones(4, 2), OUT + "/step0", entry=__file__ + ":make_task")  # <- here
events.append("step")
""",
}


@pytest.fixture
def events(monkeypatch):
    mod = types.ModuleType("trap_events")
    mod.events = []
    monkeypatch.setitem(sys.modules, "trap_events", mod)
    return mod.events


def _torch_as_torch_made_it():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return (torch.Tensor.backward.__module__, torch.autograd.backward.__module__,
            len(_global_optimizer_pre_hooks))


@pytest.mark.parametrize("what", list(LOOPS))
def test_an_entry_that_trains_at_import_is_stopped_before_its_first_step(tmp_path, events, what):
    out = tmp_path / "out"
    body = HEAD.replace("import torch\n", f"import torch\nOUT = {str(out)!r}\n", 1) + LOOPS[what]
    f = tmp_path / f"train_{abs(hash(what))}.py"
    f.write_text(body)
    line = body.splitlines().index(next(x for x in body.splitlines() if "# <- here" in x)) + 1
    before = _torch_as_torch_made_it()
    with pytest.raises(BadInput) as e:
        load_task(f"{f}:make_task", run_top_level=True)
    msg = str(e.value)
    assert "\n" not in msg and f"{what} at " in msg and f"{f.name}:{line}" in msg, msg
    assert 'under `if __name__ == "__main__":`' in msg, msg
    assert "step" not in events                          # stopped before its first step
    assert not out.exists()                              # nothing written
    assert _torch_as_torch_made_it() == before           # everything patched is restored
    assert f.stem not in sys.modules
    # and training works again once the import is over
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()


def test_a_dotted_entry_that_trains_at_import_is_stopped(tmp_path, events, monkeypatch):
    (tmp_path / "trainpkg_xyz").mkdir()
    (tmp_path / "trainpkg_xyz" / "__init__.py").write_text("")
    (tmp_path / "trainpkg_xyz" / "loop.py").write_text(HEAD.replace(
        "import torch\n", "import torch\nOUT = 'unused'\n", 1) + LOOPS["Tensor.backward"])
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BadInput, match=r"entry module trainpkg_xyz\.loop' starts training .*"
                                       r"Tensor\.backward at .*loop\.py:\d+"):
        import_target("trainpkg_xyz.loop")
    assert "step" not in events


def test_a_guarded_loop_and_imports_that_do_not_train_pass(tmp_path, events):
    """Building the model, running a forward and defining a loop under __main__ are fine."""
    f = tmp_path / "fine_at_import.py"
    f.write_text(HEAD.replace("import torch\n", "import torch\nOUT = 'unused'\n", 1)
                 + "events.append(float(task.loss_fn(task.model, torch.ones(4, 2))))\n"
                 + 'if __name__ == "__main__":\n' + "    task.loss_fn(task.model, 1).backward()\n")
    task = load_task(f"{f}:make_task", run_top_level=True)
    assert isinstance(task.model, torch.nn.Linear) and len(events) == 1


def test_cli_run_of_an_entry_that_trains_at_import(fixture_bundle, tmp_path):
    """`nanbisect run` on an entry file with its loop at module level: exit 2, one line, no
    report, no stray bundle directory (the loop's `out`) in the working directory."""
    b = fixture_bundle("healthy")
    before = sorted(p.name for p in tmp_path.iterdir())
    res = cli("run", b, "--entry", f"{TEST_TASKS / 'trains_at_import.py'}:make_task",
              "--run-top-level", cwd=tmp_path)
    one_line_exit_2(res, "trains_at_import.py", "starts training when imported",
                    "Guard(...) at", "trains_at_import.py:17", 'if __name__ == "__main__":')
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (b / "nanbisect-report").exists()


def test_a_library_that_wraps_backward_at_import_keeps_its_wrapper(tmp_path, monkeypatch):
    """An import that patches Tensor.backward in turn (as profilers do) keeps its patch, and
    backward works through it once the import is over."""
    original = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", original)   # restored after the test
    f = tmp_path / "wraps_backward.py"
    f.write_text("import torch\nseen = []\n_inner = torch.Tensor.backward\n"
                 "def backward(self, *a, **k):\n"
                 "    seen.append(1)\n    return _inner(self, *a, **k)\n"
                 "torch.Tensor.backward = backward\n")
    mod = import_target(str(f))
    assert torch.Tensor.backward is mod.backward
    x = torch.ones(2, requires_grad=True)
    x.sum().backward()
    assert mod.seen == [1] and x.grad.tolist() == [1.0, 1.0]


ARGV_IN_TASK = """\
import argparse
import torch
import nanbisect

def task():
    args = argparse.ArgumentParser().parse_args()    # defaults: no arguments of its own
    model = torch.nn.Linear(2, 1)
    return nanbisect.Task(model=model, optimizer=None, loss_fn=lambda m, b: m(b).sum())
"""


def test_the_task_function_sees_argv_as_the_entry_file_alone(tmp_path, monkeypatch):
    """A task function that parses argv with defaults must not read nanbisect's own arguments;
    argv and sys.path are restored after (also after an entry that fails)."""
    f = tmp_path / "argv_in_task_43.py"
    f.write_text(ARGV_IN_TASK)
    monkeypatch.setattr(sys, "argv", ["nanbisect", "run", "BUNDLE", "--quiet"])
    path = list(sys.path)
    assert isinstance(load_task(f"{f}:task").model, torch.nn.Linear)
    assert sys.argv == ["nanbisect", "run", "BUNDLE", "--quiet"]
    bad = tmp_path / "argv_in_task_43_bad.py"
    bad.write_text(ARGV_IN_TASK.replace("parse_args()", "parse_args(['--no-such-flag'])"))
    with pytest.raises(BadInput, match="raised SystemExit"):
        load_task(f"{bad}:task")
    assert sys.argv == ["nanbisect", "run", "BUNDLE", "--quiet"]
    assert str(tmp_path) in sys.path[:1]        # a loaded task keeps its directory first ...
    sys.path[:] = path                          # (a run's `kept_path` restores it)
