"""NaN only when compiled (issue 26): the `compiler` classification on the CPU inductor backend.

Faults are planted the way a compiler bug looks (tests/tasks/compiled_faults.py): a custom op
whose eager kernel is right and whose decomposition in inductor's table is not; a compiled
model whose NaN eager makes too. One capture and one run of the first are shared by the tests
that read its report (the bisection runs once); that run is the CLI's, forked from the suite's
fork server (torch imported once), whose children the bisection and the repro are forked from
too; the second fault runs in-process.

The third fault, a precision difference that ``emulate_precision_casts`` removes, is the dearest
test here: the bisector reaches that config change only after compiling the forward with
inductor once per earlier inductor subsystem (pre-grad, joint-graph, post-grad passes,
fallback_random); see docs/BENCHMARKS.md for what it costs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import nanbisect
from helpers import TEST_TASKS, cli
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.util.compiled import compile_args, is_compiled

pytestmark = pytest.mark.xdist_group("compiler")

CXX = next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)),
           None)
needs_cxx = pytest.mark.skipif(
    CXX is None, reason="no C++ compiler: the CPU inductor backend compiles C++ kernels "
    "(scripts/setup.sh installs g++ where it may)")


def _capture(make, batch, out: Path, entry: str) -> Path:
    """Guard one compiled step of ``make()`` on ``batch``; the bundle it writes."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):    # no pool of compile workers to start
        guard = nanbisect.Guard(make(), entry=entry, out=out)
        with pytest.raises(nanbisect.NonFiniteStep) as e:
            guard.step(batch)
    return Path(e.value.bundle)


@pytest.fixture(scope="module")
def decomp(tmp_path_factory):
    """The softmax whose decomposition drops the max: captured compiled, run through the CLI."""
    import compiled_faults as cf

    tmp = tmp_path_factory.mktemp("compiler")
    bundle = _capture(cf.task, cf.batch(), tmp / "bundles",
                      f"{TEST_TASKS / 'compiled_faults.py'}:task")
    res = cli("run", bundle, "--out", tmp / "report", "--no-remedies", timeout=600)
    return bundle, res, tmp / "report"


@pytest.mark.slow
@needs_cxx
def test_compiled_only_nan_is_compiler_with_the_decomposition_named(decomp):
    _, res, out = decomp
    assert res.code == 1, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert (r["verdict"], r["classification"]) == ("culprit", "compiler")
    k = r["compiler"]
    assert (k["eager"], k["compiled"]) == ("finite", "nan")
    assert (k["backend"], k["subsystem"]) == ("aot_eager_decomp_partition", "decomposition")
    assert isinstance(k["bisect_number"], int) and "nbtest.softmax" in k["detail"]
    c = r["culprit"]
    assert (c["op"], c["module"], c["module_call"], c["phase"]) == (
        "nbtest.softmax.default", "block", 0, "forward")
    assert r["timings"]["compiler-bisect"] > 0 and r["timings"]["compiled"] > 0
    assert "only when compiled" in res.stdout and "transient" not in res.stdout, res.stdout
    assert "## Compiler" in (out / "report.md").read_text()
    assert "<th>compiler</th>" in (out / "report.html").read_text()


@pytest.mark.slow
@needs_cxx
def test_compiler_repro_compiles_the_module_call_and_fails(decomp):
    out = decomp[2]
    r = json.loads((out / "report.json").read_text())
    assert r["repro"] == "repro/module_repro.py"
    assert r["repro_result"]["reproduced"] is True, r["repro_result"]
    assert "compiled, not eagerly" in r["repro_result"]["output"]
    text = (out / "repro" / "module_repro.py").read_text()
    imports = text.split('"""', 2)[2].split("def main")[0]   # torch, safetensors, the entry
    assert "'backend': 'aot_eager_decomp_partition'" in text
    # never nanbisect itself (the entry's path may hold the word: a clone named nanbisect)
    assert not re.search(r"^\s*(import|from)\s+nanbisect\b", imports, flags=re.M), imports


@pytest.mark.slow
@needs_cxx
def test_bundle_records_the_compile_and_eager_names(decomp):
    bundle = decomp[0]
    m = json.loads((bundle / "manifest.json").read_text())
    assert m["task"]["compiled"] == {"backend": "inductor", "mode": None, "options": None}
    assert m["model"]["params"] == ["proj.weight", "proj.bias", "head.weight", "head.bias"]


@pytest.mark.slow
@needs_cxx
def test_bisection_state_does_not_leak(decomp):
    """The bisector's files lived in the child's private TMPDIR, now gone; nothing in torch's
    cache directory or in this process's bisector says a bisection is on."""
    import tempfile

    from torch._inductor.compiler_bisector import CompilerBisector
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    def left_behind(d: Path) -> bool:     # by a run that has ended (another suite's may be live)
        try:
            os.kill(int(d.name.split("-")[2]), 0)
        except (ValueError, IndexError, ProcessLookupError):
            return True
        except PermissionError:
            return False
        return False

    assert not [d for d in Path(tempfile.gettempdir()).glob("nanbisect-compiler-*")
                if left_behind(d)]
    assert not Path(cache_dir(), "bisect").exists()
    assert CompilerBisector.get_backend() is None and not CompilerBisector.bisection_enabled


