"""Guard(lookback=K) and `nanbisect run --steps K`: the steps before the failure replayed on target
and reference, the first step where they part found and bisected (tests/tasks/drift.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import drift
import nanbisect
from helpers import cli, run_json

ENTRY = "tests/tasks/drift.py:task"
WIDE_FROM = 40     # the first step whose batch shape hits the faulty kernel


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """A run on a 'device' whose mm is wrong for one shape from step 40 on (drift.shape_bug
    around every step), guarded with lookback=16: the loss overflows steps later."""
    out = tmp_path_factory.mktemp("faulty")
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=out, lookback=16)
    e = drift.train(guard, drift.batches(200, wide_from=WIDE_FROM), fault=drift.shape_bug)
    assert e is not None, "the planted fault must make the run fail"
    return e


def private(bundle, tmp_path):
    dst = tmp_path / bundle.name
    shutil.copytree(bundle, dst)
    return dst


def test_lookback_bundle_holds_the_steps_since_a_snapshot(faulty_run):
    m = json.loads((faulty_run.bundle / "manifest.json").read_text())
    lb, failing = m["lookback"], m["step"]
    assert failing > WIDE_FROM + 3, "the NaN comes many steps after the fault starts"
    steps = [s["step"] for s in lb["steps"]]
    assert steps[-1] == failing and steps == list(range(lb["start_step"], failing + 1))
    assert 16 <= len(steps) <= 32          # at least K, at most 2K
    assert "lookback.safetensors" in m["files"]


def test_steps_finds_the_first_divergent_step_not_the_overflow(faulty_run, tmp_path):
    bundle = private(faulty_run.bundle, tmp_path)
    failing = faulty_run.observed["step"]
    r = run_json(bundle, "--steps", "16", "--reference", "cpu",
                 "--inject", "tests/tasks/drift.py:shape_bug", "--out", tmp_path / "r")
    s = r["steps"]
    assert s["first_divergent_step"] == WIDE_FROM
    replayed = [row["step"] for row in s["replayed"]]
    assert replayed == list(range(failing - 15, failing + 1))      # the last 16, oldest first
    before = [row for row in s["replayed"] if row["step"] < WIDE_FROM]
    assert before and all(not row["parted"] and row["max_rel_diff"] == 0 for row in before)
    assert s["reached_recorded"]["bit_exact"] is True               # the replay is the real run
    assert all(row["target_loss"] == row["original_loss"] for row in s["replayed"][:-1])
    c = r["culprit"]
    assert (c["op"], c["module"], c["phase"], c["step"]) == ("aten.mm.default", "fc1",
                                                              "backward", WIDE_FROM)
    assert r["classification"] == "device" and r["op_check"]["status"] == "mismatch"
    assert [12] in [sh[:1] for sh in c["input_shapes"]] or any(12 in sh for sh in
                                                               c["input_shapes"])


def test_one_step_alone_names_only_the_overflow(faulty_run, tmp_path):
    """The same bundle without --steps: the failing step's own first bad op, which is true but
    not the cause (it overflows on the reference too)."""
    bundle = private(faulty_run.bundle, tmp_path)
    r = run_json(bundle, "--reference", "cpu", "--inject", "tests/tasks/drift.py:shape_bug",
                 "--out", tmp_path / "r")
    assert "steps" not in r and "step" not in r["culprit"]
    assert r["classification"] == "numerics"
    kinds = {f["kind"]: f for f in r["history_findings"]}
    assert kinds["grad-norm-jump"]["step"] == WIDE_FROM     # the history points at the start
    extreme = {f["parameter"] for f in r["history_findings"] if f["kind"] == "param-extreme"}
    assert "fc1.weight" in extreme


@pytest.mark.slow
def test_steps_refuses_what_it_cannot_replay(faulty_run, tmp_path):
    bundle = private(faulty_run.bundle, tmp_path)
    n = len(json.loads((bundle / "manifest.json").read_text())["lookback"]["steps"])
    res = cli("run", bundle, "--steps", str(n + 1), "--reference", "cpu")
    assert res.code == 2 and f"recorded {n} step(s)" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("run", bundle, "--steps", "4")               # target cpu: no reference by default
    assert res.code == 2 and "--reference" in res.stderr
    plain = tmp_path / "plain"
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=plain)     # no lookback
    e = drift.train(guard, drift.batches(200, wide_from=WIDE_FROM), fault=drift.shape_bug)
    res = cli("run", e.bundle, "--steps", "4", "--reference", "cpu")
    assert res.code == 2 and "lookback" in res.stderr
    # a hostile edit: steps that are not consecutive
    m = json.loads((bundle / "manifest.json").read_text())
    m["lookback"]["steps"][3]["step"] += 7
    (bundle / "manifest.json").write_text(json.dumps(m))
    res = cli("run", bundle, "--steps", "4", "--reference", "cpu", "--out", tmp_path / "h")
    assert res.code == 2 and "consecutive" in res.stderr and not (tmp_path / "h").exists()


def _jump(opt, step):
    if step == 25:
        for g in opt.param_groups:
            g["lr"] = 1e30      # Adam moves each weight by about lr: the output overflows


@pytest.mark.parametrize("kept_on", ["device", "cpu"])
def test_adam_with_a_schedule_replays_bit_for_bit(tmp_path, kept_on):
    """Adam's moments, the scheduler's learning rate per step and dropout-free steps: the window
    replayed from the snapshot reaches the recorded pre-state exactly; both sides fail alike (a
    numerics failure), so nothing parts."""
    guard = nanbisect.Guard(drift.adam_task(), entry="tests/tasks/drift.py:adam_task",
                            out=tmp_path / "b", lookback=8, lookback_on=kept_on)
    e = drift.train(guard, drift.batches(200), schedule=_jump)
    assert e is not None
    r = run_json(e.bundle, "--steps", "8", "--reference", "cpu", "--out", tmp_path / "r")
    assert r["steps"]["reached_recorded"]["bit_exact"] is True
    assert r["steps"]["first_divergent_step"] is None
    assert r["classification"] != "device"
    lrs = {h["step"]: h["lr"] for h in r["history"]}
    assert lrs[24] == 1e-2 and lrs[25] == 1e30
    assert {"lr-jump": 25} == {f["kind"]: f["step"] for f in r["history_findings"]
                               if f["kind"] == "lr-jump"}


def test_a_loop_that_edits_weights_between_steps_is_a_replay_mismatch(tmp_path):
    """What the loop does outside the Task (here a decay of fc2's weights after each step) is not
    in the bundle: the window does not reach the recorded pre-state, and the verdict says so
    instead of blaming the device."""
    def decay(model):
        with torch.no_grad():
            model.fc2.weight.mul_(0.999)

    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b", lookback=16)
    e = drift.train(guard, drift.batches(200, wide_from=WIDE_FROM), fault=drift.shape_bug,
                    between=decay)
    assert e is not None
    r = run_json(e.bundle, "--steps", "16", "--reference", "cpu",
                 "--inject", "tests/tasks/drift.py:shape_bug", "--out", tmp_path / "r")
    assert r["steps"]["reached_recorded"]["bit_exact"] is False
    assert r["classification"] == "replay-mismatch"
    assert any("does not reach the recorded pre-state" in n for n in r["notes"])
