"""Verdicts that are earned: a replay that is not the captured step says so (code-changed,
replay-mismatch), never transient or device; device only from the same inputs at the same dtype;
what the report says about sources, parameters and magnitudes is true. Real bundles from Guard,
replayed through the CLI in a subprocess."""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import loops
from helpers import ROOT, TEST_TASKS, run_json

from nanbisect import Guard, NonFiniteStep
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.task import import_target

FLAKY = '''
import torch
import torch.nn as nn
import nanbisect
from helper import shift                     # a user module next to the entry


class Act(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - shift())          # NaN below shift()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = Act()

    def forward(self, x):
        return self.act(self.fc(x)).sum()


def task():
    torch.manual_seed(0)
    m = Net()
    return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, b: m(b))
'''


def guarded_job(tmp_path, monkeypatch):
    """The task in tmp_path/src (entry job.py + helper module), imported, under a Guard."""
    monkeypatch.delitem(sys.modules, "helper", raising=False)   # this test's helper, not another's
    src = tmp_path / "src"
    src.mkdir()
    (src / "job.py").write_text(FLAKY)
    (src / "helper.py").write_text("def shift():\n    return 5.0\n")
    mod = import_target(str(src / "job.py"))
    return src, Guard(mod.task(), entry=f"{src / 'job.py'}:task", out=tmp_path / "out")


def guard_failure(tmp_path, fix_by_editing: str, monkeypatch):
    """Capture a forward NaN from the task in tmp_path; then edit one of its files."""
    src, guard = guarded_job(tmp_path, monkeypatch)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(torch.ones(2, 4))
    if fix_by_editing == "entry":
        (src / "job.py").write_text(FLAKY.replace("x - shift()", "(x - shift()).abs()"))
    elif fix_by_editing == "helper":
        (src / "helper.py").write_text("def shift():\n    return -5.0\n")
    return e.value.bundle, src


@pytest.mark.parametrize("edited", ["entry", "helper"])
def test_an_edit_that_fixes_the_bug_is_code_changed_not_transient(tmp_path, edited,
                                                                 monkeypatch):
    bundle, src = guard_failure(tmp_path, edited, monkeypatch)
    m = json.loads((bundle / "manifest.json").read_text())
    assert str(src / "helper.py") in m["code"]["sources"]     # imported user module, hashed
    # by default the bundle's own copy of the code runs (the failure comes back); --code local
    # runs the edited files, as a user checking a fix does
    assert run_json(bundle, "--no-remedies", "--out", tmp_path / "stored")["verdict"] == "culprit"
    rep = run_json(bundle, "--code", "local", code=3)
    name = "job.py" if edited == "entry" else "helper.py"
    assert (rep["verdict"], rep["classification"]) == ("not-reproduced", "code-changed")
    assert [f.rsplit("/", 1)[1] for f in rep["replay"]["code_changed"]] == [name]
    assert any(name in n for n in rep["notes"]) and rep["replay"]["faithful"] is False


def test_a_moved_checkout_is_compared_file_by_file(tmp_path, monkeypatch):
    bundle, src = guard_failure(tmp_path, "nothing", monkeypatch)
    moved = src.rename(tmp_path / "elsewhere")                 # the whole checkout moved
    rep = run_json(bundle, "--entry", f"{moved / 'job.py'}:task")
    assert rep["verdict"] == "culprit" and rep["culprit"]["module"] == "act"
    assert (rep["replay"]["code_changed"], rep["replay"]["code_missing"]) == ([], [])
    assert rep["replay"]["faithful"] is None            # a NaN loss cannot be compared


@pytest.mark.slow
def test_an_entry_override_with_other_code_is_code_changed(tmp_path, monkeypatch):
    """``--entry`` naming a fixed copy elsewhere: the replay ran other code, not a transient."""
    bundle, src = guard_failure(tmp_path, "nothing", monkeypatch)
    fixed = tmp_path / "fixed"
    shutil.copytree(src, fixed)
    (fixed / "job.py").write_text(FLAKY.replace("x - shift()", "(x - shift()).abs()"))
    rep = run_json(bundle, "--entry", f"{fixed / 'job.py'}:task", code=3)
    assert (rep["verdict"], rep["classification"]) == ("not-reproduced", "code-changed")
    assert rep["replay"]["code_changed"][0].startswith(f"--entry {fixed / 'job.py'}:task")


