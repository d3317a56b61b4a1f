"""The Python API survives what callers do (issue 62): a value of the wrong type is a one-line
`BadInput` (``reference=5`` and ``entry=object()`` raised AttributeError); an empty ``out`` is
refused (it wrote into the working directory); ``sys.argv`` is never left changed, whatever
threads run at once (two runs left the entry file behind); a Ctrl-C in the first seconds of a
fresh interpreter's first run does not poison the next run (a half-imported torch: "partially
initialized module 'torch' has no attribute ...")."""
from __future__ import annotations

import sys
import threading

import pytest

import nanbisect
from helpers import FIXTURES, TEST_TASKS, run_python
from nanbisect import BadInput
from nanbisect.task import _argv

SQRT = "forward_nan_behind_mask"


@pytest.mark.parametrize("kw, words", [
    ({"reference": 5}, "run: reference=5 is not a device string"),
    ({"target": 3.0}, "run: target=3.0 is not a device string"),
    ({"entry": object()}, "run: entry=<object object at"),
    ({"inject": 7}, "run: inject=7 is not a str"),
    ({"code": ["local"]}, "run: code=['local'] is not a str"),
    ({"out": ""}, "out='' is empty; pass a directory (. for this one)"),
    ({"out": 5}, "out=5 is not a path"),
])
def test_a_value_of_the_wrong_type_is_one_line(fixture_bundle, tmp_path, monkeypatch, kw, words):
    bundle = fixture_bundle(SQRT)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(BadInput) as e:
        nanbisect.run(bundle, repro=False, **kw)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)
    assert list(here.iterdir()) == [] and not (bundle / "nanbisect-report").exists()


def test_sys_argv_is_put_back_whatever_threads_do(tmp_path):
    """Two blocks that overlap on two threads, the first ending first: the argv found before
    either is what is left (each putting back what it found left the first's entry file)."""
    before = list(sys.argv)
    entered, first_out = threading.Barrier(2), threading.Event()

    def first():
        with _argv(tmp_path / "a.py"):
            entered.wait()
        first_out.set()

    def second():
        entered.wait()
        with _argv(tmp_path / "b.py"):
            first_out.wait()
            assert sys.argv == [str(tmp_path / "b.py")]

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sys.argv == before


def test_two_runs_on_two_threads_leave_sys_argv_as_it_was(fixture_bundle, tmp_path):
    before = list(sys.argv)
    bundle = fixture_bundle(SQRT)
    got: list = []

    def one(i: int) -> None:
        got.append(nanbisect.run(bundle, repro=False, remedies=False,
                                 out=tmp_path / f"r{i}").culprit.op)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sys.argv == before and got == ["aten.sqrt.default"] * 2


@pytest.mark.parametrize("where", ["torch.fx", "torch.distributed.rpc"])
def test_a_ctrl_c_inside_import_torch_leaves_the_next_run_working(where):
    """A fresh interpreter's first run, interrupted the moment ``where`` starts being imported
    (inside ``import torch``), then a second run in the same interpreter."""
    res = run_python([str(TEST_TASKS / "interrupted_run.py"), where, str(FIXTURES / SQRT)],
                     fresh=True, timeout=240)
    assert res.stdout.splitlines() == ["interrupted", "second: aten.sqrt.default"], \
        res.stdout + res.stderr[-2000:]
