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

# what the effect rule lets through that the former allow-list refused: ordinary code
ALLOWED.update({
    "computation, reading and settings the former allow-list refused": """\
        import argparse, json, logging, os, sys
        import numpy as np
        import torch
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()
        CFG = json.load(open("cfg.json"))
        NOISE = np.random.rand(3)
        LOG = logging.Logger("x")
        for i in range(3):
            pass
        x = 0
        while x < 3:
            x += 1
        with open("f") as f:
            pass
        try:
            x = 1
        except Exception:
            pass
        try:
            import a
        except OSError:
            pass
        global X
        del x
        assert os.path.exists("x")
        torch.set_num_threads(2)
        if __name__ == "__main__":
            pass
        else:
            print(open("x").read())
        """,
})

# (source, the line refused, a word of what it does)
REFUSED = {
    "a function of this file that writes a marker (setup_run)": (
        "from pathlib import Path\ndef setup_run():\n    Path('marker').write_text('x')\n"
        "setup_run()\n", 4, "setup_run, a function of this file, calls "
        "Path('marker').write_text"),
    "a function of this file calling another that writes": (
        "def _inner():\n    open('log', 'w')\ndef outer():\n    _inner()\nX = outer()\n", 5,
        "outer, a function of this file, calls _inner"),
    "a registration function that also opens a file for writing": (
        "import torch\ndef _define():\n    lib = torch.library.Library('x', 'DEF')\n"
        "    open('log', 'w')\n    return lib\nLIB = _define()\n", 6, "open (line 4)"),
    "an import's handler that installs": ("try:\n    import a\nexcept ImportError:\n"
                                          "    import os\n    os.system('pip install a')\n", 5,
                                          "os.system"),
    "wandb.init": ("import wandb\nwandb.init(project='x')\n", 2, "wandb.init"),
    "Path.write_text": ("from pathlib import Path\nPath('m.txt').write_text('x')\n", 2,
                        "write_text"),
    "Path.open for appending": ("from pathlib import Path\nwith Path('m').open('a') as f:\n"
                                "    pass\n", 2, "writes a file"),
    "bare main()": ("def main():\n    pass\nmain()\n", 3, "runs the script"),
    "bare train() of a sibling": ("from .trainer import train\ntrain()\n", 2, "train"),
    "a loop over a loader": ("import torch\nfor x, y in train_loader:\n    pass\n", 2,
                             "loops over data"),
    "a loop calling this file's function": ("def step(): ...\nfor i in range(3):\n"
                                            "    step()\n", 2, "loops calling step"),
    "a with block that writes": ("with open('f', 'w') as f:\n    pass\n", 1, "writes a file"),
    "if with a subprocess in its test": ("import os\nif os.system('x'):\n    pass\n", 2,
                                         "os.system"),
    "inside an if": ("import sys\nif sys.platform == 'linux':\n    import os\n"
                     "    os.makedirs('out')\n", 4, "os.makedirs"),
    "an else of __main__": ("if __name__ == '__main__':\n    pass\nelse:\n"
                            "    open('x', 'w')\n", 4, "open"),
    "Path.mkdir": ("from pathlib import Path\nP = Path('x').resolve()\nP.mkdir()\n", 3,
                   "P.mkdir"),
    "input()": ("X = input()\n", 1, "input"),
    "a shadowed builtin": ("from os import system as print\nprint('rm')\n", 2, "print"),
    "a decorator that acts": ("import wandb\n@wandb.init\ndef f(): ...\n", 2, "wandb.init"),
    "an assert that trains": ("import torch\nassert torch.ones(1).backward() is None\n", 2,
                              "backward"),
    "a trainer's train()": ("from transformers import Trainer\ntrainer = Trainer(model=m)\n"
                            "trainer.train()\n", 3, "trainer.train"),
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
    # a sibling's main() run bare is the script; the same name from an installed package is
    # not the user's entry point (its effects are judged by name, like any call)
    assert first_refused("from moe import main\nmain()\n", tmp_path).line == 2
    (tmp_path / "moe.py").unlink()
    assert first_refused("from moe import main\nmain()\n", tmp_path) is None
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "__init__.py").write_text("")
    assert first_refused("from moe import main\nmain()\n", tmp_path).line == 2


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
    import os
    import torch
    import nanbisect

    STARTED = os.system("true")                           # line 5: acts (a subprocess)
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
    assert "\n" not in msg and "line 5 runs `STARTED = os.system(" in msg, msg
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
                     + "\nimport os\nSTARTED = os.system('true')\n")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"MR_MARK_DIR": str(marks)}
    res = cli("run", bundle, "--entry", f"{entry}:rank1_nan_fixed", env=env)
    one_line_exit_2(res, "mr_fixed_top.py' line", "runs `STARTED = os.system(")
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


