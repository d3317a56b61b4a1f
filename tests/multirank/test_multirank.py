"""Multi-rank capture and replay with real processes: 2 ranks, gloo, CPU."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from helpers.bundles import captured
from helpers import TEST_TASKS, cli, run_json

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

TRAIN = TEST_TASKS / "ddp_train.py"


def ranks_capture(func: str, out: Path, ranks: int = 2) -> Path:
    """Train ``func``'s task under Guard on ``ranks`` ranks; return (a private copy of) the bundle
    they wrote, captured once per test session (tests/helpers/bundles.py)."""
    return captured(TRAIN, func, out, ranks)


def failing_replay(bundle: Path, env: dict) -> tuple:
    """Run a replay that must fail: exit 2, no traceback, no report, no rank process left, and
    nothing left in its (private) TMPDIR. Returns the result and its wall time."""
    tmp = bundle.parent / "tmp"
    tmp.mkdir(exist_ok=True)
    t0 = time.monotonic()
    res = cli("run", "--ckpt", bundle, env={"TMPDIR": str(tmp), **env}, timeout=200)
    took = time.monotonic() - t0
    assert res.code == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert rankworkers(bundle) == []       # the launcher waited for them to be gone
    assert not (bundle / "nanbisect-report").exists()
    assert [p.name for p in tmp.iterdir()
            if p.name.startswith(("nanbisect-ranks-", "torchelastic_"))] == []
    return res, took


def rankworkers(bundle: Path) -> list[str]:
    """Rank workers still replaying ``bundle`` (not those of another test session's replay)."""
    key, out = str(Path(bundle).resolve()), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "nanbisect.multirank.worker" in cmd and key in cmd:
                out.append(cmd)
    return out


def test_comm_hook_corrupting_reduced_grads_is_communication(tmp_path):
    bundle = ranks_capture("comm_corrupt", tmp_path / "g")
    top = json.loads((bundle / "manifest.json").read_text())
    assert (top["kind"], top["world_size"], top["backend"]) == ("multi-rank", 2, "gloo")
    assert sorted(top["ranks"]) == ["0", "1"]
    assert (bundle / "rank0" / "model.safetensors").is_file()
    assert (bundle / "rank1" / "batch.safetensors").is_file()
    rep = run_json(bundle)
    assert (rep["verdict"], rep["phase"], rep["classification"]) == (
        "culprit", "grad-reduce", "communication")
    assert rep["culprit"]["phase"] == "grad-reduce"
    assert [(r["reduction_in_bad"], r["reduction_out_bad"]) for r in rep["ranks"]] == [
        (False, True), (False, True)]


@pytest.fixture(scope="module")
def rank1_nan(tmp_path_factory) -> Path:
    """ddp_train.py's rank1_nan: rank 1's forward takes sqrt of a negative number."""
    return ranks_capture("rank1_nan", tmp_path_factory.mktemp("rank1_nan") / "g")


def test_rank_that_computes_nan_locally_is_named(rank1_nan):
    bundle = rank1_nan
    top = json.loads((bundle / "manifest.json").read_text())
    assert top["ranks"]["1"]["observed"]["first"] == "loss"       # rank 1 failed alone...
    assert top["ranks"]["0"]["observed"]["summary"]["loss"] == "finite"   # ...rank 0 wrote too
    rep = run_json(bundle)
    c = rep["culprit"]
    assert (c["rank"], c["phase"], c["op"], c["module"], c["module_call"]) == (
        1, "forward", "aten.sqrt.default", "module", 0)
    r0, r1 = rep["ranks"]
    assert (r0["reduction_in_bad"], r0["reduction_out_bad"]) == (False, True)  # received it
    assert r1["reduction_in_bad"] is True                                    # sent it
    # the same module call on the other rank: clean in, clean out -> computed on rank 1
    assert r0["module_stats"]["output"]["nan"] == 0 and r1["module_stats"]["output"]["nan"] > 0
    # the path rank 0 received it by: DDP's all-reduce, from rank 1 (not a generic "reduction")
    assert (r0["how"], r0["via"]["op"], r0["via"]["phase"], r0["from_ranks"]) == (
        "received", "c10d.allreduce_.default", "grad-reduce", [1])
    assert r1["how"] == "computed"
    assert any("rank 0 received it through c10d.allreduce_.default in DDP bucket 0's comm hook, "
               "in grad-reduce, from rank 1" in n for n in rep["notes"])
    assert rep["repro_result"]["reproduced"] is True


def test_entry_override_runs_on_every_rank(rank1_nan, tmp_path):
    # the same model with the sqrt fixed, from another file, named relative to the working
    # directory: the failure the bundle's own entry reproduces (the test above) does not come back
    marks = tmp_path / "marks"
    marks.mkdir()
    rep = run_json(rank1_nan, "--entry", "tests/tasks/mr_fixed.py:rank1_nan_fixed",
                   "--out", tmp_path / "rep", env={"MR_MARK_DIR": str(marks)}, code=3)
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]   # both ranks built it
    assert (rep["verdict"], rep["classification"], rep["culprit"]) == (
        "not-reproduced", "code-changed", None)
    assert [r["loss"] != "nan" for r in rep["ranks"]] == [True, True]
    changed = rep["replay"]["code_changed"]
    assert changed[0].startswith(f"--entry {TEST_TASKS / 'mr_fixed.py'}:rank1_nan_fixed "
                                 "(captured: ")


