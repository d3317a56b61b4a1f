"""The repro's one run: in an interpreter started ahead (`nanbisect.report.rerun.Interpreter`) or
in a fork of this process (`Fork`, torch loaded); either must say what a plain ``python
repro.py`` says, keep nanbisect away from the script, and the interpreter falls back to a plain
one when it cannot do its job."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from nanbisect.report.rerun import Fork, Interpreter, run_repro

# what the script saw of its interpreter, then the verdict its exit code and line give
PROBE = textwrap.dedent("""
    import os, sys
    preloaded = "torch" in sys.modules
    import torch
    print("PRELOADED", preloaded, "CWD", os.getcwd(), "ARGV", sys.argv[1:], "NAME", __name__)
    print("PATH0", sys.path[0])
    {body}
""")


def _script(tmp_path, body: str, name: str = "repro.py"):
    d = tmp_path / "report" / "repro"
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(PROBE.format(body=textwrap.dedent(body)))
    return p


def _saw(result) -> dict:
    line = next(x for x in result.output.splitlines() if x.startswith("PRELOADED"))
    words = line.split()
    return {"preloaded": words[1] == "True", "cwd": words[3], "name": words[-1]}


def _warm(kind: str, tmp_path):
    """A runner with torch already loaded: a started interpreter, or a fork of this process."""
    if kind == "fork":
        return Fork()
    return Interpreter().start()


@pytest.mark.parametrize("kind", ["interpreter", "fork"])
@pytest.mark.slow
def test_started_interpreter_runs_the_script_as_python_would(tmp_path, kind):
    script = _script(tmp_path, """
        x = torch.randn(300, 300)
        print("MATMUL", bool(torch.isfinite(x @ x).all()))   # an op that uses the thread pool
        print("REPRODUCED: planted")
        sys.exit(1)
    """)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.randn(500, 500) @ torch.randn(500, 500)    # this process's thread pool is in use
        warm = _warm(kind, tmp_path).submit(script, "cpu", timeout=120).result()
    finally:
        torch.set_num_threads(threads)
    cold = run_repro(script, "cpu")
    assert warm.reproduced and cold.reproduced and warm.exit_code == cold.exit_code == 1
    w, c = _saw(warm), _saw(cold)
    assert w["preloaded"] and not c["preloaded"]         # torch was imported ahead: it is warm
    assert w["cwd"] == c["cwd"] == str(script.parent.parent) and w["name"] == "__main__"
    assert "ARGV ['--device', 'cpu']" in warm.output and f"PATH0 {script.parent}" in warm.output
    assert "MATMUL True" in warm.output


@pytest.mark.slow
def test_exit_1_without_the_reproduced_line_is_not_reproduced(tmp_path):
    """An uncaught exception exits 1 too: it is not the script saying it reproduced."""
    script = _script(tmp_path, "raise RuntimeError('broken repro')")
    for result in (Interpreter().start().run(script, "cpu"), run_repro(script, "cpu"),
                   Fork().submit(script, "cpu").result()):
        assert result.exit_code == 1 and result.reproduced is False
        assert "broken repro" in result.output


@pytest.mark.parametrize("kind", ["interpreter", "fork"])
@pytest.mark.slow
def test_the_script_cannot_import_nanbisect_but_a_file_it_loads_may(tmp_path, kind):
    helper = tmp_path / "ops.py"      # e.g. the entry file that registers a custom op
    helper.write_text("import nanbisect\nVERSION = nanbisect.__version__\n")
    script = _script(tmp_path, f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("nb_ops", {str(helper)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print("HELPER", mod.VERSION)
        try:
            import nanbisect.records
        except ModuleNotFoundError as e:
            print("BLOCKED", e)
            sys.exit(0)
        print("REPRODUCED: nanbisect was importable")
        sys.exit(1)
    """)
    result = _warm(kind, tmp_path).submit(script, "cpu").result()
    assert result.exit_code == 0 and not result.reproduced, result.output
    assert "HELPER" in result.output
    assert "BLOCKED No module named 'nanbisect" in result.output
    assert "a repro must run without nanbisect" in result.output


@pytest.mark.slow
def test_an_interpreter_that_died_falls_back_to_a_plain_one(tmp_path):
    script = _script(tmp_path, """
        print("REPRODUCED: planted")
        sys.exit(1)
    """)
    interp = Interpreter().start()
    interp.proc.kill()
    interp.proc.wait()
    result = interp.run(script, "cpu")
    assert result.reproduced and not _saw(result)["preloaded"]   # run_repro's interpreter
    never = Interpreter()                                        # never started
    assert never.run(script, "cpu").reproduced


