"""A replay runs only the code it shows (docs/reference/safety.md, "What a replay imports"): the
listed, hashed sources under ``code/`` or the local files, never cached bytecode, never a file
the manifest points at inside or beside the bundle for ``--code local``, never a file the gate
could not decode, never a module outside the user's code, never a file larger than its cap read
whole, and an opt-in that travels in the manifest said before it runs. Each case plants code
that would write a marker file, and checks that the marker is never written, that the refusal
is one line, and that the exit code is 2."""
from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import resource
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

import nanbisect
from helpers import cli, one_line_exit_2
from nanbisect.task import import_target, load_task

TASK = '''\
import torch
import nanbisect


def task():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: torch.sqrt(m(b) - 100).mean())
'''
# what planted code does when it runs: writes the marker named by the environment
PLANT = "import os\nopen(os.environ['MARKER'], 'w').write('ran')\n"


def captured(tmp_path: Path, source: str = TASK, name: str = "task_xyz.py") -> tuple[Path, Path]:
    """(the entry file, a bundle of its Task captured with its code stored)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    entry = src / name
    entry.write_text(source)
    mod = import_target(str(entry))
    import torch
    bundle = nanbisect.capture(mod.task(), torch.ones(3, 2), tmp_path / "bundle",
                               entry=f"{entry}:task")
    return entry, bundle


def edit_manifest(bundle: Path, change) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def run(bundle: Path, marker: Path, *args: str, cwd: Path | None = None):
    return cli("run", str(bundle), "--no-remedies", "--out", str(marker.parent / "report"),
               *args, env={"MARKER": str(marker)}, cwd=cwd or marker.parent)


def test_a_pyc_planted_in_the_bundles_code_is_refused(tmp_path):
    """An unchecked-hash .pyc under code/<dir>/__pycache__ beside the entry's stored copy: Python
    would import it instead of the source. The bundle is refused before anything runs."""
    entry, bundle = captured(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    stored = bundle / m["code"]["files"][str(entry)]["path"]
    evil = tmp_path / "evil.py"
    evil.write_text(PLANT + TASK)
    cfile = Path(importlib.util.cache_from_source(str(stored)))
    py_compile.compile(str(evil), cfile=str(cfile), dfile=str(stored),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    marker = tmp_path / "marker"
    entry.unlink()               # the local file gone: the stored copy is what would run
    res = run(bundle, marker, "--code", "bundle")
    one_line_exit_2(res, "__pycache__", "is not a stored copy the manifest lists")
    assert not marker.exists()


def test_the_users_files_import_from_source_never_from_cached_bytecode(tmp_path, monkeypatch):
    """A stale or planted unchecked-hash .pyc beside the local entry (and beside a sibling it
    imports): the replay's import compiles the sources, and writes no bytecode."""
    src = tmp_path / "src"
    src.mkdir()
    for name, body in (("entry_pyc_xyz.py", "import sibling_pyc_xyz\n" + TASK),
                       ("sibling_pyc_xyz.py", "X = 1\n")):
        f = src / name
        f.write_text(PLANT + body)
        py_compile.compile(str(f), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        f.write_text(body)       # the source a reader sees: no marker
    for p in (src / "__pycache__").iterdir():
        os.utime(p, (0, 0))
    before = sorted(p.name for p in (src / "__pycache__").iterdir())
    marker = tmp_path / "marker"
    monkeypatch.setenv("MARKER", str(marker))
    task = load_task(f"{src / 'entry_pyc_xyz.py'}:task")
    assert isinstance(task, nanbisect.Task) and not marker.exists()
    assert sorted(p.name for p in (src / "__pycache__").iterdir()) == before
    assert all(p.stat().st_mtime == 0 for p in (src / "__pycache__").iterdir())


def test_unpack_drops_cached_bytecode_with_a_note(tmp_path):
    archive = tmp_path / "ticket.tar.gz"
    data = tmp_path / "data"
    data.mkdir()
    (data / "m.json").write_text("{}")
    (data / "x.pyc").write_bytes(b"\0" * 16)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(data / "m.json", "bundle/manifest.json")
        tar.add(data / "x.pyc", "bundle/code/__pycache__/task.cpython-311.pyc")
        tar.add(data / "x.pyc", "bundle/code/sibling.pyc")
    res = cli("unpack", str(archive), str(tmp_path / "out"))
    assert res.code == 0, res.stderr
    assert "left out 2 cached bytecode file(s)" in res.stderr
    got = sorted(p.relative_to(tmp_path / "out").as_posix()
                 for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == ["bundle/manifest.json"], got


@pytest.mark.parametrize("where", ["inside", "beside"])
def test_code_local_never_imports_a_file_the_manifest_points_at(tmp_path, where):
    """``--code local`` runs the files here. A manifest whose entry_file_from_bundle points into
    the bundle (a planted file there) or beside it (``../task.py`` of an unpacked ticket) is not
    followed: with no local entry, one line says so."""
    entry, bundle = captured(tmp_path)
    planted = bundle / "planted_xyz.py" if where == "inside" else tmp_path / "planted_xyz.py"
    # its task function writes the marker (the gate lets a definition through: it must not
    # be imported at all)
    planted.write_text(TASK.replace("def task():\n", "def task():\n    import os\n"
                                    "    open(os.environ['MARKER'], 'w').write('ran')\n"))
    rel = "planted_xyz.py" if where == "inside" else "../planted_xyz.py"
    edit_manifest(bundle, lambda m: m.update(entry_file_from_bundle=rel))
    entry.unlink()
    marker = tmp_path / "elsewhere" / "marker"
    marker.parent.mkdir()
    res = run(bundle, marker, "--code", "local", cwd=marker.parent)
    assert res.code == 2 and not marker.exists(), res.stdout + res.stderr
    assert "\n" not in res.stderr.strip() and "Traceback" not in res.stderr


def test_a_file_the_gate_reads_as_python_decodes_it(tmp_path):
    """A latin-1 coding cookie and a byte that is not UTF-8: the gate decodes the file as Python
    does and refuses its top-level write (before: it could not decode it, skipped the check,
    and the write ran). A file that cannot be decoded at all is refused, not skipped."""
    body = ("# -*- coding: latin-1 -*-\n# caf\xe9\nimport os\n"
            "open(os.environ['MARKER'], 'w').write('ran')\n" + TASK)
    entry, bundle = captured(tmp_path, source="# placeholder\n" + TASK, name="cookie_xyz.py")
    entry.write_bytes(body.encode("latin-1"))
    marker = tmp_path / "marker"
    res = run(bundle, marker, "--code", "local", "--entry", f"{entry}:task")
    one_line_exit_2(res, "cookie_xyz.py' line 4 runs `open(os.environ['MARKER'], 'w')")
    assert not marker.exists()
    entry.write_bytes(b"# -*- coding: utf-8 -*-\n# \xff\xfe\nimport os\n"
                      b"open(os.environ['MARKER'], 'w').write('ran')\n" + TASK.encode())
    res = run(bundle, marker, "--code", "local", "--entry", f"{entry}:task")
    one_line_exit_2(res, "cookie_xyz.py' line 1", "cannot be decoded")
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["os:abort", "subprocess:getoutput", "json:loads"])
def test_an_entry_naming_the_standard_library_is_refused(tmp_path, entry):
    _, bundle = captured(tmp_path)
    edit_manifest(bundle, lambda m: m.update(entry=entry, entry_file=None,
                                             entry_file_from_bundle=None))
    marker = tmp_path / "marker"
    res = run(bundle, marker)
    one_line_exit_2(res, f"entry module '{entry.split(':')[0]}' is the standard library's")
    assert not marker.exists()


def test_a_code_file_claiming_2_gib_is_refused_under_a_1_gb_limit(tmp_path):
    """The manifest claims a stored file of 2 GiB: refused from the cap before a byte is read,
    in one line, by a process limited to 1 GB of address space (before: one read of it all)."""
    entry, bundle = captured(tmp_path)

    def claim(m):
        info = m["code"]["files"][str(entry)]
        info["bytes"] = 2 << 30
    edit_manifest(bundle, claim)
    stored = bundle / json.loads((bundle / "manifest.json").read_text())["code"]["files"][
        str(entry)]["path"]
    with open(stored, "ab") as f:
        f.truncate(2 << 30)      # sparse: the size it claims
    entry.unlink()

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    env = {**os.environ, "MARKER": str(tmp_path / "marker")}
    p = subprocess.run([sys.executable, "-m", "nanbisect", "run", str(bundle), "--code", "bundle",
                        "--out", str(tmp_path / "report")], capture_output=True, text=True,
                       env=env, preexec_fn=limit, timeout=300)
    line = p.stderr.strip()
    assert p.returncode == 2 and "\n" not in line, p.stderr[-2000:]
    assert "claims 2147483648 bytes, over the 2097152-byte cap" in line, line


def test_an_opt_in_from_the_manifest_is_said_before_it_runs(tmp_path):
    """Task(run_top_level=True) travels in the manifest: the replay says so on the terminal,
    in one line, before the top level runs; inspect shows it."""
    source = TASK.replace("lambda m, b: torch.sqrt(m(b) - 100).mean())",
                          "lambda m, b: torch.sqrt(m(b) - 100).mean(), run_top_level=True)")
    source = "import os, sys\nprint('TOP LEVEL RAN', file=sys.stderr, flush=True)\n" + source
    entry, bundle = captured(tmp_path, source=source, name="optin_xyz.py")
    marker = tmp_path / "marker"
    res = run(bundle, marker)
    assert res.code == 1, res.stdout + res.stderr
    said = [i for i, line in enumerate(res.stderr.splitlines()) if "opts in to running its "
            "entry's top level" in line]
    ran = [i for i, line in enumerate(res.stderr.splitlines()) if "TOP LEVEL RAN" in line]
    assert said and ran and said[0] < ran[0], res.stderr
    shown = cli("inspect", str(bundle))
    assert shown.code == 0 and "run_top_level=True" in shown.stdout, shown.stdout
