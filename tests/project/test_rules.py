"""The house rules hold over every module of the package, read from the AST
(`helpers.rules`); each rule's counter-test plants a violation (through an alias, a
from-import, a function-level import) in a temporary package and sees the rule find it, beside
the allowed form it must leave alone."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from helpers import rules

RULES = {
    "process control outside nanbisect.proc": rules.process_control,
    "private names of torch or another library outside util/torch_internals.py":
        rules.foreign_private,
    "another module's underscore names": rules.private_across,
    "a raw manifest read outside nanbisect.bundle": rules.manifest_reads,
    "a device string parsed outside nanbisect.options": rules.spec_parses,
    "an import cycle": rules.import_cycles,
    "a callable-module trick": rules.module_tricks,
    "two modules with one name": rules.same_names,
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_package_keeps_the_rule(rule):
    found = RULES[rule]()
    assert not found, f"{rule}:\n" + "\n".join(map(str, found))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "nanbisect"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(pkg).parents:
            (pkg / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return pkg


def _where(found: list[rules.Finding]) -> set[tuple[str, int]]:
    return {(f.path, f.line) for f in found}


def test_process_control_is_found_through_any_alias(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": """\
            import os as o
            from signal import signal as on
            import subprocess

            def stop(pid, popen):
                o.killpg(pid, 9)
                on(2, None)
                subprocess.run(["true"])
                popen.terminate()
            """,
        "proc/ok.py": "import os\nos.kill(1, 0)\n",     # proc's own: allowed
    })
    assert _where(rules.process_control(pkg)) == {
        ("nanbisect/a.py", 6), ("nanbisect/a.py", 7), ("nanbisect/a.py", 8),
        ("nanbisect/a.py", 9)}


def test_private_torch_names_are_found_through_aliases_and_objects(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": """\
            import os
            import torch.distributed as dist
            from torch.amp.grad_scaler import _refresh_per_optimizer_state
            import torch._dynamo

            class Mine:
                def __init__(self):
                    self._own = 1

            def read(scaler, mine):
                dist.distributed_c10d._world
                scaler._growth_tracker
                getattr(scaler, "_scale")
                os._exit
                return mine._own
            """,
        "util/torch_internals.py": "import torch\ntorch._C\n",     # the room: allowed
        # other libraries' room: their names allowed, torch's not
        "util/library_internals.py": "import threading\nthreading._shutdown()\n"
                                     "import torch\ntorch._C\n",
    })
    assert _where(rules.foreign_private(pkg)) == {
        ("nanbisect/a.py", 3), ("nanbisect/a.py", 4), ("nanbisect/a.py", 11),
        ("nanbisect/a.py", 12), ("nanbisect/a.py", 13),
        ("nanbisect/util/library_internals.py", 4)}


def test_underscore_names_of_another_module_are_found(tmp_path):
    pkg = _package(tmp_path, {
        "b.py": """\
            _LIMIT = 3

            def _helper():
                pass

            class Thing:
                def __init__(self):
                    self._state = 0
            """,
        "a.py": """\
            from nanbisect.b import _LIMIT
            from nanbisect import b
            from . import b as bee

            def use(thing):
                b._helper()
                bee._helper()
                return thing._state
            """,
    })
    assert _where(rules.private_across(pkg)) == {
        ("nanbisect/a.py", 1), ("nanbisect/a.py", 6), ("nanbisect/a.py", 7),
        ("nanbisect/a.py", 8)}


def test_raw_manifest_reads_outside_the_bundle_are_found(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": """\
            def read(bundle, manifest, view):
                bundle.manifest["step"]
                manifest.get("observed")
                m = bundle.manifest
                m["rng"]
                return view.step
            """,
        "bundle/ok.py": "def read(manifest):\n    return manifest['step']\n",
    })
    assert _where(rules.manifest_reads(pkg)) == {("nanbisect/a.py", 2),
                                                 ("nanbisect/a.py", 3), ("nanbisect/a.py", 5)}


def test_a_device_string_parsed_a_second_time_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": """\
            from nanbisect.util.spec import DeviceSpec

            def again(text, opts):
                DeviceSpec.parse(text)
                return opts.reference.device
            """,
        "options.py": "from nanbisect.util.spec import DeviceSpec\nDeviceSpec.parse('cpu')\n",
    })
    assert _where(rules.spec_parses(pkg)) == {("nanbisect/a.py", 4)}


def test_a_cycle_through_a_function_level_import_or_a_string_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "a.py": "from nanbisect import b\n",
        "b.py": "def late():\n    from nanbisect import a\n",
        "c.py": "import importlib\nimportlib.import_module('nanbisect.d')\n",
        "d.py": "import nanbisect.c\n",
        "e.py": "import nanbisect.a\n",      # imports into a cycle: no cycle of its own
    })
    cycles = {f.what for f in rules.import_cycles(pkg)}
    assert cycles == {"import cycle: nanbisect.a -> nanbisect.b -> nanbisect.a",
                      "import cycle: nanbisect.c -> nanbisect.d -> nanbisect.c"}


def test_a_swapped_module_class_and_a_name_twice_are_found(tmp_path):
    pkg = _package(tmp_path, {
        "a/run.py": "import sys\nsys.modules[__name__].__class__ = type\n",
        "b/run.py": "",
        "b/other.py": "",
    })
    assert _where(rules.module_tricks(pkg)) == {("nanbisect/a/run.py", 2)}
    assert [f.path for f in rules.same_names(pkg)] == ["nanbisect/a/run.py"]