def test_a_fork_that_runs_too_long_is_killed(tmp_path):
    script = _script(tmp_path, "import time; time.sleep(60)")
    result = Fork().submit(script, "cpu", timeout=2).result()
    assert result.exit_code is None and result.output == "timed out after 2s"
    assert Fork.usable("cpu", "aten.sqrt.default") and not Fork.usable("cuda", "aten.mm.default")
    assert not Fork.usable("cpu", "nbtrap.scaled.default")     # a custom op: a fresh interpreter


def test_an_unused_interpreter_is_ended(tmp_path):
    interp = Interpreter().start()
    proc = interp.proc
    interp.close()
    assert proc.returncode is not None and interp.proc is None


def test_the_report_times_its_passes_and_the_repro_ran_warm(fixture_bundle, tmp_path):
    """report.json's timings: every pass of the run, in order, each a non-negative duration."""
    from helpers import cli

    bundle = fixture_bundle("forward_nan_behind_mask")
    r = cli("run", "--ckpt", bundle, "--out", tmp_path / "r", "--json")
    assert r.code == 1, r.stderr
    rep = json.loads(r.stdout)
    t = rep["timings"]
    # a forward culprit on the CPU: its inputs were caught during the op recording (issue 29),
    # so there is no separate input-catch pass
    assert list(t)[:5] == ["read", "build", "module-pass", "op-recording", "remedies"]
    assert "input-catch" not in t and "culprit" not in t      # the culprit: a moment, said
    assert r.stderr.startswith("nanbisect: culprit found: nan born in aten.sqrt.default")
    assert "repro" in t and all(v >= 0 for v in t.values())
    assert rep["repro_result"]["reproduced"] is True
    assert json.loads((tmp_path / "r" / "report.json").read_text())["timings"] == t


@pytest.mark.slow
def test_a_fork_that_cannot_be_made_falls_back_to_a_fresh_interpreter(tmp_path, monkeypatch):
    """os.fork failing (ENOMEM: a large process on a node without overcommit) is not a
    verdict: the script runs in a fresh interpreter instead."""
    import os

    script = _script(tmp_path, """
        print("REPRODUCED: planted")
        sys.exit(1)
    """)

    def no_fork():
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(os, "fork", no_fork)
    result = Fork().submit(script, "cpu").result()
    assert result.reproduced and not _saw(result)["preloaded"]


def test_a_run_forked_from_a_server_runs_a_custom_ops_repro_in_a_fork_of_that_server(tmp_path):
    """`runner` in a process forked from a fork server (a triage replay, the suite's CLI runs):
    a custom op's repro (no `Fork`: this process registered the op) runs in a `ServerFork`,
    torch preloaded, nanbisect dropped and blocked, and says what a fresh interpreter would.
    Outside such a process: `Fork` for a built-in op, an `Interpreter` for a custom op."""
    from helpers import run_python
    from nanbisect.report.rerun import ServerFork, runner

    script = _script(tmp_path, """
        try:
            import nanbisect.records
            print("NOT BLOCKED")
            sys.exit(3)
        except ModuleNotFoundError as e:
            print("BLOCKED", e)
        print("NANBISECT LOADED", any(m.split(".")[0] == "nanbisect" for m in sys.modules))
        print("REPRODUCED: planted")
        sys.exit(1)
    """)
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from nanbisect.report.rerun import runner
        r = runner("cpu", "nbtest.custom.default")
        res = r.submit(Path({str(script)!r}), "cpu", timeout=120).result()
        print(type(r).__name__, res.reproduced, res.exit_code)
        print(res.output)
    """))
    res = run_python([str(driver)], cwd=tmp_path)
    assert res.stdout.split("\n")[0].split() == ["ServerFork", "True", "1"], \
        res.stdout + res.stderr
    assert "PRELOADED True" in res.stdout and "NANBISECT LOADED False" in res.stdout
    assert "BLOCKED No module named 'nanbisect" in res.stdout
    assert not ServerFork.usable("cpu")               # this process came from no server
    assert isinstance(runner("cpu", "aten.add.Tensor"), Fork)
    assert isinstance(runner("cpu", "nbtest.custom.default"), Interpreter)
