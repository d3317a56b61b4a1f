"""End to end through the CLI, in a subprocess, on the shipped fixture bundles."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import TASKS, cli

import nanbisect

# fixture -> (verdict, phase, module, module_call, exit code); the faults are planted in
# fixtures/tasks/<name>.py and found by the tool, these are only the expectations.
EXPECTED = {
    "forward_nan_behind_mask": ("culprit", "forward", "blocks.1.mlp.act", 2, 1),
    "backward_nan_custom_function": ("culprit", "backward", "blocks.0.mlp.act", 0, 1),
    "optimizer_adam_eps0": ("culprit", "optimizer", "embed", None, 1),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_culprit(name, fixture_bundle, tmp_path):
    verdict, phase, module, call, code = EXPECTED[name]
    bundle = fixture_bundle(name)
    res = cli("run", "--ckpt", bundle, "--json")
    assert res.code == code, res.stderr
    rep = json.loads(res.stdout)
    assert rep == json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert (rep["schema"], rep["verdict"]) == ("nanbisect.report/1", verdict)
    c = rep["culprit"]
    assert (c["phase"], c["module"], c["module_call"]) == (phase, module, call)
    assert rep["phase"] == phase and rep["kind"] == "nan"
    assert c["rank"] == 0 and c["input_dtypes"] == ["float32"]
    assert (bundle / "nanbisect-report" / "report.md").is_file()


def test_forward_culprit_details(fixture_bundle):
    bundle = fixture_bundle("forward_nan_behind_mask")
    res = cli("run", "--ckpt", bundle)
    assert res.code == 1
    assert "blocks.1.mlp.act" in res.stdout and "call 2" in res.stdout
    rep = json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert rep["culprit"]["source"].endswith("forward_nan_behind_mask.py:23")
    assert rep["culprit"]["input_shapes"] == [[4, 12, 128]]
    # the attention calls before it saw -inf (masks) and were not blamed; calls after propagate
    rows = rep["backtrace"]
    roles = {(r["module"], r["call"]): r["role"] for r in rows}
    assert roles[("blocks.1.mlp.act", 2)] == "culprit"
    assert roles[("blocks.1.mlp.out", 2)] == "propagator"
    assert any(r["before"]["neginf"] > 0 and r["role"] == "clean" for r in rows)
    md = (bundle / "nanbisect-report" / "report.md").read_text()
    assert "| **`blocks.1.mlp.act`** | 2 | culprit |" in md


def test_backward_culprit_is_custom_function_not_norm(fixture_bundle):
    bundle = fixture_bundle("backward_nan_custom_function")
    rep = json.loads(cli("run", "--ckpt", bundle, "--json").stdout)
    assert rep["culprit"]["module"] == "blocks.0.mlp.act"
    assert rep["replay"]["original_loss"] == rep["replay"]["target_loss"]  # bit for bit
    assert rep["replay"]["bit_exact"] is True


def test_optimizer_culprit_names_parameter(fixture_bundle):
    rep = json.loads(cli("run", "--ckpt", fixture_bundle("optimizer_adam_eps0"), "--json").stdout)
    assert rep["culprit"]["parameter"] == "embed.weight"
    assert rep["observed"]["summary"] == {"loss": "finite", "grads": "finite", "params": "nan"}


def test_nan_batch_is_input_nonfinite(fixture_bundle):
    bundle = fixture_bundle("nan_batch")
    res = cli("run", "--ckpt", bundle, "--json")
    assert res.code == 1
    rep = json.loads(res.stdout)
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "input-nonfinite", "data", "input")
    assert rep["culprit"] is None
    # the corrupt sample x[5, 2] and its target y[5] = x[5].sum()
    assert rep["input_nonfinite"] == [
        {"where": "batch", "name": "[0]", "nan": 1, "posinf": 0, "neginf": 0},
        {"where": "batch", "name": "[1]", "nan": 1, "posinf": 0, "neginf": 0}]


def test_healthy_is_clean(fixture_bundle, tmp_path):
    out = tmp_path / "rep"
    res = cli("run", "--ckpt", fixture_bundle("healthy"), "--out", out)
    assert res.code == 0, res.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "clean" and rep["culprit"] is None
    assert "clean" in res.stdout


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


def test_not_reproduced(tmp_path, monkeypatch):
    """A fault present only while capturing (an env flag) does not reproduce: exit 3."""
    monkeypatch.setenv("NANBISECT_TEST_FLAKY", "1")
    monkeypatch.syspath_prepend(str(TASKS.parent.parent / "tests" / "tasks"))
    import transient

    guard = nanbisect.Guard(transient.task(), entry=f"{transient.__file__}:task",
                            out=tmp_path / "g")
    with pytest.raises(nanbisect.NonFiniteStep) as e:
        guard.step(transient.batch())
    res = cli("run", "--ckpt", e.value.bundle, "--json")  # cli() drops NANBISECT_TEST_* vars
    assert res.code == 3, res.stderr
    rep = json.loads(res.stdout)
    assert (rep["verdict"], rep["classification"], rep["culprit"]) == (
        "not-reproduced", "transient", None)


def test_console_script_and_module_agree(fixture_bundle):
    import shutil
    import subprocess

    exe = shutil.which("nanbisect")
    if exe is None:
        pytest.skip("console script not on PATH")
    p = subprocess.run([exe, "inspect", fixture_bundle("healthy")], capture_output=True, text=True)
    assert p.returncode == 0 and "checksums ok" in p.stdout
    assert sys.executable  # the module form is exercised by every other test
