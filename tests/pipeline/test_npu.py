"""End to end on an accelerator: the emulated ``npu`` (tests/npu, a PrivateUse1 device with its own
dispatch key, generator, pinned memory and device-only fused ops), used as an NPU user would.

The seed case: an MoE model on ``npu:0`` whose fused ``npu_moe_unpermute`` backward returns NaN
for float32 ``probs`` (tests/npu/tasks/npu_train.py ``moe``), trained under ``Guard.step`` until
it fails; then ``nanbisect run`` against the CPU. And a silent divergence: ``npu_fast_gelu``
rounds through bfloat16 on the device, found by ``--steps`` in a spike bundle (``gelu``).

Every process that touches the device is a subprocess (`npu_env`): the training script, the CLI,
the repro. Nothing here is decided by the test: the planted kernels are the device's, the
culprit is what nanbisect finds.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT, cli
from helpers.npu import TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("npu-end-to-end")]

UNPERMUTE_BACKWARD = "npu.npu_moe_unpermute_backward.default"
FAST_GELU = "npu.npu_fast_gelu.default"


def capture(which: str, out, env) -> str:
    p = subprocess.run([sys.executable, str(TRAIN), which, str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    bundles = [line.split(" ", 1)[1] for line in p.stdout.splitlines() if line.startswith("BUNDLE")]
    assert p.returncode == 0 and bundles, p.stdout[-2000:] + p.stderr[-3000:]
    return bundles[0]


def run(bundle, *flags, env, code: int = 1) -> dict:
    res = cli("run", bundle, "--json", *flags, env=env, fresh=True)
    assert res.code == code, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, npu_env):
    return capture("moe", tmp_path_factory.mktemp("moe"), npu_env)


@pytest.fixture(scope="module")
def moe_report(moe, tmp_path_factory, npu_env):
    out = tmp_path_factory.mktemp("moe-report")
    return run(moe, "--reference", "cpu", "--remedy-budget", "2", "--out", out, env=npu_env), out


@pytest.fixture(scope="module")
def gelu(tmp_path_factory, npu_env):
    return capture("gelu", tmp_path_factory.mktemp("gelu"), npu_env)


def test_the_bundle_names_the_device_its_module_and_its_count(moe):
    m = json.loads((ROOT / moe / "manifest.json").read_text())
    assert m["devices"]["captured_on"] == "npu:0"
    assert m["devices"]["accelerators"] == ["npu"]
    npu = m["environment"]["hardware"]["npu"]
    assert len(npu["devices"]) == 2 and npu["devices"][0].startswith("Emulated NPU")
    assert npu["torch_npu"] == "0.0+emulated"
    # caught on the device before the optimizer ran: the gradients NaN, the parameters not yet
    assert m["observed"]["summary"] == {"loss": "finite", "grads": "nan", "params": "finite"}


def test_the_seed_case_names_the_fused_ops_backward_on_the_device(moe_report):
    r, _ = moe_report
    c = r["culprit"]
    assert (c["op"], c["phase"], c["module"], c["module_call"]) == (
        UNPERMUTE_BACKWARD, "backward", "moe.experts", 0)
    assert r["classification"] == "device"
    assert c["input_dtypes"] == ["float32", "float32", "float32"]      # probs in float32
    assert "npu_train.py" in json.dumps(c["node"])        # the forward line that made it
    check = r["op_check"]        # the same inputs on the CPU, through the registered kernel
    assert check["status"] == "mismatch" and check["how"] == "registered"
    assert r["replay"]["fidelity"] == "bit-exact" and r["reference"] == "cpu"


def test_the_kernel_remedy_is_verified_on_the_device(moe_report):
    """The step on npu:0 with only that op on the CPU's kernel is finite; computing it in float64
    on the device does not help (the kernel's path is wrong, not its precision)."""
    r, _ = moe_report
    by = {(x["kind"], x["detail"].get("scope")): x for x in r["remedies"]}
    assert by[("kernel", None)]["outcome"] == "finite"
    assert by[("kernel", None)]["detail"]["device"] == "cpu"
    assert by[("precision", "op")]["outcome"] == "still-failing"


def test_the_repro_reproduces_on_the_device_and_not_on_the_cpu(moe_report, npu_env):
    _, out = moe_report
    repro = out / "repro" / "repro.py"
    on = {}
    for device in ("npu:0", "npu:1", "cpu"):
        p = subprocess.run([sys.executable, str(repro), "--device", device], cwd=out.parent,
                           env=npu_env, capture_output=True, text=True, timeout=120)
        on[device] = (p.returncode, p.stdout)
    assert on["npu:0"][0] == 1 and "REPRODUCED" in on["npu:0"][1], on
    assert on["npu:1"][0] == 1, on
    assert on["cpu"][0] == 0 and "reference implementation" in on["cpu"][1], on


def test_a_second_card_as_the_reference_shares_the_bug(moe, tmp_path, npu_env):
    """npu:1 runs the same kernel: the reference fails too, so the model's numerics, not this
    card, are what the evidence points at."""
    r = run(moe, "--target", "npu:0", "--reference", "npu:1", "--no-remedies", "--out",
            tmp_path / "r", env=npu_env)
    assert r["reference"] == "npu:1" and r["culprit"]["op"] == UNPERMUTE_BACKWARD
    assert r["classification"] == "numerics"


def test_replayed_on_the_cpu_only_the_hardware_change_is_reported(moe, tmp_path, npu_env):
    r = run(moe, "--target", "cpu", "--no-remedies", "--out", tmp_path / "r", env=npu_env,
            code=3)
    assert r["verdict"] == "not-reproduced"
    assert r["replay"]["hardware"] == "changed"
    assert any("npu:0" in h and "Emulated NPU" in h for h in r["replay"]["hardware_changed"])
    assert any(UNPERMUTE_BACKWARD in n and "reference implementation" in n for n in r["notes"])


def test_inspect_and_pack_name_the_hardware(moe, tmp_path, npu_env):
    res = cli("inspect", moe, env=npu_env, fresh=True)
    assert res.code == 0 and "on npu:0" in res.stdout and "npu Emulated NPU" in res.stdout, \
        res.stdout + res.stderr
    ticket = tmp_path / "t.tar.gz"
    res = cli("run", moe, "--no-remedies", env=npu_env, fresh=True)
    assert res.code == 1, res.stderr
    res = cli("pack", moe, "-o", ticket, env=npu_env, fresh=True)
    assert res.code == 0, res.stderr
    import tarfile

    with tarfile.open(ticket) as tar:
        env = json.load(tar.extractfile("environment.json"))
        manifest = json.load(tar.extractfile("bundle/manifest.json"))
    assert env["hardware"]["npu"]["torch_npu"] == "0.0+emulated"
    assert manifest["environment"]["hardware"]["npu"]["devices"]


def test_steps_finds_the_silent_divergence_on_the_device(gelu, tmp_path, npu_env):
    m = json.loads((ROOT / gelu / "manifest.json").read_text())
    assert m["observed"]["first"] == "spike" and m["devices"]["captured_on"] == "npu:0"
    r = run(gelu, "--steps", "8", "--reference", "cpu", "--no-remedies", "--out",
            tmp_path / "r", env=npu_env)
    s = r["steps"]
    rows = {row["step"]: row for row in s["replayed"]}
    first = s["first_divergent_step"]
    # the device's steps differ from the CPU's from the first one replayed, by a rounding that
    # compounds until a step parts beyond the float32 tolerance, before the spike
    assert first is not None and min(rows) <= first < m["step"], s
    assert all(0 < rows[k]["max_rel_diff"] for k in rows if k <= first), s
    assert rows[first]["parted"] and not any(rows[k]["parted"] for k in rows if k < first), s
    assert s["reached_recorded"]["bit_exact"] is True   # and the replay is the captured run
    c = r["culprit"]
    assert (c["op"], c["phase"], c["step"]) == (FAST_GELU, "forward", first)
    assert r["classification"] == "device"
    assert r["op_check"]["status"] == "mismatch"


def test_the_same_window_on_a_second_card_does_not_part(gelu, tmp_path, npu_env):
    """Against npu:1 (the same kernels) nothing parts: the divergence is the device's, and
    the reference really ran on the second card."""
    r = run(gelu, "--steps", "8", "--target", "npu:0", "--reference", "npu:1",
            "--no-remedies", "--out", tmp_path / "r", env=npu_env, code=0)
    assert r["steps"]["first_divergent_step"] is None
    assert all(row["max_rel_diff"] == 0 for row in r["steps"]["replayed"][:-1])


def test_selftest_passes_on_the_device(npu_env):
    res = cli("selftest", "--device", "npu", env=npu_env, fresh=True)
    assert res.code == 0, res.stdout + res.stderr
    assert res.stdout.count("ok ") == 3, res.stdout


GUARD_SYNCS = r"""
import json, sys, tempfile
sys.path.insert(0, "tests/npu/tasks")
import torch, torch_npu, nanbisect
import npu_train as t
task = t.gelu()
guard = nanbisect.Guard(task, entry="tests/npu/tasks/npu_train.py:gelu", out=tempfile.mkdtemp(),
                        snapshot_every=1000)
per_step = []
for i in range(12):
    b = t.batch(i, 8)
    s0 = torch.npu.synchronizations()
    guard.step(b)
    per_step.append(torch.npu.synchronizations() - s0)
plain = []
for i in range(3):
    b = t.batch(i, 8)
    s0 = torch.npu.synchronizations()
    task.optimizer.zero_grad(); task.loss_fn(task.model, b).backward(); task.optimizer.step()
    plain.append(torch.npu.synchronizations() - s0)
print(json.dumps({"guard": per_step, "plain": plain}))
"""


def test_the_guard_waits_for_the_device_once_per_step(npu_env):
    """A plain step never waits for the device; under the Guard each step waits once (its one
    reading), but for the step that takes the snapshot (its copies to pinned host memory are
    asynchronous, settled by one synchronisation)."""
    p = subprocess.run([sys.executable, "-c", GUARD_SYNCS], cwd=ROOT, env=npu_env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["plain"] == [0, 0, 0]
    assert got["guard"][0] <= 2 and all(n == 1 for n in got["guard"][1:]), got