# -- the corpus: top-level statements of well-known public training scripts and tutorials --------
# Each is (allowed?, where such a line is seen, the statement), judged after `PRELUDE` (the
# imports and definitions those scripts make). The rule (nanbisect/util/toplevel.py) is measured
# on it: every label must hold. "allowed" means a replay may run it at import (it computes, reads
# or sets the process up); "refused" means it acts (trains, writes, downloads, starts processes
# or a tracker, initialises a process group, ends or pauses the process).
PRELUDE = """\
import argparse, json, logging, math, os, random, signal, subprocess, sys, time, warnings
from contextlib import nullcontext
from pathlib import Path
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torchvision
import torchvision.transforms as transforms
from torchvision import datasets
from torchvision.transforms import ToTensor
from torch.utils.data import DataLoader
from torch.distributed import init_process_group
from torch.utils.tensorboard import SummaryWriter
import lightning as L
from accelerate import Accelerator
from transformers import AutoTokenizer, Trainer, TrainingArguments, set_seed
from transformers.utils import check_min_version
from huggingface_hub import snapshot_download
from datasets import load_dataset
import mlflow, requests, wandb
class Net(nn.Module):
    pass
def train(dataloader, model, loss_fn, optimizer):
    pass
def get_batch(split):
    return np.memmap(os.path.join("data", f"{split}.bin"), dtype=np.uint16, mode="r")
def get_lr(it):
    return 6e-4 * it / 2000
def main():
    pass
def handler(signum, frame):
    pass
"""