@pytest.mark.slow
@needs_cxx
def test_precision_difference_is_the_config_change_that_removes_it(tmp_path):
    """bfloat16 ``sqrt(x*x - t)``, ``t`` the square as eager rounds it: finite eagerly, NaN where
    inductor keeps the square in float32; the bisector names ``emulate_precision_casts``."""
    import compiled_faults as cf

    bundle = _capture(cf.task_precision, cf.batch_precision(), tmp_path / "b",
                      f"{TEST_TASKS / 'compiled_faults.py'}:task_precision")
    res = cli("run", bundle, "--out", tmp_path / "r", "--no-remedies", "--json", timeout=600)
    assert res.code == 1, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert (r["verdict"], r["classification"]) == ("culprit", "compiler")
    k = r["compiler"]
    assert (k["eager"], k["compiled"], r["phase"]) == ("finite", "nan", "forward"), k
    assert (k["backend"], k["subsystem"]) == ("inductor", "inductor_emulate_precision_casts")
    assert k["config_change"] == "inductor.emulate_precision_casts=True", k
    assert k["bisect_number"] is None and k["seconds"] > 0
    assert r["culprit"]["op"] is None and r["repro"] is None     # a config change names no op
    print("\ntimings:", r["timings"], "bisection:", k["seconds"])
    assert "emulate_precision_casts" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.slow
@needs_cxx
def test_nan_eager_makes_too_is_a_normal_culprit(tmp_path):
    import compiled_faults as cf

    bundle = _capture(cf.task_eager_too, cf.batch(outlier=False), tmp_path / "b",
                      f"{TEST_TASKS / 'compiled_faults.py'}:task_eager_too")
    report = run_bundle(bundle, RunOptions(run_repro=False, reference="none", remedies=0),
                        tmp_path / "r")
    assert report.verdict == "culprit" and report.classification != "compiler"
    assert report.compiler is None
    assert (report.culprit.op, report.culprit.module) == ("aten.sqrt.default", "block")
    assert report.timings["compiled"] > 0        # it was replayed compiled too, and failed


@pytest.mark.slow
def test_nan_only_eager_keeps_the_eager_culprit_and_says_so(tmp_path):
    """The opposite: eager NaN, compiled finite (a declared compile, no C++ needed)."""
    import compiled_faults as cf

    entry = f"{TEST_TASKS / 'compiled_faults.py'}:task_eager_only"
    nanbisect.capture(cf.task_eager_only(), cf.batch(), tmp_path / "b", entry=entry)
    report = run_bundle(tmp_path / "b", RunOptions(run_repro=False, reference="none",
                                                   remedies=0), tmp_path / "r")
    assert report.verdict == "culprit" and report.classification != "compiler"
    assert (report.culprit.op, report.culprit.module) == ("nbtest.softmax_eager.default", "block")
    assert any("compiled (aot_eager_decomp_partition)" in n and "stays finite" in n
               for n in report.notes), report.notes


@pytest.mark.slow
def test_compile_arguments_are_read_from_the_compiled_model():
    m = torch.nn.Linear(2, 2)
    c = torch.compile(m, mode="max-autotune-no-cudagraphs")
    assert is_compiled(c) and not is_compiled(m)
    assert compile_args(c) == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs",
                               "options": None}
    assert compile_args(torch.compile(m, backend="aot_eager"))["backend"] == "aot_eager"
    task = nanbisect.Task(model=c, optimizer=None, loss_fn=lambda mod, b: mod(b).sum())
    assert task.model is m and task.step_model() is c        # names are the eager module's
    assert task.describe()["compiled"]["mode"] == "max-autotune-no-cudagraphs"


def test_declared_compile_is_checked():
    with pytest.raises(ValueError, match="compiled="):
        nanbisect.Task(model=torch.nn.Linear(2, 2), optimizer=None,
                       loss_fn=lambda m, b: m(b).sum(), compiled="inductor")


def test_a_bundle_cannot_choose_what_a_compiled_replay_runs(tmp_path):
    """task.compiled is data: options that could name a program, odd backends, are refused."""
    from nanbisect.bundle.schema import check_section
    from nanbisect.errors import BadInput

    shape = {"accumulate": 1, "clip_grad_norm": None, "grad_scaler": False,
             "loss_normalized": False, "autocast": None}
    check_section(tmp_path, "task", {**shape, "compiled": {
        "backend": "inductor", "mode": None, "options": {"emulate_precision_casts": True}}})
    for bad in ({"backend": "inductor", "options": {"cpp.cxx": "/bin/sh"}},
                {"backend": "../../x"}, {"backend": "inductor", "mode": "fast; rm"}, "inductor"):
        with pytest.raises(BadInput, match="compiled"):
            check_section(tmp_path, "task", {**shape, "compiled": bad})
