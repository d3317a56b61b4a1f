"""End to end through the CLI, in a subprocess, on the shipped fixture bundles."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import FIXTURES, TASKS, cli, run_json, same_run, tree_digest

import nanbisect

# fixture -> (phase, module, module_call, op, input dtypes); the faults are planted in
# fixtures/tasks/<name>.py and found by the tool, these are only the expectations.
EXPECTED = {
    "forward_nan_behind_mask": ("forward", "blocks.1.mlp.act", 2, "aten.sqrt.default",
                                ["float32"]),
    "backward_nan_custom_function": ("backward", "blocks.0.mlp.act", 0, "aten.div.Tensor",
                                     ["float32", "float32"]),
    "optimizer_adam_eps0": ("optimizer", "embed", None, "aten.addcdiv_.default",
                            ["float32"] * 3),
    "overflow_then_nan": ("forward", "normalize", 0, "aten.div.Tensor", ["float32"] * 2),
    "moe_unpermute_fp32_probs": ("backward", "moe.combine", 0, "nbfix.unpermute_backward.default",
                                 ["float32"] * 3),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=same_run(n)) for n in sorted(EXPECTED)])
def test_fixture_culprit(name, replayed):
    phase, module, call, op, dtypes = EXPECTED[name]
    bundle, rep = replayed(name)
    assert rep == json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert (rep["schema"], rep["verdict"]) == ("nanbisect.report/1", "culprit")
    c = rep["culprit"]
    assert (c["phase"], c["module"], c["module_call"], c["op"]) == (phase, module, call, op)
    assert rep["phase"] == phase and rep["kind"] == "nan"
    assert c["rank"] == 0 and c["input_dtypes"] == dtypes
    assert isinstance(c["op_index"], int) and c["op_index"] >= 0
    assert rep["context"][-1]["op"] == op and rep["context"][-1]["culprit"]
    assert rep["repro"] == "repro/repro.py" and rep["repro_result"]["reproduced"] is True
    assert (bundle / "nanbisect-report" / "report.md").is_file()


@same_run("forward_nan_behind_mask")
def test_forward_culprit_details(replayed):
    bundle, res = replayed("forward_nan_behind_mask", json_=False)
    assert res.code == 1, res.stdout + res.stderr
    assert "blocks.1.mlp.act" in res.stdout and "call 2" in res.stdout
    rep = json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    # the line in SoftClamp.forward that calls torch.sqrt
    assert rep["culprit"]["source"].endswith("forward_nan_behind_mask.py:24")
    # the ops before it, in the same module call, were clean
    assert [r["out_nan"] for r in rep["context"]] == [False] * (len(rep["context"]) - 1) + [True]
    assert rep["culprit"]["input_shapes"] == [[4, 12, 128]]
    # the attention calls before it saw -inf (masks) and were not blamed; calls after propagate
    rows = rep["backtrace"]
    roles = {(r["module"], r["call"]): r["role"] for r in rows}
    assert roles[("blocks.1.mlp.act", 2)] == "culprit"
    assert roles[("blocks.1.mlp.out", 2)] == "propagator"
    assert any(r["before"]["neginf"] > 0 and r["role"] == "clean" for r in rows)
    md = (bundle / "nanbisect-report" / "report.md").read_text()
    assert "| **`blocks.1.mlp.act`** | 2 | culprit |" in md


@same_run("backward_nan_custom_function")
def test_backward_culprit_is_custom_function_not_norm(replayed):
    """RowNorm's backward divides 0/0 (and masks it) before the custom backward runs."""
    _, rep = replayed("backward_nan_custom_function")
    assert rep["culprit"]["module"] == "blocks.0.mlp.act"
    assert rep["culprit"]["source"].endswith("backward_nan_custom_function.py:26")  # the backward
    assert all(r["phase"] == "backward" for r in rep["context"])
    # bit for bit on the machine the fixtures were made on; on another CPU (or another ATen
    # instruction set: ATEN_CPU_CAPABILITY) within tolerance, the difference named, the verdict
    # the same: never replay-mismatch
    r = rep["replay"]
    assert r["fidelity"] in ("bit-exact", "within-tolerance") and rep["classification"] == "unknown"
    if r["hardware"] == "same" and not r["environment_changed"]:
        assert r["bit_exact"] is True and r["original_loss"] == r["target_loss"]
    manifest = json.loads((FIXTURES / "backward_nan_custom_function" / "manifest.json").read_text())
    then = manifest["environment"]["hardware"]["cpu"]["capability"]
    now = torch.backends.cpu.get_cpu_capability()
    assert (f"cpu capability: {then} at capture, {now} now" in r["hardware_changed"]) == (
        then != now), r["hardware_changed"]