CORPUS = [
    # the PyTorch CIFAR-10 tutorial ("Training a Classifier")
    (True, "cifar10 tutorial", "transform = transforms.Compose([transforms.ToTensor(), "
     "transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])"),
    (True, "cifar10 tutorial", "batch_size = 4"),
    (False, "cifar10 tutorial", "trainset = torchvision.datasets.CIFAR10(root='./data', "
     "train=True, download=True, transform=transform)"),
    (True, "cifar10 tutorial", "trainloader = torch.utils.data.DataLoader(trainset, "
     "batch_size=batch_size, shuffle=True, num_workers=2)"),
    (True, "cifar10 tutorial", "classes = ('plane', 'car', 'bird', 'cat', 'deer', 'dog', "
     "'frog', 'horse', 'ship', 'truck')"),
    (True, "cifar10 tutorial", "net = Net()"),
    (True, "cifar10 tutorial", "criterion = nn.CrossEntropyLoss()"),
    (True, "cifar10 tutorial", "optimizer = optim.SGD(net.parameters(), lr=0.001, "
     "momentum=0.9)"),
    (False, "cifar10 tutorial", "for epoch in range(2):\n    running_loss = 0.0\n"
     "    for i, data in enumerate(trainloader, 0):\n        inputs, labels = data\n"
     "        optimizer.zero_grad()\n        loss = criterion(net(inputs), labels)\n"
     "        loss.backward()\n        optimizer.step()"),
    (True, "cifar10 tutorial", "PATH = './cifar_net.pth'"),
    (False, "cifar10 tutorial", "torch.save(net.state_dict(), PATH)"),
    (True, "cifar10 tutorial", "net.load_state_dict(torch.load(PATH, weights_only=True))"),
    # the PyTorch quickstart
    (False, "quickstart", "training_data = datasets.FashionMNIST(root='data', train=True, "
     "download=True, transform=ToTensor())"),
    (True, "quickstart", "device = torch.accelerator.current_accelerator().type if "
     "torch.accelerator.is_available() else 'cpu'"),
    (True, "quickstart", "print(f'Using {device} device')"),
    (True, "quickstart", "model = Net().to('cpu')"),
    (True, "quickstart", "loss_fn = nn.CrossEntropyLoss()"),
    (False, "quickstart", "for t in range(5):\n    train(train_dataloader, model, loss_fn, "
     "optimizer)"),
    (False, "quickstart", "torch.save(model.state_dict(), 'model.pth')"),
    (True, "quickstart", "model.eval()"),
    # nanoGPT's train.py
    (True, "nanoGPT", "out_dir = 'out'\neval_interval = 2000\nlog_interval = 1"),
    (True, "nanoGPT", "config_keys = [k for k, v in globals().items() if not "
     "k.startswith('_') and isinstance(v, (int, float, bool, str))]"),
    (False, "nanoGPT", "exec(open('configurator.py').read())"),
    (True, "nanoGPT", "config = {k: globals()[k] for k in config_keys}"),
    (True, "nanoGPT", "ddp = int(os.environ.get('RANK', -1)) != -1"),
    (False, "nanoGPT", "init_process_group(backend='nccl')"),
    (False, "nanoGPT", "os.makedirs(out_dir, exist_ok=True)"),
    (True, "nanoGPT", "torch.manual_seed(1337 + 0)"),
    (True, "nanoGPT", "torch.backends.cuda.matmul.allow_tf32 = True\n"
     "torch.backends.cudnn.allow_tf32 = True"),
    (True, "nanoGPT", "ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, "
     "'float16': torch.float16}['float32']"),
    (True, "nanoGPT", "ctx = nullcontext() if 'cpu' == 'cpu' else "
     "torch.amp.autocast(device_type='cuda', dtype=ptdtype)"),
    (True, "nanoGPT", "data_dir = os.path.join('data', 'openwebtext')"),
    (True, "nanoGPT", "X, Y = get_batch('train'), get_batch('val')"),
    (True, "nanoGPT", "scaler = torch.amp.GradScaler('cuda', enabled=False)"),
    (True, "nanoGPT", "model = torch.compile(Net())"),
    (False, "nanoGPT", "if True:\n    wandb.init(project='owt', name='gpt2', config=config)"),
    (False, "nanoGPT", "while True:\n    lr = get_lr(0)\n    break"),
    # Hugging Face example scripts (run_clm.py and friends)
    (True, "transformers examples", "logger = logging.getLogger(__name__)"),
    (True, "transformers examples", "check_min_version('4.40.0')"),
    (True, "transformers examples", "MODEL_TYPES = tuple(c for c in ['gpt2', 'llama'])"),
    (True, "transformers examples", "tokenizer = AutoTokenizer.from_pretrained('gpt2')"),
    (False, "transformers examples", "raw_datasets = load_dataset('wikitext', "
     "'wikitext-2-raw-v1')"),
    (False, "transformers examples", "trainer = Trainer(model=net, args=TrainingArguments("
     "'out'))\ntrainer.train()"),
    (False, "transformers examples", "net.save_pretrained('out')"),
    (False, "transformers examples", "main()"),
    (True, "transformers examples", "if __name__ == '__main__':\n    main()"),
    # Lightning and Accelerate examples
    (True, "lightning examples", "L.seed_everything(42)"),
    (True, "lightning examples", "trainer = L.Trainer(max_epochs=1, accelerator='cpu')"),
    (False, "lightning examples", "trainer = L.Trainer(max_epochs=1)\ntrainer.fit(net)"),
    (False, "accelerate examples", "accelerator = Accelerator()"),
    (True, "accelerate examples", "set_seed(42)"),
    # pytorch/examples: mnist, DDP tutorials
    (True, "mnist example", "parser = argparse.ArgumentParser(description='PyTorch MNIST')\n"
     "parser.add_argument('--batch-size', type=int, default=64)\nargs = parser.parse_args()"),
    (True, "mnist example", "use_cuda = not False and torch.cuda.is_available()"),
    (True, "ddp tutorial", "os.environ['MASTER_ADDR'] = 'localhost'\n"
     "os.environ['MASTER_PORT'] = '12355'"),
    (False, "ddp tutorial", "dist.init_process_group('gloo', rank=0, world_size=2)"),
    (False, "ddp tutorial", "mp.spawn(main, args=(2,), nprocs=2, join=True)"),
    (True, "ddp tutorial", "world_size = torch.cuda.device_count()"),
    # what ordinary independent scripts do (the refusals measured before the effect rule)
    (True, "a synthetic-data script", "D, L, N = 8, 3, 64\nW_TRUE = torch.randn(D, L, "
     "generator=torch.Generator().manual_seed(3))\nDATA = torch.randn(N, D, "
     "generator=torch.Generator().manual_seed(4))"),
    (True, "a threads setting", "torch.set_num_threads(2)"),
    (True, "a numpy learning-rate table", "with np.errstate(divide='ignore'):\n"
     "    LR_TABLE = np.log(np.linspace(0, 1, 10))"),
    (True, "a config read by mode", "MODE = os.environ.get('MODE', 'x')\nif MODE == 'x':\n"
     "    with open('cfg.json') as f:\n        CFG = json.load(f)"),
    (True, "torchvision normalisation", "IMAGENET_MEAN = torch.tensor([0.485, 0.456, "
     "0.406]).view(3, 1, 1)"),
    (True, "determinism", "torch.backends.cudnn.deterministic = True\n"
     "torch.backends.cudnn.benchmark = False\ntorch.use_deterministic_algorithms(True)"),
    (True, "seeds", "random.seed(0)\nnp.random.seed(0)\ntorch.manual_seed(0)"),
    (True, "warnings", "warnings.filterwarnings('ignore', category=UserWarning)"),
    (True, "a schedule table", "SCHEDULE = [0.1 * 0.5 ** (i // 10) for i in range(100)]"),
    (True, "a table built in a loop", "SIZES = []\nfor i in range(4):\n    SIZES.append(2 ** i)"),
    (True, "under no_grad", "with torch.no_grad():\n    EYE = torch.eye(4) * 2"),
    (True, "a logging config", "logging.basicConfig(level=logging.INFO, format='%(message)s')"),
    (True, "a device choice", "torch.set_default_device('cpu')"),
    # scripts that act at import (each a refusal a replay must make)
    (False, "a tensorboard run", "writer = SummaryWriter('runs/exp1')"),
    (False, "an mlflow run", "mlflow.start_run()"),
    (False, "a GPU probe", "subprocess.run(['nvidia-smi'], check=False)"),
    (False, "a GPU probe", "os.system('nvidia-smi')"),
    (False, "a preemption handler", "signal.signal(signal.SIGTERM, handler)"),
    (False, "saved initial weights", "np.save('init.npy', np.zeros(3))"),
    (False, "a run log", "with open('log.txt', 'w') as f:\n    f.write('start')"),
    (False, "a run directory", "Path('runs').mkdir(exist_ok=True)"),
    (False, "a log file", "logging.basicConfig(filename='train.log', level=logging.INFO)"),
    (False, "a model download", "snapshot_download('gpt2')"),
    (False, "a data download", "r = requests.get('https://example.com/data.csv')"),
    (False, "an interactive pause", "input('press enter to start')"),
    (False, "the script's exit", "sys.exit(main())"),
    (False, "a first-hour script", "model = Net()\nopt = optim.SGD(model.parameters(), lr=0.1)\n"
     "for x, y in loader:\n    loss = F.mse_loss(model(x), y)\n    loss.backward()\n"
     "    opt.step()"),
    (False, "a bare training step", "loss = net(X).sum()\nloss.backward()"),
]