def test_unchanged_code_that_does_not_fail_again_is_transient(tmp_path, monkeypatch):
    monkeypatch.setenv("NANBISECT_TEST_FLAKY", "1")
    import transient

    guard = Guard(transient.task(), entry=f"{transient.__file__}:task", out=tmp_path / "g")
    with pytest.raises(NonFiniteStep) as e:
        guard.step(transient.batch())
    # the env flag is gone in the replay; its intra-op threads are the capture's (a replay given
    # fewer, OMP_NUM_THREADS inherited from this worker, is not the captured step bit for bit)
    rep = run_json(e.value.bundle, code=3,
                   env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert (rep["classification"], rep["replay"]["code_changed"]) == ("transient", [])


def test_a_loop_the_task_does_not_describe_is_replay_mismatch(tmp_path):
    """The loop doubles the loss before backward; the Task's loss_fn does not. The backward NaN
    still shows, but the replay is not the captured step: never device, never transient."""
    task = loops.scaled()
    task.grad_scaler = None
    guard = Guard(task, entry=f"{TEST_TASKS / 'loops.py'}:scaled", out=tmp_path)
    b = loops.pos_batch(0)
    with pytest.raises(NonFiniteStep) as e:
        with guard.watch(b) as w:
            task.optimizer.zero_grad()
            w.loss = 2.0 * task.loss_fn(task.model, b)        # not what the Task says
            w.loss.backward()
            task.optimizer.step()
    for reference in ("none", "cpu", "cpu:float64"):
        rep = run_json(e.value.bundle, "--reference", reference, "--out", tmp_path / reference)
        assert rep["classification"] == "replay-mismatch", (reference, rep["notes"])
        assert rep["replay"]["bit_exact"] is False and rep["replay"]["faithful"] is False
        assert any("does not describe" in n for n in rep["notes"])


# ------------------------------------------------------------------------------------------
# device only from the same inputs at the same dtype


def test_float32_underflow_with_a_float64_reference_is_numerics(tmp_path):
    task = loops.underflow()
    guard = Guard(task, entry=f"{TEST_TASKS / 'loops.py'}:underflow", out=tmp_path)
    with pytest.raises(NonFiniteStep) as e:
        for s in range(3):
            guard.step(loops.batch(s))
    rep = run_json(e.value.bundle, "--reference", "cpu:float64")
    c = rep["culprit"]
    assert (c["op"], c["module"], rep["replay"]["reference_loss"] is not None) == (
        "aten.div.Tensor", "norm", True)
    assert rep["classification"] == "numerics", rep["notes"]
    assert rep["op_check"]["status"] == "ok"      # float32 on the reference: the same 0/0
    assert any("wider dtype" in n for n in rep["notes"])


@pytest.mark.slow
def test_injected_kernel_fault_with_a_float64_reference_is_device(fixture_bundle):
    npu = f"{ROOT / 'fixtures' / 'inject' / 'npu_kernels.py'}:npu"
    rep = run_json(fixture_bundle("moe_unpermute_on_npu"), "--inject", npu,
                   "--reference", "cpu:float64")
    assert (rep["classification"], rep["op_check"]["status"]) == ("device", "mismatch")


def test_an_overflow_to_the_same_inf_on_both_sides_is_not_a_mismatch():
    from nanbisect.reference.opcheck import check_op

    x = [torch.tensor([100.0, 1.0])]                     # exp(100) overflows float32
    check = check_op("aten.exp.default", 0, x, {}, [torch.exp(x[0])], torch.device("cpu"))
    assert check.status == "ok", check.comparisons[0].message()


# ------------------------------------------------------------------------------------------
# what the report says


def test_optimizer_culprit_source_is_the_optimizers_code(fixture_bundle):
    rep = run_json(fixture_bundle("optimizer_adam_eps0"))
    src = rep["culprit"]["source"]
    assert "torch/optim/" in src and src.endswith(tuple(f":{i}" for i in range(1, 10000)))
    assert "typer" not in src and "nanbisect" not in src


def test_builtin_backward_op_source_is_the_forward_line(tmp_path):
    task = loops.scaled()
    task.grad_scaler = None
    guard = Guard(task, entry=f"{TEST_TASKS / 'loops.py'}:scaled", out=tmp_path)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(loops.pos_batch(0))
    rep = run_json(e.value.bundle)          # through the CLI: typer's frames are on the stack
    text = (TEST_TASKS / "loops.py").read_text().splitlines()
    want = next(i for i, t in enumerate(text, 1) if "BUG: d sqrt" in t)
    assert rep["culprit"]["phase"] == "backward"
    assert rep["culprit"]["source"].endswith(f"loops.py:{want}"), rep["culprit"]["source"]


def test_absmax_of_a_masked_output_is_its_largest_finite_magnitude():
    """A masked score row holds -inf and finite values; its largest finite magnitude here is
    that of a negative value (min and max alone would say 1)."""
    from nanbisect.replay.recorder import OpRecorder

    scores = torch.tensor([[-5.0, 1.0, 0.5]])
    mask = torch.tensor([[False, False, True]])
    with OpRecorder(None, {"forward"}) as rec:
        scores.masked_fill(mask, float("-inf"))
    table, _ = rec.read()
    (out,) = table.ops[-1].outputs
    assert (out.flags.neginf, out.flags.nan, out.flags.absmax) == (True, False, 5.0)


def test_long_lists_of_bad_parameters_are_counted(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(30)])
    from nanbisect import Task

    task = Task(model, torch.optim.SGD(model.parameters(), lr=float("nan")),
                lambda m, b: m(b).sum())
    guard = Guard(task, entry=f"{TEST_TASKS / 'loops.py'}:scaled", out=tmp_path)
    with pytest.raises(NonFiniteStep) as e:
        guard.step(torch.ones(1, 2))
        guard.close()      # the update made them NaN: read here
    bad = e.value.observed["nonfinite_params"]
    assert len(bad["nan"]) == 20 and bad["nan_count"] == 60
    shutil.rmtree(e.value.bundle)