@same_run("optimizer_adam_eps0")
def test_optimizer_culprit_names_parameter(replayed):
    _, rep = replayed("optimizer_adam_eps0")
    assert rep["culprit"]["parameter"] == "embed.weight"
    assert rep["observed"]["summary"] == {"loss": "finite", "grads": "finite", "params": "nan"}


@same_run("overflow_then_nan")
def test_overflow_reports_inf_origin(replayed):
    _, rep = replayed("overflow_then_nan")
    o = rep["inf_origin"]
    assert (o["op"], o["module"], o["module_call"], o["phase"]) == (
        "aten.exp.default", "score", 0, "forward")
    assert o["op_index"] < rep["culprit"]["op_index"]


@same_run("moe_unpermute_fp32_probs")
def test_custom_op_backward_is_a_culprit(replayed):
    _, rep = replayed("moe_unpermute_fp32_probs")
    assert rep["culprit"]["input_shapes"] == [[6, 16], [6, 16], [6]]
    moe = (TASKS / "moe.py").read_text().splitlines()
    line = next(i for i, t in enumerate(moe, 1) if "unpermute_backward(grad, expert_out" in t)
    assert rep["culprit"]["source"].endswith(f"moe.py:{line}")  # the custom backward's call


@same_run("forward_nan_behind_mask")
def test_repro_runs_without_nanbisect(replayed, tmp_path):
    """The repro needs only torch and safetensors, from any directory: exit 1 = reproduced."""
    import subprocess

    bundle, res = replayed("forward_nan_behind_mask", json_=False)
    assert res.code == 1, res.stdout + res.stderr
    repro = tmp_path / "elsewhere" / "repro"
    shutil.copytree(bundle / "nanbisect-report" / "repro", repro)
    assert sorted(p.name for p in repro.iterdir()) == ["inputs.safetensors", "repro.py"]
    code = ("import sys; sys.modules['nanbisect'] = None\n"
            "try:\n    import nanbisect\nexcept ImportError:\n    pass\n"
            "else:\n    raise SystemExit('nanbisect is importable')\n"
            "import runpy; sys.argv = ['repro.py']\n"
            f"runpy.run_path({str(repro / 'repro.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REPRODUCED: aten.sqrt.default" in p.stdout and "nan=0" in p.stdout


@pytest.mark.slow
def test_nan_batch_is_input_nonfinite(fixture_bundle):
    bundle = fixture_bundle("nan_batch")
    rep = run_json(bundle)
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "input-nonfinite", "data", "input")
    assert rep["culprit"] is None
    # the corrupt sample x[5, 2] and its target y[5] = x[5].sum()
    assert rep["input_nonfinite"] == [
        {"where": "batch", "name": "[0]", "nan": 1, "posinf": 0, "neginf": 0},
        {"where": "batch", "name": "[1]", "nan": 1, "posinf": 0, "neginf": 0}]


@pytest.mark.slow
def test_healthy_is_clean(fixture_bundle, tmp_path):
    out = tmp_path / "rep"
    res = cli("run", "--ckpt", fixture_bundle("healthy"), "--out", out)
    assert res.code == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "clean" and rep["culprit"] is None
    assert "clean" in res.stdout


@pytest.mark.slow
def test_healthy_replay_is_bit_exact(tmp_path, monkeypatch):
    """capture, run the step here, then replay in a fresh process: same loss, bit for bit."""
    monkeypatch.syspath_prepend(str(TASKS))
    import healthy

    task = healthy.task()
    batches = healthy.batches()
    for _ in range(2):  # non-trivial optimizer state and RNG position
        task.optimizer.zero_grad()
        task.loss_fn(task.model, next(batches)).backward()
        task.optimizer.step()
    batch = next(batches)
    bundle = nanbisect.capture(task, batch, tmp_path / "b",
                               entry=f"{TASKS / 'healthy.py'}:task", step=2)
    losses = [task.loss_fn(task.model, batch).item() for _ in range(2)]
    assert losses[0] != losses[1]  # dropout and rand_like really draw: RNG matters
    rep = json.loads(cli("run", "--ckpt", bundle, "--json").stdout)
    assert rep["verdict"] == "clean"
    assert rep["replay"]["target_loss"] == losses[0]


