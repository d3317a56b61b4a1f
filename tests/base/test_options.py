"""`nanbisect.options`: a run's options parsed once into a typed, frozen `RunOptions`; the
refusals are the one-line messages the command prints; no torch imported."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from nanbisect.errors import BadInput
from nanbisect.options import RunOptions, device_option
from nanbisect.util.spec import DeviceSpec


def test_parse_gives_typed_values():
    o = RunOptions.parse(target="cuda:1", reference="cuda:1:float64", ranks="3, 1,3",
                         steps=2, remedies=5, code="bundle", entry="train.py:make_task",
                         inject="faults.py:nan_here", repro=0, run_top_level=1, out="r")
    assert o.target == DeviceSpec("cuda:1") and o.reference == DeviceSpec("cuda:1", "float64")
    assert (o.ranks, o.steps, o.remedies, o.code) == ((1, 3), 2, 5, "bundle")
    assert (o.run_repro, o.run_top_level, o.out) == (False, True, Path("r"))
    assert RunOptions.parse(ranks=[2, 0]).ranks == (0, 2)
    assert RunOptions.parse(reference="none").reference.none
    assert RunOptions.parse(target="none").target == DeviceSpec("none")   # no device: refused
    assert RunOptions.parse(remedies=False).remedies == 0                #   when resolved
    assert RunOptions.parse(remedies=True).remedies is None
    spec = DeviceSpec("cpu", "float64")
    assert RunOptions.parse(target=spec).target is spec
    with pytest.raises(FrozenInstanceError):
        o.steps = 3


@pytest.mark.parametrize("kw, said", [
    ({"steps": 0}, "run: steps=0 is out of range"),
    ({"remedies": -1}, "run: remedies=-1 is out of range"),
    ({"ranks": 5}, "run: ranks=5 is not a list of ranks"),
    ({"ranks": "a"}, "--ranks 'a': give rank numbers"),
    ({"target": "gpu 9"}, "device 'gpu 9' is not a torch device string"),
    ({"reference": "cpu:int32"}, "device 'cpu:int32': 'int32' is not a floating dtype"),
    ({"entry": "train.py"}, "entry 'train.py' is not of the form"),
    ({"inject": "faults.py"}, "--inject 'faults.py' is not of the form FILE.py:FUNC"),
    ({"code": "git"}, "--code 'git' is neither local nor bundle"),
])
def test_parse_refuses_with_the_commands_line(kw, said):
    with pytest.raises(BadInput) as e:
        RunOptions.parse(**kw)
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


def test_the_constructor_reads_device_text_as_parse_does():
    """In-process callers (the self-test, tests) may spell a device as text."""
    o = RunOptions(target="cpu", reference="none", ranks="1,0")
    assert (o.target, o.reference.none, o.ranks) == (DeviceSpec("cpu"), True, (0, 1))
    assert RunOptions().target is None and RunOptions().reference is None


def test_device_option_and_no_torch():
    assert device_option("cuda:1") == DeviceSpec("cuda:1")
    with pytest.raises(BadInput, match="not a torch device string"):
        device_option("cuda:01")
    code = ("import sys, nanbisect.options as o; o.RunOptions.parse(reference='cuda:float64'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_api_builds_the_same_options(tmp_path):
    """`nanbisect.api.run_options`: the bundle's path, then `RunOptions.parse` (a `DeviceSpec`
    given is taken as it is), then ``out``."""
    from helpers.paths import FIXTURES
    from nanbisect.api import run_options

    bundle = FIXTURES / "nan_batch"
    o = run_options(bundle, reference=DeviceSpec("cpu", "float64"), out=tmp_path / "r")
    assert o == RunOptions(reference=DeviceSpec("cpu", "float64"), out=tmp_path / "r")
    with pytest.raises(BadInput, match="does not exist|not a directory|no such"):
        run_options(tmp_path / "missing", reference="gpu 9")     # the path first