def test_the_effect_rule_labels_every_corpus_statement():
    """At least 60 statements from public training scripts, each labelled; none is judged
    wrong. A refusal names a line of the statement itself (not of the prelude)."""
    assert len(CORPUS) >= 60 and sum(not ok for ok, _, _ in CORPUS) >= 20
    assert first_refused(PRELUDE) is None
    start = PRELUDE.count("\n") + 1
    wrong = []
    for ok, where, code in CORPUS:
        found = first_refused(PRELUDE + code + "\n")
        if ok != (found is None) or (found is not None and found.line < start):
            wrong.append((where, code.splitlines()[0], found))
    assert wrong == [], "\n".join(map(str, wrong))


def test_an_ordinary_scripts_top_level_replays_without_a_flag(tmp_path):
    """The statements the former gate refused (a seeded constant, a thread setting, a numpy
    table under np.errstate, a config read under an if, a normalisation constant) replay with
    no flag to the culprit; the first-hour script (training at module level) is still refused."""
    entry = TEST_TASKS / "ordinary_top_level.py"
    assert first_refused(entry.read_text(), entry.parent) is None
    from nanbisect.task import import_target
    mod = import_target(str(entry))
    bundle = nanbisect.capture(mod.task(), mod.batch(), tmp_path / "b", entry=f"{entry}:task")
    cfg = tmp_path / "cfg.json"
    cfg.write_text("{}")
    res = cli("run", bundle, "--no-remedies", "--json",
              env={"ORDINARY_MODE": "x", "ORDINARY_CFG": str(cfg)})
    assert res.code == 1, res.stdout[-2000:] + res.stderr
    rep = json.loads((bundle / "nanbisect-report" / "report.json").read_text())
    assert rep["culprit"]["op"] == "aten.sqrt.default" and rep["culprit"]["phase"] == "forward"
    with pytest.raises(BadInput, match="trains_at_import.py' line 19 runs `guard.step"):
        check_entry(f"{TEST_TASKS / 'trains_at_import.py'}:task")


