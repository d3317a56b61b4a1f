"""``task.compiled.options`` (issue 39, item 6): a bundle records, and a replay applies, only the
inductor options that change numerics or code generation (`nanbisect.util.compiled.REPLAYED`),
each with its type and range. A manifest holding any other (a debug trace that writes into the
working directory, a remote cache, a test-only sleep, an unknown name, a value of the wrong type
or out of range) is refused by ``inspect`` and ``run`` alike: one line naming the option, exit 2.
A Task the user built with such options trains with them; its bundle records the others and
names the dropped ones. A compiled replay's debug output never lands in the working directory.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import nanbisect
from helpers import FIXTURES, TEST_TASKS, cli, invoke, one_line_exit_2
from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.util.compiled import REPLAYED, captured_args, compile_args

pytestmark = pytest.mark.xdist_group("compiler")

ENTRY = f"{Path(__file__).resolve()}:make_task"

# option -> (value, what the one-line refusal must also say)
HOSTILE = {
    "trace.enabled": (True, "not an option nanbisect replays"),             # torch_compile_debug/
    "fx_graph_remote_cache": (True, "not an option nanbisect replays"),     # a remote cache
    "sleep_sec_TESTING_ONLY": (40, "not an option nanbisect replays"),      # 40 s per compile
    "no_such_option": (1, "not an option nanbisect replays"),
    "emulate_precision_casts": ("yes", "not true or false"),
    "cpp.simdlen": (3, "not null or one of 0, 1, 128, 256, 512"),
    "cpp.threads": (10 ** 30, "not an integer from -1 to 1024"),
    "max_fusion_size": (True, "not an integer from 1 to 1024"),
}


def make_task(options: dict | None = None) -> nanbisect.Task:
    """A linear model whose loss takes the log of its outputs (NaN for the negative ones), compiled
    with ``aot_eager`` (no C++ compiler needed) and declared with inductor ``options``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).log().mean(),
                          compiled={"backend": "aot_eager", "options": options})


def make_task_dropping() -> nanbisect.Task:
    return make_task({"trace.enabled": True, "fallback_random": True, "cpp.cxx": "g++"})


def with_options(dst: Path, options: dict) -> Path:
    """A copy of a shipped bundle whose manifest says it was compiled with ``options``."""
    shutil.copytree(FIXTURES / "nan_batch", dst, ignore=shutil.ignore_patterns("nanbisect-report"))
    m = json.loads((dst / "manifest.json").read_text())
    m["task"]["compiled"] = {"backend": "inductor", "mode": None, "options": options}
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_every_replayed_option_is_inductor_s_with_its_type():
    """Each name exists in this torch's inductor config; its default is a value the allowlist
    takes; bool options are bool there; every torch.compile mode's options are replayed ones."""
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options

    config = inductor_config.get_config_copy()
    for name, want in REPLAYED.items():
        assert name in config, name
        default = config[name]
        if want is bool:
            assert inductor_config.get_type(name) is bool and type(default) is bool, name
        else:
            assert default is None or type(default) is int, name
            assert default in want, (name, default)
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        assert set(list_mode_options(mode)) <= set(REPLAYED), mode


def test_shipped_bundles_pass_the_allowlist():
    for manifest in sorted(FIXTURES.glob("*/manifest.json")):
        read_bundle(manifest.parent, verify=False)        # none refused


def test_inspect_and_run_refuse_an_option_not_replayed(tmp_path):
    """The manifest check `inspect` and `run` share, in this process, for every hostile option:
    one line naming it, exit 2; an option replayed, with a value it takes, is accepted."""
    for i, (name, (value, why)) in enumerate(HOSTILE.items()):
        b = with_options(tmp_path / f"b{i}", {"emulate_precision_casts": True, name: value})
        with pytest.raises(BadInput, match="task.compiled.options") as e:
            read_bundle(b)
        assert "\n" not in str(e.value) and repr(name)[:50] in str(e.value), str(e.value)
        for command in ("inspect", "run"):
            line = one_line_exit_2(invoke(command, b, *(["--out", tmp_path / f"r{i}"]
                                                        if command == "run" else [])),
                                   repr(name), why)
            assert len(line) < 600, line
        assert not (tmp_path / f"r{i}").exists()
    good = with_options(tmp_path / "good", {"emulate_precision_casts": True, "cpp.simdlen": None,
                                            "cpp.threads": 1, "triton.max_tiles": 2})
    res = invoke("inspect", good)
    assert res.code == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_the_cli_refuses_them_in_a_process_of_its_own(tmp_path):
    """``python -m nanbisect inspect B`` and ``run B``: exit 2 at once (no 40 s sleep, no
    debug folder in the working directory)."""
    b = with_options(tmp_path / "b", {"trace.enabled": True, "sleep_sec_TESTING_ONLY": 40})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    t0 = time.monotonic()
    one_line_exit_2(cli("inspect", b, cwd=cwd), "'trace.enabled'", "not an option nanbisect "
                    "replays")
    one_line_exit_2(cli("run", b, "--out", tmp_path / "r", cwd=cwd), "'trace.enabled'")
    assert time.monotonic() - t0 < 40
    assert not list(cwd.iterdir()) and not (tmp_path / "r").exists()


