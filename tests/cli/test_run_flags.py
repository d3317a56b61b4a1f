"""`run`'s flags reach `nanbisect.pipeline.RunOptions`: --code and --run-top-level (what they do
is tested where they are implemented), and --code's refusal of anything but local or bundle."""
from __future__ import annotations

import pytest

from helpers import invoke, one_line_exit_2
from helpers.paths import FIXTURES
from nanbisect.errors import BadInput


@pytest.fixture
def options_given(monkeypatch):
    """The `RunOptions` each `nanbisect run` in this process hands the pipeline (which stops
    there: one line, exit 2)."""
    import nanbisect.pipeline
    import nanbisect.report.rerun

    got = []

    def run_bundle(path, options, out, progress):
        got.append(options)
        raise BadInput("stopped by the test")
    monkeypatch.setattr(nanbisect.pipeline, "run_bundle", run_bundle)
    monkeypatch.setattr(nanbisect.report.rerun, "prestart", lambda path, target: None)
    return got


@pytest.mark.parametrize("flags, code, top", [
    ([], None, False),
    (["--code", "bundle"], "bundle", False),
    (["--code", "local", "--run-top-level"], "local", True),
])
def test_code_and_run_top_level_reach_the_options(options_given, tmp_path, flags, code, top):
    res = invoke("run", FIXTURES / "nan_batch", "--out", tmp_path / "r", *flags)
    one_line_exit_2(res, "stopped by the test")
    (options,) = options_given
    assert (options.code, options.run_top_level) == (code, top)


def test_code_refuses_other_values(options_given, tmp_path):
    res = invoke("run", FIXTURES / "nan_batch", "--code", "git")
    one_line_exit_2(res, "--code 'git'", "local", "bundle")
    assert options_given == []           # refused before the pipeline


def test_devices_and_ranks_reach_the_options_as_values(monkeypatch, tmp_path):
    """The command builds the `RunOptions` once from its typed parameters (`api.run_options`,
    as ``nanbisect.run`` does): devices as `DeviceSpec`, ranks as ints, ``out`` a path; the
    repro's interpreter is started once (`api.start`), not once by the command and again by
    the API."""
    import nanbisect.pipeline
    import nanbisect.report.rerun
    from nanbisect.util.spec import DeviceSpec

    got, started = [], []

    def run_bundle(path, options, out, progress):
        got.append((options, out))
        raise BadInput("stopped by the test")
    monkeypatch.setattr(nanbisect.pipeline, "run_bundle", run_bundle)
    monkeypatch.setattr(nanbisect.report.rerun, "prestart",
                        lambda path, target: started.append(target))
    res = invoke("run", FIXTURES / "nan_batch", "--out", tmp_path / "r", "--target", "cpu",
                 "--reference", "cpu:float64", "--ranks", "1,0", "--steps", "2")
    one_line_exit_2(res, "stopped by the test")
    ((options, out),) = got
    assert (options.target, options.reference) == (DeviceSpec("cpu"), DeviceSpec("cpu", "float64"))
    assert (options.ranks, options.steps, options.out) == ((0, 1), 2, tmp_path / "r")
    assert out == tmp_path / "r" and started == ["cpu"]
