"""Guard(history=N) and Guard(spike=...): the last steps' health in every bundle, what it points
out in the report, and a loss spike captured while training goes on (tests/tasks/drift.py)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import drift
import nanbisect
from helpers import cli, run_json

ENTRY = "tests/tasks/drift.py:task"


def _manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def test_lr_jump_shows_in_history_at_its_step(tmp_path):
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b")
    e = drift.train(guard, drift.batches(200), schedule=drift.lr_jump)
    assert e is not None and e.observed["step"] > drift.LR_JUMP_AT
    h = _manifest(e.bundle)["history"]
    entries = {x["step"]: x for x in h["entries"]}
    assert h["entries"][-1]["step"] == e.observed["step"]          # the failing step last
    assert entries[drift.LR_JUMP_AT - 1]["lr"] == drift.LR
    assert entries[drift.LR_JUMP_AT]["lr"] == 100 * drift.LR
    assert entries[drift.LR_JUMP_AT - 1]["loss"] < 1.0 and entries[drift.LR_JUMP_AT]["grad_norm"] > 0
    r = run_json(e.bundle, "--out", tmp_path / "r")
    assert [x["step"] for x in r["history"]] == [x["step"] for x in h["entries"]]
    kinds = {f["kind"]: f for f in r["history_findings"]}
    assert kinds["lr-jump"]["step"] == drift.LR_JUMP_AT and kinds["lr-jump"]["ratio"] == 100
    assert drift.LR_JUMP_AT <= kinds["loss-jump"]["step"] <= e.observed["step"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"learning rate jumped x100 at step {drift.LR_JUMP_AT}" in md


def test_history_is_bounded_and_holds_per_parameter_norms(tmp_path):
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b", history=5)
    e = drift.train(guard, drift.batches(200), schedule=drift.lr_jump)
    h = _manifest(e.bundle)["history"]
    steps = [x["step"] for x in h["entries"]]
    assert steps == list(range(e.observed["step"] - 4, e.observed["step"] + 1))
    norms = load_file(str(e.bundle / "history.safetensors"))["history/norms"]
    assert tuple(norms.shape) == (5, 2, 4) and h["parameters"][0] == "fc1.weight"
    # the last row is the failing step's: its update was left out (a forward failure), so its
    # parameters are as they entered it, the previous step's "after"; its gradients not finite
    assert e.observed["first"] == "loss" and norms[:, 0].isfinite().all()
    assert torch.equal(norms[-1, 0], norms[-2, 0]) and not norms[-1, 1].isfinite().all()


def test_history_off(tmp_path):
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b", history=0)
    e = drift.train(guard, drift.batches(200), schedule=drift.lr_jump)
    assert "history" not in _manifest(e.bundle)
    assert not (e.bundle / "history.safetensors").exists()


def _spiky(i):
    b = drift.batch(i)
    if i == 25:
        b["y"] = b["y"] * 4.0     # one bad batch: the loss jumps, the next steps recover
    return b


def test_spike_is_captured_without_stopping_the_loop(tmp_path):
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b", spike=8.0,
                            lookback=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(60):
            guard.step(_spiky(i))                # never raises: training goes on
    assert guard.step_index == 60
    # writing the spike swapped the pre-step state in and back out: training went on unchanged
    twin = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "twin")
    for i in range(60):
        twin.step(_spiky(i))
    for a, b in zip(guard.task.model.parameters(), twin.task.model.parameters()):
        assert torch.equal(a, b)
    assert len(guard.spikes) == 1 and guard.spikes[0].name == "step000025-spike"
    assert any("loss spike at step 25" in str(w.message) for w in seen)
    m = _manifest(guard.spikes[0])
    assert m["observed"]["first"] == "spike" and m["step"] == 25
    assert m["history"]["entries"][-1]["step"] == 25 and m["lookback"]["steps"][-1]["step"] == 25
    # the bundle holds the spike step's pre-state: its replay gives the spike's loss bit for bit
    r = run_json(guard.spikes[0], "--reference", "cpu", "--out", tmp_path / "r", code=0)
    assert r["verdict"] == "clean" and r["replay"]["bit_exact"] is True
    assert r["replay"]["target_loss"] == m["observed"]["loss"]
    assert any(f["kind"] == "loss-jump" and f["step"] == 25 for f in r["history_findings"])


def test_bad_history_and_spike_arguments(tmp_path):
    for kwargs, words in (({"history": -1}, "history=-1"), ({"spike": 0}, "spike=0"),
                          ({"spike": 5.0, "history": 0}, "needs the history"),
                          ({"lookback": 0}, None), ({"lookback": 4, "lookback_on": "disk"},
                                                    "lookback_on")):
        if kwargs.get("lookback") == 0:
            nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path, **kwargs)   # off
            continue
        with pytest.raises(nanbisect.BadInput, match=words):
            nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path, **kwargs)


def test_hostile_history_is_a_one_line_error(tmp_path):
    guard = nanbisect.Guard(drift.task(), entry=ENTRY, out=tmp_path / "b")
    e = drift.train(guard, drift.batches(200), schedule=drift.lr_jump)
    m = _manifest(e.bundle)
    m["history"]["entries"][2]["loss"] = {"__tensor__": "x"}
    (e.bundle / "manifest.json").write_text(json.dumps(m))
    res = cli("run", e.bundle, "--out", tmp_path / "r")
    assert res.code == 2 and "history" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()