@pytest.mark.slow
def test_not_reproduced(tmp_path, monkeypatch):
    """A fault present only while capturing (an env flag) does not reproduce: exit 3."""
    monkeypatch.setenv("NANBISECT_TEST_FLAKY", "1")
    monkeypatch.syspath_prepend(str(TASKS.parent.parent / "tests" / "tasks"))
    import transient

    guard = nanbisect.Guard(transient.task(), entry=f"{transient.__file__}:task",
                            out=tmp_path / "g")
    with pytest.raises(nanbisect.NonFiniteStep) as e:
        guard.step(transient.batch())
    rep = run_json(e.value.bundle, code=3)  # cli() drops NANBISECT_TEST_* vars
    assert (rep["verdict"], rep["classification"], rep["culprit"]) == (
        "not-reproduced", "transient", None)


@pytest.mark.slow
def test_console_script_and_module_agree(fixture_bundle):
    """`nanbisect` (the installed console script) and `python -m nanbisect` are one program."""
    import subprocess

    exe = shutil.which("nanbisect")
    if exe is None:
        pytest.skip("console script not on PATH")
    bundle = fixture_bundle("healthy")
    script = subprocess.run([exe, "inspect", bundle, "--json"], capture_output=True, text=True)
    module = cli("inspect", bundle, "--json")
    assert (script.returncode, module.code) == (0, 0), script.stderr + module.stderr
    assert json.loads(script.stdout) == json.loads(module.stdout)
    assert json.loads(script.stdout)["bundle"] == str(bundle)


def test_fixtures_find_their_entry_from_any_directory(tmp_path, monkeypatch):
    """Issue 38 item 9: every shipped bundle's ``entry_file_from_bundle`` leads, from the bundle,
    to its task file, so a replay started in any working directory imports it."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.replay.replayer import resolve_entry

    monkeypatch.chdir(tmp_path)
    names = sorted(d.name for d in FIXTURES.iterdir() if (d / "manifest.json").is_file())
    assert len(names) >= 10
    for name in names:
        bundle = read_bundle(FIXTURES / name, verify=False)
        target, _, func = resolve_entry(bundle).rpartition(":")
        recorded = bundle.manifest["entry"].partition(":")[0]    # fixtures/tasks/NAME.py
        assert Path(target).is_absolute() and Path(target) == (TASKS / Path(recorded).name
                                                               ).resolve(), name


def test_fixture_replays_from_another_directory(tmp_path):
    """The shipped bundle itself (not a copy), replayed from a temporary working directory with
    its report elsewhere: the culprit is found and the fixture is left as it was."""
    bundle = FIXTURES / "optimizer_adam_eps0"
    before = tree_digest(bundle)
    res = cli("run", "--ckpt", bundle, "--json", "--out", tmp_path / "rep", cwd=tmp_path)
    assert res.code == 1, res.stdout[-2000:] + res.stderr
    rep = json.loads(res.stdout)
    assert (rep["culprit"]["phase"], rep["culprit"]["op"]) == ("optimizer",
                                                               "aten.addcdiv_.default")
    assert tree_digest(bundle) == before


def test_make_fixtures_keeps_the_entry_of_a_moved_bundle(tmp_path, monkeypatch):
    """The fixture maker moves each guard bundle out of its scratch directory (a level deeper):
    the moved bundle's entry file is still found from it, from any working directory."""
    import importlib.util

    from nanbisect.bundle.format import read_bundle
    from nanbisect.replay.replayer import resolve_entry

    spec = importlib.util.spec_from_file_location(
        "make_fixtures", Path(__file__).resolve().parents[2] / "scripts" / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    monkeypatch.syspath_prepend(str(TASKS))
    import healthy

    task = healthy.task()
    written = nanbisect.capture(task, next(healthy.batches()), tmp_path / "scratch" / "step-3",
                                entry=f"{TASKS / 'healthy.py'}:task", step=3)
    (tmp_path / "bundles").mkdir()
    make_fixtures._move(written, tmp_path / "bundles" / "healthy")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    bundle = read_bundle(tmp_path / "bundles" / "healthy")     # sha256s still match
    rel = bundle.manifest["entry_file_from_bundle"]
    assert (bundle.path / rel).resolve() == (TASKS / "healthy.py").resolve()
    assert resolve_entry(bundle) == f"{(TASKS / 'healthy.py').resolve()}:task"