# what review found: ordinary code the rule must let through, and acting code it must see
ALLOWED_TOO = {
    "torchrun's @record, FSDP types, queries": (
        "import torch.distributed as dist\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "from torch.distributed.fsdp import MixedPrecision\n"
        "MP = MixedPrecision()\nRANK = dist.get_node_local_rank()\n@record\ndef main(): ...\n"),
    "opening for reading, by any library": (
        "import io, tarfile\nfrom PIL import Image\nIMG = Image.open('cat.png')\n"
        "T = tarfile.open('a.tar')\nF = io.open('p', encoding='utf8')\n"),
    "counting loops and metadata": (
        "import dataclasses\nnum_batches = 3\nfor i in range(num_batches):\n    pass\n"
        "metadata = {}\nfor k in metadata:\n    pass\n"),
}
REFUSED_TOO = {
    "a class body that acts": ("import wandb\nclass Cfg:\n    run = wandb.init()\n", 3,
                               "wandb.init"),
    "a tar opened for writing": ("import tarfile\nT = tarfile.open('a.tar', 'w')\n", 2,
                                 "writes a file"),
    "a sibling's function in a loop": ("from .trainer import train_one_epoch\n"
                                       "for epoch in range(3):\n    train_one_epoch()\n", 2,
                                       "loops calling train_one_epoch"),
    "an expression nested too deeply to read": ("X = " + "(" * 200 + "1" + ")" * 200 + "\n",
                                                None, ""),
}


@pytest.mark.parametrize("name", list(ALLOWED_TOO))
def test_what_review_found_allowed(name):
    assert first_refused(ALLOWED_TOO[name]) is None


@pytest.mark.parametrize("name", list(REFUSED_TOO))
def test_what_review_found_refused(name):
    source, line, word = REFUSED_TOO[name]
    found = first_refused(source)
    if line is None:      # parsed fine by Python: nothing to refuse (a deeper one is refused)
        assert found is None or "nested too deeply" in found.what
        return
    assert found is not None and found.line == line, found
    assert word in f"{found.text} {found.what}", found
