"""The import gate (`nanbisect.util.toplevel`, `nanbisect.task.gate`): a replay reads an entry
file's top level before importing it and refuses one that does more than define, in one line
naming the line and the fix, unless the run opts in (``--run-top-level``,
``Task(run_top_level=True)``); ``sys.argv`` is the entry file alone while it is imported."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nanbisect
from helpers import ROOT, TEST_TASKS, cli, one_line_exit_2
from nanbisect.bundle.format import read_bundle
from nanbisect.errors import BadInput
from nanbisect.replay.replayer import Replayer
from nanbisect.task import check_entry, load_task
from nanbisect.util.toplevel import first_refused

ALLOWED = {
    "docstring and imports": '''\
        """The docstring."""
        from __future__ import annotations
        import os, sys
        import torch.nn as nn
        from typing import TYPE_CHECKING
        ''',
    "imports under try/except ImportError": """\
        try:
            import apex
            HAVE_APEX = True
        except (ImportError, ModuleNotFoundError):
            apex = None
            HAVE_APEX = False
        try:
            import flash_attn
        except ImportError:
            raise SystemExit("install flash_attn")
        """,
    "decorated def and class": """\
        import functools, torch
        @functools.lru_cache(maxsize=None)
        def f(x=torch.zeros(1)):
            open("x").write("never at import")
        @torch.library.custom_op("mylib::op", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.clone()
        class M(torch.nn.Module):
            pass
        """,
    "__main__ and TYPE_CHECKING blocks": """\
        import typing, argparse
        if __name__ == "__main__":
            args = argparse.ArgumentParser().parse_args()
            for i in range(3):
                main()
        if "__main__" == __name__:
            open("x", "w")
        if typing.TYPE_CHECKING:
            import wandb
        """,
    "calls of this file's definitions": """\
        import torch
        def define_unpermute():
            return torch.library.custom_op("m::u", mutates_args=())(lambda x: x)
        @torch.library.custom_op("m::p", mutates_args=())
        def unpermute(x: torch.Tensor) -> torch.Tensor:
            return x
        unpermute.register_autograd(lambda ctx, g: g)
        model = Model()
        register()
        class Model(torch.nn.Module):
            pass
        def register():
            pass
        """,
    "registration functions of this file, read one level deep": """\
        import torch
        def _define():
            try:
                return torch.ops.nbdev.fused_gelu
            except (AttributeError, RuntimeError):
                pass
            @torch.library.custom_op("nbdev::fused_gelu", mutates_args=())
            def fused_gelu(x: torch.Tensor) -> torch.Tensor:
                open("never at import")
            fused_gelu.register_autograd(lambda ctx, g: g, setup_context=None)
            return torch.ops.nbdev.fused_gelu
        FUSED_GELU = _define()
        def _define_lib() -> None:
            if hasattr(torch.ops.nbtest, "softmax"):
                return
            lib = torch.library.Library("nbtest", "DEF")
            lib.define("softmax(Tensor x) -> Tensor")
            torch.library.register_fake("nbtest::softmax", lambda x: x, lib=lib)
            _define_lib.lib = lib
        _define_lib()
        """,
    "an ordinary script's settings and seeds": """\
        import logging, os, random
        import numpy as np
        import torch
        import transformers
        import lightning as L
        import pytorch_lightning as pl
        from lightning import seed_everything
        from transformers.utils import check_min_version
        from transformers.utils.versions import require_version
        try:
            import apex
            HAVE_APEX = True
        except Exception:
            apex = None
        try:
            import flash_attn
        except:
            pass
        check_min_version("4.40.0")
        require_version("datasets>=2.0", "pip install datasets")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        DEVICE = torch.device(device)
        N_GPUS = torch.cuda.device_count()
        MPS = torch.backends.mps.is_available() and torch.backends.cudnn.is_available()
        logging.basicConfig(level=logging.INFO)
        logger = logging.getLogger(__name__)
        logger.setLevel(logging.INFO)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.update({"OMP_NUM_THREADS": "1"})
        torch.set_float32_matmul_precision("high")
        torch.set_default_dtype(torch.float32)
        torch.use_deterministic_algorithms(True)
        random.seed(0); np.random.seed(0); transformers.set_seed(0)
        L.seed_everything(0); pl.seed_everything(0); seed_everything(0)
        MASK = torch.tensor([1.0, 0.0]) + torch.zeros(2) + torch.ones(2)
        STEPS = torch.arange(4); FILL = torch.full((2,), 3.0)
        """,
    "the allow-list": """\
        import contextvars, logging, os, re, sys, torch, warnings
        from collections import namedtuple
        from dataclasses import field
        from functools import partial
        from pathlib import Path
        import nanbisect
        HERE = Path(__file__).resolve().parent
        ROOT = HERE.parents[1] / "data"
        sys.path.insert(0, str(HERE.joinpath("lib").absolute()))
        sys.path.append(os.path.dirname(os.path.abspath(__file__)))
        DEVICE = torch.device(os.environ.get("DEVICE", "cpu"))
        N = int(os.getenv("N", "3")); SIZES = sorted([max(1, N), min(2, N), abs(-1), len("ab")])
        CONFIG = dict(dim=8); CONFIG.update(dict(heads=2))
        torch.manual_seed(0)
        torch.ops.load_library(str(HERE / "ops.so"))
        lib = torch.library.Library("mylib", "DEF")
        lib.define("op(Tensor x) -> Tensor")
        VAR = contextvars.ContextVar("v", default=None)
        LOG = logging.getLogger(__name__)
        Point = namedtuple("Point", "x y")
        WORD = re.compile(r"\\w+")
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.simplefilter("default")
        f = partial(print, end="")
        nanbisect.reference_impl("mylib::op")(lambda x: x)
        print("defining")
        assert N > 0
        if sys.version_info >= (3, 10):
            NEW = True
        else:
            NEW = False
        act = lambda x: open(x)
        """,
}

# (source, the line refused, a word of what it does)
REFUSED = {
    "argparse": ("import argparse\nparser = argparse.ArgumentParser()\n", 2,
                 "argparse.ArgumentParser"),
    "a method of what a function here returned": (
        "import argparse\ndef make():\n    return PARSER\n"
        "parser = make()\nargs = parser.parse_args()\n", 5, "parser.parse_args"),
    # a function of this file is read one level deep: its body's calls are judged alike
    "a local argparse wrapper (get_args)": (
        "import argparse\ndef get_args():\n    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--lr', type=float)\n    return p.parse_args()\n"
        "args = get_args()\n", 6, "get_args, a function of this file that calls "
        "argparse.ArgumentParser (line 3)"),
    "a setup function that writes a marker (setup_run)": (
        "from pathlib import Path\ndef setup_run():\n    Path('marker').write_text('x')\n"
        "setup_run()\n", 4, "setup_run, a function of this file that calls "
        "Path('marker').write_text"),
    "a function of this file calling another (not read transitively)": (
        "def _inner():\n    pass\ndef outer():\n    _inner()\nX = outer()\n", 5,
        "calls outer, a function of this file that calls _inner"),
    "a registration function that also opens a file": (
        "import torch\ndef _define():\n    lib = torch.library.Library('x', 'DEF')\n"
        "    open('log', 'w')\n    return lib\nLIB = _define()\n", 6, "open (line 4)"),
    "broad except around more than imports": (
        "try:\n    import apex\n    apex.setup()\nexcept Exception:\n    pass\n", 1, "try"),
    "a method of a logger not bound from logging.getLogger": (
        "import logging\nLOG = logging.Logger('x')\n", 2, "logging.Logger"),
    "a seed function off the list": ("import numpy as np\nnp.random.rand(3)\n", 2,
                                     "np.random.rand"),
    "open": ('"""Doc."""\nimport json\nCFG = json.load(open("cfg.json"))\n', 3, "json.load"),
    "wandb.init": ("import wandb\nwandb.init(project='x')\n", 2, "wandb.init"),
    "Path.write_text": ("from pathlib import Path\nPath('m.txt').write_text('x')\n", 2,
                        "write_text"),
    "bare main()": ("def main():\n    pass\nmain()\n", 3, "runs the script"),
    "bare train() of a sibling-less import": ("from trainer import train\ntrain()\n", 2,
                                              "train"),
    "for loop": ("import torch\nfor i in range(3):\n    pass\n", 2, "loops"),
    "while loop": ("x = 0\nwhile x < 3:\n    x += 1\n", 2, "loops"),
    "with": ("with open('f') as f:\n    pass\n", 1, "with"),
    "try not around imports": ("try:\n    x = 1\nexcept Exception:\n    pass\n", 1, "try"),
    "try catching another error": ("try:\n    import a\nexcept OSError:\n    pass\n", 1,
                                   "try"),
    "a call in an import's handler": ("try:\n    import a\nexcept ImportError:\n"
                                      "    os.system('pip install a')\n", 4, "os.system"),
    "global": ("global X\n", 1, "statement"),
    "del": ("X = 1\ndel X\n", 2, "statement"),
    "assert with a call": ("import os\nassert os.path.exists('x')\n", 2, "assert"),
    "raise at top level": ("raise RuntimeError('no')\n", 1, "statement"),
    "if with a call in its test": ("import os\nif os.system('x'):\n    pass\n", 2, "os.system"),
    "inside an if": ("import sys\nif sys.platform == 'linux':\n    import os\n"
                     "    os.makedirs('out')\n", 4, "os.makedirs"),
    "an else of __main__": ("if __name__ == '__main__':\n    pass\nelse:\n"
                            "    print(open('x'))\n", 4, "open"),
    "Path method not pure": ("from pathlib import Path\nP = Path('x').resolve()\n"
                             "P.mkdir()\n", 3, "P.mkdir"),
    "a builtin off the list": ("X = input()\n", 1, "input"),
    "a shadowed builtin": ("from os import system as print\nprint('rm')\n", 2, "print"),
}


@pytest.mark.parametrize("name", list(ALLOWED))
def test_allowed_forms_pass(name):
    assert first_refused(textwrap.dedent(ALLOWED[name])) is None


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_forms_name_their_line(name):
    source, line, word = REFUSED[name]
    found = first_refused(source)
    assert found is not None and found.line == line, found
    assert word in f"{found.text} {found.what}", found


def test_a_sibling_modules_calls_are_the_users_code(tmp_path):
    """``from moe import define_unpermute`` where moe.py sits next to the entry: its calls are
    definitional; the same import from elsewhere is not."""
    src = "from moe import define_unpermute, unpermute\nOP = define_unpermute()\n" \
          "unpermute.register_autograd(None)\nfrom .kernels import build\nK = build()\n"
    (tmp_path / "moe.py").write_text("def define_unpermute(): ...\ndef unpermute(): ...\n")
    assert first_refused(src, tmp_path) is None
    (tmp_path / "moe.py").unlink()
    assert first_refused(src, tmp_path).line == 2
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "__init__.py").write_text("")
    assert first_refused(src, tmp_path) is None
    # a sibling's main() run bare is still the script; what a sibling's call returned is not
    # the user's code (``parser = make_parser()``)
    assert first_refused("from moe import main\nmain()\n", tmp_path).line == 2
    assert first_refused("from moe import make\np = make()\np.parse_args()\n",
                         tmp_path).line == 3


def test_source_that_does_not_parse_is_left_to_the_import():
    assert first_refused("def (:\n") is None


def test_every_entry_the_suite_uses_passes():
    """The shipped fixtures (their hashes are in the bundles) and the test entries define only;
    the files of tests/tasks that are run as scripts (not entries) are listed."""
    scripts = {"capture_killed.py", "guard_file_limit.py", "guard_race.py", "spawned.py",
               "trains_at_import.py", "top_level_effects.py"}
    entries = [*sorted((ROOT / "fixtures" / "tasks").glob("*.py")),
               *sorted((ROOT / "fixtures" / "inject").glob("*.py")),
               *(p for p in sorted(TEST_TASKS.glob("*.py")) if p.name not in scripts),
               ROOT / "tests" / "npu" / "tasks" / "npu_train.py",
               ROOT / "tests" / "guard" / "test_rebuild.py",
               ROOT / "tests" / "helpers" / "hostile.py",       # the hostile bundles' entry
               ROOT / "scripts" / "bench_bisect.py", ROOT / "scripts" / "bench_guard.py",
               *sorted((ROOT / "examples").glob("*.py"))]
    for m in sorted((ROOT / "fixtures" / "bundles").rglob("manifest.json")):
        target = json.loads(m.read_text())["entry"].rpartition(":")[0]
        if target.endswith(".py"):
            entries.append(ROOT / target)
    refused = {}
    for f in entries:
        try:
            check_entry(f"{f}:task")
        except BadInput as e:
            refused[str(f.relative_to(ROOT))] = str(e)
    assert refused == {}, refused
    for name in sorted(scripts - {"top_level_effects.py"}):  # they do run at import
        with pytest.raises(BadInput, match="at import"):
            check_entry(f"{TEST_TASKS / name}:task")


def _file(tmp_path: Path, name: str, body: str) -> Path:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return f


TASK = """\
    import time
    import torch
    import nanbisect

    STARTED = time.time()                                 # line 5: not definitional
    SEEN_ARGV = list(__import__("sys").argv)

    def task():
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              loss_fn=lambda m, b: m(b).pow(2).mean(), run_top_level=ALLOW)
    """


def test_load_task_refuses_before_importing_and_honours_the_opt_in(tmp_path, monkeypatch):
    f = _file(tmp_path, "gated_entry_xyz.py", TASK.replace("ALLOW", "False"))
    with pytest.raises(BadInput) as e:
        load_task(f"{f}:task")
    msg = str(e.value)
    assert "\n" not in msg and "line 5 runs `STARTED = time.time()" in msg, msg
    assert "--run-top-level" in msg and 'if __name__ == "__main__":' in msg, msg
    assert "gated_entry_xyz" not in sys.modules                 # nothing of it ran
    monkeypatch.setattr(sys, "argv", ["nanbisect", "run", "BUNDLE", "--lr", "3"])
    task = load_task(f"{f}:task", run_top_level=True)
    assert sys.modules["gated_entry_xyz"].SEEN_ARGV == [str(f)]  # the entry file alone
    assert sys.argv == ["nanbisect", "run", "BUNDLE", "--lr", "3"]   # restored
    assert isinstance(task.model, torch.nn.Linear) and "run_top_level" not in task.describe()


def test_a_dotted_entry_is_gated_by_its_file(tmp_path, monkeypatch):
    (tmp_path / "gatedpkg_xyz").mkdir()
    (tmp_path / "gatedpkg_xyz" / "__init__.py").write_text("")
    _file(tmp_path / "gatedpkg_xyz", "train.py", TASK.replace("ALLOW", "False"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BadInput, match=r"entry 'gatedpkg_xyz\.train \(.*train\.py\)' line 5 "):
        load_task("gatedpkg_xyz.train:task")
    assert "gatedpkg_xyz" not in sys.modules         # its file found without importing a thing


def test_the_task_field_is_recorded_and_a_replay_honours_it(tmp_path):
    """Task(run_top_level=True) goes into the manifest's task section; a Replayer of that
    bundle imports the entry although its top level calls; the same without it is refused."""
    with pytest.raises(ValueError, match="run_top_level"):
        nanbisect.Task(model=torch.nn.Linear(2, 1), optimizer=None, loss_fn=None,
                       run_top_level="yes")
    for allow in (False, True):
        f = _file(tmp_path, f"recorded_entry_{allow}_xyz.py", TASK.replace("ALLOW", str(allow)))
        model = torch.nn.Linear(2, 1)
        task = nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              loss_fn=lambda m, b: m(b).pow(2).mean(), run_top_level=allow)
        b = nanbisect.capture(task, torch.ones(4, 2), tmp_path / f"b{allow}", entry=f"{f}:task")
        bundle = read_bundle(b)
        assert bundle.manifest["task"].get("run_top_level", False) is allow
        if not allow:
            with pytest.raises(BadInput, match="line 5 runs"):
                Replayer(bundle, torch.device("cpu"))
            continue
        rep = Replayer(bundle, torch.device("cpu"))
        assert rep.run_top_level and torch.isfinite(torch.tensor(rep.run().loss))


EFFECTS = TEST_TASKS / "top_level_effects.py"


def test_run_refuses_an_entry_that_writes_parses_and_inits_at_import(tmp_path):
    """The issue's case: the entry writes a marker, parses argv and calls an init function at
    module level. `nanbisect run`: one line naming line 20 (the marker's write), exit 2, the
    marker as the training left it, no report written; with --run-top-level it runs (the import
    writes the marker again, having seen argv as the entry file alone) and finds the sqrt."""
    # the test builds the Task the entry builds, without importing the entry
    src = EFFECTS.read_text()
    ns: dict = {"torch": torch, "nanbisect": nanbisect}
    exec(compile(src[src.index("def task()"):src.index("if __name__")], str(EFFECTS), "exec"), ns)
    task, batch = ns["task"](), ns["batch"]()
    bundle = nanbisect.capture(task, batch, tmp_path / "bundle", entry=f"{EFFECTS}:task")
    marker = tmp_path / "marker.txt"
    marker.write_text("written by the training\n")
    env = {"TOP_LEVEL_MARKER": str(marker)}
    res = cli("run", bundle, "--no-remedies", cwd=tmp_path, env=env)
    one_line_exit_2(res, "top_level_effects.py' line 20 runs `MARKER.write_text(",
                    "which a replay must not do", 'if __name__ == "__main__":', "--run-top-level")
    assert marker.read_text() == "written by the training\n"
    assert not (bundle / "nanbisect-report").exists()
    assert not [p for p in tmp_path.iterdir() if p.name not in ("bundle", "marker.txt")]

    res = cli("run", bundle, "--no-remedies", "--run-top-level", cwd=tmp_path, env=env)
    assert res.code == 1, res.stdout + res.stderr
    assert marker.read_text() == f"imported: argv={[str(EFFECTS)]!r}\nlr=0.1\n"
    rep = json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert rep["culprit"]["op"] == "aten.sqrt.default", rep["culprit"]


@pytest.mark.slow
def test_every_rank_of_a_multirank_replay_honours_the_flag(tmp_path):
    """A multi-rank replay with an --entry whose top level calls: refused before any rank
    starts; with --run-top-level every rank's process imports it (each marks its rank)."""
    from helpers.bundles import captured

    bundle = captured(TEST_TASKS / "ddp_train.py", "rank1_nan", tmp_path / "g", 2)
    entry = tmp_path / "mr_fixed_top.py"
    entry.write_text((TEST_TASKS / "mr_fixed.py").read_text()
                     + "\nSTARTED = __import__('time').time()\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"MR_MARK_DIR": str(marks)}
    res = cli("run", bundle, "--entry", f"{entry}:rank1_nan_fixed", env=env)
    one_line_exit_2(res, "mr_fixed_top.py' line", "runs `STARTED = __import__")
    assert list(marks.iterdir()) == [] and not (bundle / "nanbisect-report").exists()
    res = cli("run", bundle, "--entry", f"{entry}:rank1_nan_fixed", "--run-top-level",
              "--json", env=env)
    assert res.code == 3, res.stdout[-2000:] + res.stderr          # the fixed copy: no NaN
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]


def test_the_guard_warns_at_capture_of_an_entry_a_replay_will_refuse(tmp_path):
    """Told when the bundle is written, not at the replay: an entry file whose top level does
    more than define makes `Guard(...)` and `capture(...)` warn (the statement and the fix);
    with Task(run_top_level=True), or an entry that only defines, they say nothing."""
    import warnings

    import torch

    import nanbisect

    f = tmp_path / "noisy_task.py"
    f.write_text("import torch\nimport nanbisect\n"
                 "open(__file__ + '.log', 'a').write('x')\n"
                 "def task(run_top_level=False):\n"
                 "    m = torch.nn.Linear(2, 1)\n"
                 "    return nanbisect.Task(m, torch.optim.SGD(m.parameters(), lr=0.1),\n"
                 "                          lambda m, b: m(b).sum(), run_top_level=run_top_level)\n")
    quiet = tmp_path / "quiet_task.py"
    quiet.write_text(f.read_text().replace("open(__file__ + '.log', 'a').write('x')\n", ""))
    ns: dict = {}
    exec(compile(quiet.read_text(), str(quiet), "exec"), ns)
    for i, (entry, opt_in, warned) in enumerate(((f, False, True), (f, True, False),
                                                 (quiet, False, False))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            nanbisect.Guard(ns["task"](opt_in), entry=f"{entry}:task", out=tmp_path / "g")
            nanbisect.capture(ns["task"](opt_in), torch.ones(3, 2), tmp_path / f"c{i}",
                              entry=f"{entry}:task")
        lines = [str(w.message) for w in seen if "replay will refuse" in str(w.message)]
        assert len(lines) == (2 if warned else 0), (entry.name, opt_in, lines)
        if warned:
            assert all("line 3" in x and "open(" in x and "--run-top-level" in x for x in lines)