def test_a_file_edited_while_training_ran_is_code_changed(tmp_path, monkeypatch):
    """The process runs the code it imported; a fix saved to disk during training is not what
    failed. The bundle keeps the hashes read when the Guard started."""
    src, guard = guarded_job(tmp_path, monkeypatch)
    (src / "helper.py").write_text("def shift():\n    return -5.0\n")     # the fix, on disk
    with pytest.raises(NonFiniteStep) as e:
        guard.step(torch.ones(2, 4))                                      # old code runs
    rep = run_json(e.value.bundle, code=3)
    assert rep["classification"] == "code-changed"
    assert [f.rsplit("/", 1)[1] for f in rep["replay"]["code_changed"]] == ["helper.py"]


def test_other_versions_make_a_not_reproduced_failure_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("NANBISECT_TEST_FLAKY", "1")
    import transient

    guard = Guard(transient.task(), entry=f"{transient.__file__}:task", out=tmp_path / "g")
    with pytest.raises(NonFiniteStep) as e:
        guard.step(transient.batch())
    m = json.loads((e.value.bundle / "manifest.json").read_text())
    m["environment"]["torch"] = "2.1.0"
    (e.value.bundle / "manifest.json").write_text(json.dumps(m))
    rep = run_json(e.value.bundle, code=3)
    assert rep["classification"] == "unknown"
    assert rep["replay"]["environment_changed"][0].startswith("torch 2.1.0 at capture")


def test_fail_fast_accepts_what_python_could_bind(tmp_path):
    from nanbisect.errors import BadInput
    from nanbisect.guard import resolve_entry_file

    (tmp_path / "star.py").write_text("from os.path import *\n")
    (tmp_path / "nested.py").write_text("try:\n    def task():\n        pass\nexcept Exception:\n"
                                        "    pass\n")
    (tmp_path / "none.py").write_text("def other():\n    pass\n")
    assert resolve_entry_file(f"{tmp_path / 'star.py'}:task")
    assert resolve_entry_file(f"{tmp_path / 'nested.py'}:task")
    with pytest.raises(BadInput, match="defines no 'task'"):
        resolve_entry_file(f"{tmp_path / 'none.py'}:task")
    with pytest.raises(BadInput, match="does not exist"):
        resolve_entry_file(f"{tmp_path / 'missing.py'}:task")


# ------------------------------------------------------------------------------------------
# bundles that travel: the fingerprint, the fidelity tiers, the verdicts on other machines