def test_entry_override_that_does_not_exist_fails_before_any_rank_starts(rank1_nan, tmp_path):
    t0 = time.monotonic()
    res = cli("run", "--ckpt", rank1_nan, "--entry", "no_such_file.py:task",
              "--out", tmp_path / "rep")
    assert res.code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--entry file 'no_such_file.py' not found" in res.stderr
    assert rankworkers(rank1_nan) == [] and time.monotonic() - t0 < 60
    assert not (tmp_path / "rep").exists()


def test_nan_in_one_ranks_batch_is_input_nonfinite_naming_the_rank(tmp_path):
    bundle = ranks_capture("rank1_nan_batch", tmp_path / "g")
    rep = run_json(bundle)
    assert (rep["verdict"], rep["classification"], rep["phase"], rep["culprit"]) == (
        "input-nonfinite", "data", "input", None)
    assert rep["input_nonfinite"] == [
        {"where": "batch", "name": "rank 1: batch", "nan": 1, "posinf": 0, "neginf": 0}]
    md = (bundle / "nanbisect-report" / "report.md").read_text()
    assert "before the step ran: batch 'rank 1: batch'" in md


def test_rank_crash_during_replay_is_named_and_leaves_no_process(tmp_path):
    bundle = ranks_capture("crash_on_replay", tmp_path / "g")
    # the crash is told by the rank's exit status, long before the rank time-out (generous: a
    # busy machine takes a minute to start and replay two ranks)
    res, took = failing_replay(bundle, {"CRASH_ON_REPLAY": "1", "NANBISECT_RANK_TIMEOUT": "400"})
    assert "rank 1 failed during replay" in res.stderr
    assert took < 300


def test_tensor_parallel_nan_computed_on_one_rank_is_told_from_received(tmp_path):
    # The row-parallel layer all-reduces inside its forward: on both ranks the same module call
    # has clean inputs and a NaN output; only rank 1 computed the NaN (sqrt of its shard).
    bundle = ranks_capture("tp_rank1_nan", tmp_path / "g")
    top = json.loads((bundle / "manifest.json").read_text())
    assert top["process_groups"] == {"world": [0, 1], "tp": [0, 1]}   # the layout, named
    shown = cli("inspect", bundle)
    assert shown.code == 0 and "groups    world: [0-1]; tp: [0-1]" in shown.stdout
    rep = run_json(bundle)
    c = rep["culprit"]
    assert (rep["verdict"], rep["phase"]) == ("culprit", "forward")
    assert (c["rank"], c["op"], c["module"], c["module_call"]) == (
        1, "aten.sqrt.default", "row", 0)
    r0, r1 = rep["ranks"]
    for r in (r0, r1):   # module level alone cannot tell them apart...
        assert r["module_stats"]["inputs"]["nan"] == 0 and r["module_stats"]["output"]["nan"] > 0
    # ...op level can: rank 0's NaN first appears at the all-reduce's output
    assert (r0["root"]["op"], r0["root"]["module"], r0["root"]["collective"]) == (
        "c10d.allreduce_.default", "row", True)
    assert r1["root"]["collective"] is False
    assert any("rank 0 received it through c10d.allreduce_.default in row call 0" in n
               for n in rep["notes"])
    assert rep["repro_result"]["reproduced"] is True


def test_collective_that_returns_nan_from_finite_inputs_is_communication(tmp_path):
    bundle = ranks_capture("tp_healthy", tmp_path / "g")
    run_json(bundle, code=0)                    # healthy as captured
    inject = f"{TEST_TASKS / 'corrupt_allreduce.py'}:corrupt_allreduce"
    rep = run_json(bundle, "--inject", inject, "--out", tmp_path / "rep")
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "culprit", "communication", "forward")
    assert (rep["culprit"]["op"], rep["culprit"]["module"]) == ("c10d.allreduce_.default", "row")
    assert all(r["root"]["collective"] for r in rep["ranks"])