def test_a_user_s_task_trains_with_every_option_and_records_those_replayed():
    """Task(compiled=...) and torch.compile(options=...): the step runs with all the options
    the user gave (never refused); the bundle's record keeps the replayed ones and names the
    rest."""
    task = make_task_dropping()
    shape = task.describe()
    assert shape["compiled"] == {"backend": "aot_eager", "mode": None,
                                 "options": {"fallback_random": True}}
    assert shape["compiled_dropped"] == ["trace.enabled", "cpp.cxx"]
    m = nn.Linear(2, 2)
    c = torch.compile(m, options={"trace.enabled": True, "emulate_precision_casts": True,
                                  "cpp.simdlen": 3})
    task = nanbisect.Task(model=c, optimizer=None, loss_fn=lambda mod, b: mod(b).sum())
    assert task.step_model() is c                           # the user's compile, untouched
    assert captured_args(c)["options"]["trace.enabled"] is True
    assert task.describe()["compiled"]["options"] == {"emulate_precision_casts": True}
    assert task.describe()["compiled_dropped"] == ["trace.enabled", "cpp.simdlen"]
    assert compile_args(c)["options"] == {"emulate_precision_casts": True}
    assert "compiled_dropped" not in make_task().describe()


@pytest.mark.slow
def test_dropped_options_are_named_in_the_bundle_and_the_report(tmp_path):
    batch = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    bundle = nanbisect.capture(make_task_dropping(), batch, tmp_path / "b",
                               entry=f"{Path(__file__).resolve()}:make_task_dropping")
    m = json.loads((Path(bundle) / "manifest.json").read_text())
    assert m["task"]["compiled"]["options"] == {"fallback_random": True}
    assert m["task"]["compiled_dropped"] == ["trace.enabled", "cpp.cxx"]
    assert invoke("inspect", bundle).code == 0
    report = run_bundle(bundle, RunOptions(run_repro=False, reference="none", remedies=0),
                        tmp_path / "r")
    assert report.timings["compiled"] > 0
    assert any("does not replay ('trace.enabled', 'cpp.cxx')" in n for n in report.notes), \
        report.notes


CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


needs_cxx = pytest.mark.skipif(CXX is None, reason="the CPU inductor backend compiles C++")


@pytest.fixture(scope="module")
def eager_too(tmp_path_factory) -> Path:
    """A bundle of a model under torch.compile (inductor) whose NaN eager makes too: `run`
    replays it compiled once, and bisects nothing."""
    import compiled_faults as cf
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        guard = nanbisect.Guard(cf.task_eager_too(), out=tmp_path_factory.mktemp("b") / "b",
                                entry=f"{TEST_TASKS / 'compiled_faults.py'}:task_eager_too")
        with pytest.raises(nanbisect.NonFiniteStep) as e:
            guard.step(cf.batch(outlier=False))
    return Path(e.value.bundle)


@pytest.mark.slow
@needs_cxx
def test_a_compiled_replay_writes_no_debug_output_in_the_working_directory(eager_too, tmp_path,
                                                                          monkeypatch):
    """With inductor's trace on, torch writes ``torch_compile_debug/`` under the directory it
    was imported in; a replay's goes to a private directory, removed after."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(cwd)
    # where torch, imported in ``cwd``, puts it; and this test's own temporary directory
    monkeypatch.setattr(dynamo_config, "debug_dir_root", str(cwd / "torch_compile_debug"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # NB: a kernel found in inductor's cache writes no trace: compiled afresh
    with inductor_config.patch({"trace.enabled": True, "compile_threads": 1,
                                "fx_graph_cache": False}):
        report = run_bundle(eager_too, RunOptions(run_repro=False, reference="none",
                                                  remedies=0), tmp_path / "r")
    assert report.timings["compiled"] > 0 and report.verdict == "culprit"
    assert not list(cwd.iterdir())
    assert not list(tmp.glob("nanbisect-inductor-*"))


@pytest.mark.slow
@needs_cxx
def test_torch_compile_debug_in_the_environment_writes_nothing_in_the_working_directory(
        eager_too, tmp_path):
    """``TORCH_COMPILE_DEBUG=1 python -m nanbisect run B``: the compiled replay's inductor trace
    and the structured trace torch starts at import (``tlparse/``) both go to the private
    directory; the report is written as ever. A fresh interpreter: torch imported there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    res = cli("run", eager_too, "--out", tmp_path / "r", "--no-remedies", "--json", cwd=cwd,
              env={"TORCH_COMPILE_DEBUG": "1"}, timeout=600, fresh=True)
    assert res.code == 1, res.stdout[-2000:] + res.stderr[-2000:]
    r = json.loads(res.stdout)
    assert r["verdict"] == "culprit" and r["timings"]["compiled"] > 0
    assert not list(cwd.iterdir())