def edited(src, dst, off: float = 0.0, hardware="keep", captured_on: str | None = None):
    """A copy of bundle ``src`` whose manifest says what another machine would have written:
    the recorded loss a relative ``off`` away (at least one float32 ulp), another (or no,
    None) fingerprint, another capture device. The manifest is plain JSON; the sha256s it
    lists are the tensor files', untouched."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
    m = json.loads((dst / "manifest.json").read_text())
    loss = m["observed"]["loss"]
    if off and isinstance(loss, float):
        moved = torch.tensor(loss * (1 + off), dtype=torch.float32)
        if moved.item() == loss:
            moved = torch.nextafter(moved, torch.tensor(math.inf))
        m["observed"]["loss"] = moved.item()
    if hardware is None:
        del m["environment"]["hardware"]              # a bundle of an older nanbisect
    elif hardware != "keep":
        m["environment"]["hardware"] = hardware
    if captured_on is not None:
        m["devices"] = {"captured_on": captured_on, "accelerators": [captured_on.split(":")[0]]}
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def replay(bundle, target: str | None = None):
    return run_bundle(bundle, RunOptions(target=target, run_repro=False),
                      bundle / "nanbisect-report")


XEON = {"cpu": {"machine": "x86_64", "processor": "Intel(R) Xeon(R) Platinum 8480+",
                "vendor": "GenuineIntel", "capability": "AVX512"}}


@pytest.mark.parametrize("hardware, off, tier, classification, says", [
    # the capture machine: bit for bit, and a last-bit difference there is a mismatch
    ("keep", 0.0, "bit-exact", "unknown", None),
    ("keep", 1e-8, "mismatch", "replay-mismatch", "on the same hardware and software"),
    # another CPU: a last-bit difference within tolerance is expected (the same bits there:
    # tests/bundle/test_pack.py's round trip)
    (XEON, 3e-7, "within-tolerance", "unknown", "cpu processor: Intel(R) Xeon(R) Platinum"),
    # ... but not a loss far off: the Task does not describe the loop (the note says which)
    (XEON, 5e-3, "mismatch", "replay-mismatch", "beyond the float32 step tolerance 0.001"),
    # a bundle without a fingerprint: hardware unknown, last bits never a mismatch
    (None, 3e-7, "within-tolerance", "unknown", "no fingerprint"),
])
def test_fidelity_tiers(travel_bundle, tmp_path, hardware, off, tier, classification, says):
    from nanbisect.report.page import to_html
    from nanbisect.report.prose import terminal, to_markdown

    if hardware is XEON and _here_cpu().get("processor") == XEON["cpu"]["processor"]:
        pytest.skip("this machine is the other CPU of the test")
    r = replay(edited(travel_bundle, tmp_path / "b", off, hardware))
    replay_json = r.to_json()["replay"]
    assert (r.verdict, r.culprit.phase, r.culprit.parameter) == ("culprit", "optimizer", "idle")
    assert (replay_json["fidelity"], r.classification) == (tier, classification), r.notes
    assert replay_json["bit_exact"] is (off == 0)
    assert replay_json["hardware"] == ("unknown" if hardware is None else
                                       "same" if hardware == "keep" else "changed")
    if says:
        assert any(says in n for n in r.notes), r.notes
    if tier != "bit-exact" or hardware not in (None, "keep"):   # said where people read
        for text in (terminal(r, tmp_path), to_markdown(r), to_html(r)):
            assert f"replay: {tier}" in text or f"<th>replay</th><td colspan=\"2\">{tier}" in text


def test_hardware_changes_compare_what_both_fingerprints_know_of_the_replays_device():
    from nanbisect.replay.fidelity import hardware_changes

    then = {"cuda": {"devices": ["NVIDIA A100", "NVIDIA H100"], "capability": [[8, 0], [9, 0]],
                     "driver": "550.54.15", "cudnn": 90100},
            "cpu": {"processor": "Intel Xeon"}}
    now = {"cuda": {"devices": ["NVIDIA H100"], "capability": [[9, 0]], "driver": "560.28.03"},
           "cpu": {"processor": "AMD EPYC"}}
    # the capture's cuda:1 against this cuda:0; cuDNN unknown here: not compared, not guessed
    assert hardware_changes(then, now, "cuda:1", torch.device("cuda:0")) == [
        "cuda driver: 550.54.15 at capture, 560.28.03 now"]
    assert hardware_changes(then, now, "cuda:0", torch.device("cuda:0"))[:2] == [
        "cuda devices: NVIDIA A100 at capture, NVIDIA H100 now",
        "cuda capability: [8, 0] at capture, [9, 0] now"]
    assert hardware_changes(then, now, "cpu", torch.device("cpu")) == [
        "cpu processor: Intel Xeon at capture, AMD EPYC now"]
    assert hardware_changes({}, now, "npu:0", torch.device("cpu")) == [
        "captured on npu:0 (no fingerprint), replayed on cpu (AMD EPYC)"]


def _here_cpu() -> dict:
    from nanbisect import devices

    return devices.fingerprint()["cpu"]


def _another_capability(here: str) -> str | None:
    """An ATen instruction set other than ``here`` that this CPU runs, as ATEN_CPU_CAPABILITY
    spells it: ``default`` (every CPU), or ``avx2`` when the suite itself runs forced to DEFAULT
    on an x86 CPU with AVX2; None when there is none."""
    if here != "DEFAULT":
        return "default"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return "avx2" if re.search(r"^flags\s*:.*\bavx2\b", flags, re.M) else None


@pytest.mark.slow
def test_another_instruction_set_is_within_tolerance_not_a_mismatch(travel_bundle, tmp_path):
    """ATen's CPU kernels forced to another instruction set (as on another CPU) between capture
    and replay: the loss differs in its last bits (on every CPU: travel's `_lanes_sum` adds as
    the instruction set's kernels would); the verdict stands, the difference named."""
    here = torch.backends.cpu.get_cpu_capability()
    other = _another_capability(here)
    if other is None:
        pytest.skip(f"this CPU runs no ATen instruction set but {here}: nothing to switch")
    bundle = edited(travel_bundle, tmp_path / "b")
    rep = run_json(bundle, env={"ATEN_CPU_CAPABILITY": other})    # a fresh interpreter
    r = rep["replay"]
    assert (r["bit_exact"], r["fidelity"], r["hardware_changed"]) == (
        False, "within-tolerance", [f"cpu capability: {here} at capture, {other.upper()} now"]), r
    assert 0 < r["loss_rel_diff"] <= r["tolerance"]
    assert (rep["verdict"], rep["classification"], rep["culprit"]["op"],
            rep["culprit"]["parameter"]) == ("culprit", "unknown", "aten.addcdiv_.default",
                                             "idle")
    assert any("within tolerance, not bit for bit" in n for n in rep["notes"])


def test_a_cuda_capture_replays_on_the_cpu_and_says_so(travel_bundle, tmp_path):
    gpu = {"cpu": XEON["cpu"], "cuda": {"devices": ["NVIDIA H100 80GB HBM3"],
                                        "capability": [[9, 0]], "cuda": "12.4",
                                        "driver": "550.54.15"}}
    bundle = edited(travel_bundle, tmp_path / "b", 3e-7, gpu, captured_on="cuda:0")
    r = replay(bundle, "cpu")          # what the default target falls back to without CUDA
    assert (r.verdict, r.culprit.phase, r.culprit.parameter) == ("culprit", "optimizer", "idle")
    f = r.facts.fidelity
    assert f.hardware_changed == [
        "captured on cuda:0 (NVIDIA H100 80GB HBM3, [9, 0]), replayed on cpu ("
        + ", ".join(x for x in (_here_cpu().get("processor"),
                                _here_cpu().get("capability")) if x) + ")"]
    assert (f.tier, r.classification) == ("within-tolerance", "unknown"), r.notes
    assert any("captured on cuda:0" in n for n in r.notes)


def test_a_failure_that_does_not_come_back_on_another_cpu_is_unknown(tmp_path, monkeypatch):
    """transient needs the capture machine: elsewhere the fault may be that machine's."""
    monkeypatch.setenv("NANBISECT_TEST_FLAKY", "1")
    import transient

    guard = Guard(transient.task(), entry=f"{transient.__file__}:task", out=tmp_path / "g")
    with pytest.raises(NonFiniteStep) as e:
        guard.step(transient.batch())
    monkeypatch.delenv("NANBISECT_TEST_FLAKY")
    if _here_cpu().get("processor") == XEON["cpu"]["processor"]:
        pytest.skip("this machine is the other CPU of the test")
    r = replay(edited(e.value.bundle, tmp_path / "b", hardware=XEON))
    assert (r.verdict, r.classification) == ("not-reproduced", "unknown")
    assert "transient needs the capture machine" in r.notes[0], r.notes
    assert "cpu processor: Intel(R) Xeon(R) Platinum 8480+" in r.notes[0]