def test_fsdp2_backward_nan_on_one_rank_is_told_from_the_reduce_scatter(tmp_path):
    # FSDP2 (fully_shard): parameters and AdamW state are DTensor shards, the bundle holds each
    # rank's shard; rank 1's gate backward computes NaN, the reduce-scatter hands it to rank 0
    bundle = ranks_capture("fsdp_rank1_backward_nan", tmp_path / "g")
    top = json.loads((bundle / "manifest.json").read_text())
    assert top["ranks"]["1"]["observed"]["summary"]["grads"] == "nan"
    rep = run_json(bundle)
    c = rep["culprit"]
    assert (rep["phase"], c["rank"], c["op"], c["module"], c["module_call"]) == (
        "backward", 1, "aten.sqrt.default", "gate", 0)
    r0, r1 = rep["ranks"]
    assert (r0["root"]["op"], r0["root"]["collective"]) == ("c10d._reduce_scatter_base_.default",
                                                            True)
    assert any("rank 0 received it through c10d._reduce_scatter_base_" in n
               for n in rep["notes"])
    assert rep["repro_result"]["reproduced"] is True


def test_fsdp2_reduce_scatter_returning_nan_is_communication(tmp_path):
    bundle = ranks_capture("fsdp_healthy", tmp_path / "g")
    run_json(bundle, code=0)                    # the shards restore and replay healthy
    inject = f"{TEST_TASKS / 'corrupt_allreduce.py'}:corrupt_reduce_scatter"
    rep = run_json(bundle, "--inject", inject, "--out", tmp_path / "rep")
    assert (rep["verdict"], rep["classification"], rep["phase"]) == (
        "culprit", "communication", "grad-reduce")
    assert rep["culprit"]["op"] == "c10d._reduce_scatter_base_.default"


def test_rank_taking_a_different_control_path_ends_within_the_timeout(tmp_path):
    # rank 1 skips a collective that rank 0 waits in: a hang without the watchdog
    bundle = ranks_capture("tp_healthy", tmp_path / "g")
    t0 = time.monotonic()
    run_json(bundle, "--out", tmp_path / "healthy", code=0)
    # long enough for both ranks to reach their collectives however loaded the machine is
    timeout = max(20, math.ceil(2.5 * (time.monotonic() - t0)))
    res, took = failing_replay(bundle, {"DIVERGE_ON_REPLAY": "1",
                                        "NANBISECT_RANK_TIMEOUT": str(timeout)})
    assert f"no rank finished within {timeout}s: rank 0 waited in a collective at " in res.stderr
    assert "rank 1 waited in a collective at " in res.stderr and "control path" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert took < timeout + 60


@pytest.mark.parametrize("func", ["ddp_adam_eps0", "fsdp_adam_eps0"])
def test_a_fault_born_in_the_update_is_rebuilt_on_every_rank(func, tmp_path):
    """Issue 40: Adam with eps=0 makes NaN in step 0's update (finite loss and gradients); the
    Guard, which copies no parameter, sees it at step 1's reading on every rank, and every rank
    rebuilds step 0's pre-state from its snapshot together (DDP's all-reduces, FSDP2's
    all-gathers and reduce-scatters run again): the bundle is step 0's, bit-exact, and its replay
    finds the NaN in the optimizer."""
    bundle = ranks_capture(func, tmp_path / "g")
    top = json.loads((bundle / "manifest.json").read_text())
    assert bundle.name == "step000000"
    for r in ("0", "1"):
        obs = top["ranks"][r]["observed"]
        assert obs["step"] == 0 and obs["summary"]["loss"] == "finite", obs
        assert obs["rebuild"] == {"from_step": 0, "steps": 0, "fidelity": "bit-exact",
                                  "max_rel_diff": 0.0, "first_mismatch": None}, obs
        assert obs["summary"]["params"] == "nan"
        assert [n.rsplit(".", 1)[-1] for n in obs["nonfinite_params"]["nan"]] == ["dead"]
    rep = run_json(bundle)
    assert (rep["verdict"], rep["phase"]) == ("culprit", "optimizer")
    assert any("pre-state from the snapshot of step 0" in n for n in rep["notes"]), \
        rep["notes"]


def test_a_snapshot_one_rank_cannot_write_is_given_up_by_every_rank(tmp_path):
    """Rank 1's temporary directory is unusable: the ranks agree that no snapshot was taken
    (else rank 0 would rebuild while rank 1 does not, and their collectives part); both bundle
    step 1 as it began and say why."""
    bundle = ranks_capture("ddp_adam_eps0_rank1_nosnap", tmp_path / "g")
    top = json.loads((bundle / "manifest.json").read_text())
    assert bundle.name == "step000001"
    whys = {r: top["ranks"][r]["observed"]["rebuild"] for r in ("0", "1")}
    assert all(rb["fidelity"] == "unavailable" for rb in whys.values()), whys
    assert "another rank could not write its snapshot" in whys["0"]["why"], whys
    assert "NotADirectoryError" in whys["1"]["why"], whys
