"""Bundles carry their code: a bundle captured in one tree, packed with --full, replays to the
same culprit after that tree is deleted, unpacked into another (empty) tree, with a note that
the bundle's copy of the code ran; a ticket packed without --full says so in one line; a stored
copy's path that leaves the bundle, or a stored copy that was altered, is refused."""
from __future__ import annotations

import json
import shutil
import tarfile

import pytest
from helpers import TASKS, cli, one_line_exit_2, run_python

CAPTURE = """\
import sys
sys.path.insert(0, {tasks!r})
import nanbisect
import forward_nan_behind_mask as t
task = t.task()
nanbisect.capture(task, next(t.batches()), {out!r},
                  entry={entry!r}, step=1)
"""


def _capture(tree, tmp_path):
    """The task file and its sibling copied into ``tree``, a bundle captured there in a process
    of its own; the bundle's path."""
    tasks = tree / "tasks"
    tasks.mkdir(parents=True)
    for name in ("forward_nan_behind_mask.py", "tinygpt.py"):
        shutil.copy(TASKS / name, tasks / name)
    script = tree / "capture.py"
    bundle = tree / "bundles" / "step1"
    entry = f"{tasks / 'forward_nan_behind_mask.py'}:task"
    script.write_text(CAPTURE.format(tasks=str(tasks), out=str(bundle), entry=entry))
    res = run_python([str(script)], cwd=tree, fresh=True)
    assert res.code == 0, res.stderr[-3000:]
    return bundle


def _culprit(report: dict) -> tuple:
    c = report["culprit"]
    return c["op"], c["module"], report["phase"]


@pytest.mark.slow
def test_a_ticket_replays_with_its_own_code_after_the_tree_is_gone(tmp_path):
    tree_a = tmp_path / "a"
    bundle = _capture(tree_a, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    stored = {v["path"] for v in manifest["code"]["files"].values()}
    assert {"code/tasks/forward_nan_behind_mask.py", "code/tasks/tinygpt.py"} <= stored
    assert manifest["code"]["import_roots"][0] == "tasks"      # the entry's directory first
    first = cli("run", bundle, "--json", cwd=tree_a)
    assert first.code == 1, first.stderr[-3000:]
    here = json.loads(first.stdout)
    assert any("the code ran from the files here" in n for n in here["notes"]), here["notes"]

    ticket = tmp_path / "ticket.tar.gz"
    assert cli("pack", bundle, "-o", ticket, "--full").code == 0
    thin = tmp_path / "thin.tar.gz"
    res = cli("pack", bundle, "-o", thin)
    assert res.code == 0 and "left out the model and optimizer state" in res.stderr, res.stderr
    names = tarfile.open(thin).getnames()
    assert "bundle/code/tasks/tinygpt.py" in names and "bundle/model.safetensors" not in names
    shutil.rmtree(tree_a)

    tree_b = tmp_path / "b"          # another user's tree: nothing of tree A in it
    tree_b.mkdir()
    dest = tree_b / "ticket"
    assert cli("unpack", ticket, dest, cwd=tree_b).code == 0
    again = cli("run", dest / "bundle", "--json", cwd=tree_b)
    assert again.code == 1, again.stderr[-3000:]
    there = json.loads(again.stdout)
    assert _culprit(there) == _culprit(here)
    assert any("the bundle's copy of the code ran" in n for n in there["notes"]), there["notes"]
    # the stored copy is the captured code: nothing changed, nothing missing
    assert there["replay"]["code_changed"] == [] == there["replay"]["code_missing"], there["replay"]
    assert not list((dest / "bundle" / "code").rglob("__pycache__"))   # nothing written there

    unpacked = tmp_path / "thin"
    assert cli("unpack", thin, unpacked).code == 0
    line = one_line_exit_2(cli("run", unpacked / "bundle"), "packed without --full",
                           "report/repro/repro.py", "nanbisect pack --full")
    assert "listed in the manifest is missing" not in line
    one_line_exit_2(cli("run", ticket), "nanbisect unpack")
    one_line_exit_2(cli("run", dest / "bundle" / "nanbisect-report"), "report directory",
                    str(dest / "bundle"))


def test_local_and_bundle_code_and_hostile_paths(tmp_path):
    """In process: --code bundle imports the stored copy (its sibling too), --code local the
    tree's; a stored path that escapes the bundle or an altered copy is refused."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.errors import BadInput
    from nanbisect.guard.freeze import capture
    from nanbisect.replay.replayer import code_choice
    from nanbisect.task import import_target

    tasks = import_target(str(TASKS / "forward_nan_behind_mask.py"))
    bundle = capture(tasks.task(), next(tasks.batches()), tmp_path / "b",
                     entry=f"{TASKS / 'forward_nan_behind_mask.py'}:task", step=1)
    b = read_bundle(bundle)
    entry, note = code_choice(b, "bundle")
    assert entry.startswith(str(bundle / "code")) and "--code bundle" in note
    entry, note = code_choice(b)
    assert entry.startswith(str(TASKS)) and "files here" in note
    assert code_choice(b, "local")[0].startswith(str(TASKS))

    m = json.loads((bundle / "manifest.json").read_text())
    key = next(iter(m["code"]["files"]))
    for bad in ("code/../model.safetensors.py", "/etc/x.py", "code//x.py"):
        m2 = json.loads(json.dumps(m))
        m2["code"]["files"][key]["path"] = bad
        (bundle / "manifest.json").write_text(json.dumps(m2))
        with pytest.raises(BadInput, match="stored copy"):
            read_bundle(bundle)
    (bundle / "manifest.json").write_text(json.dumps(m))
    stored = bundle / m["code"]["files"][key]["path"]
    text = stored.read_text()
    stored.write_text(text + "\n# altered\n")
    with pytest.raises(BadInput, match="does not match its sha256"):
        read_bundle(bundle)
    outside = tmp_path / "outside.py"         # same bytes, but reached through a link
    outside.write_text(text)
    stored.unlink()
    stored.symlink_to(outside)
    with pytest.raises(BadInput, match="symbolic link"):
        read_bundle(bundle)


def _captured(tmp_path):
    """A bundle of forward_nan_behind_mask captured in process, its stored code under code/."""
    from nanbisect.guard.freeze import capture
    from nanbisect.task import import_target

    tasks = import_target(str(TASKS / "forward_nan_behind_mask.py"))
    return capture(tasks.task(), next(tasks.batches()), tmp_path / "b",
                   entry=f"{TASKS / 'forward_nan_behind_mask.py'}:task", step=1)


def test_a_file_under_code_the_manifest_does_not_list_is_refused_and_not_packed(tmp_path):
    """A planted code/evil.py (beside the stored sibling a replay imports) is refused when the
    bundle is read, and a pack without --full leaves it out; so is a planted __pycache__."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.bundle.pack import _members
    from nanbisect.errors import BadInput

    bundle = _captured(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    listed = {v["path"] for v in m["code"]["files"].values()}
    home = (bundle / sorted(listed)[0]).parent
    cache = home / "__pycache__"
    cache.mkdir()
    (cache / "tinygpt.cpython-311.pyc").write_bytes(b"\0")
    # cached bytecode is refused too: Python would import it instead of the listed source
    with pytest.raises(BadInput, match="__pycache__/tinygpt.cpython-311.pyc is not a stored "
                                       "copy the manifest lists"):
        read_bundle(bundle)
    (cache / "tinygpt.cpython-311.pyc").unlink()
    cache.rmdir()
    read_bundle(bundle)
    evil = home / "evil.py"
    evil.write_text("import os\nos.system('touch pwned')\n")
    rel = evil.relative_to(bundle).as_posix()
    with pytest.raises(BadInput, match=f"{rel} is not a stored copy the manifest lists"):
        read_bundle(bundle)
    (bundle / "nanbisect-report").mkdir()
    (bundle / "nanbisect-report" / "report.json").write_text("{}")
    packed = {name for _, name in _members(bundle, full=False)}
    assert {f"bundle/{p}" for p in listed} <= packed, packed
    assert f"bundle/{rel}" not in packed and not any("__pycache__" in n for n in packed), packed
    assert f"bundle/{rel}" in {name for _, name in _members(bundle, full=True)}


def test_ranks_leaving_out_the_lowest_rank_still_verifies_the_stored_code(tmp_path):
    """The code of a multi-rank run is chosen on its lowest rank's part, which ``--ranks 1``
    reads without verifying: an altered stored copy there is refused before it is imported."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.errors import BadInput
    from nanbisect.pipeline.common import RunOptions
    from nanbisect.pipeline.run import _source, _which_code

    bundle = _captured(tmp_path)
    m = json.loads((bundle / "manifest.json").read_text())
    stored = bundle / m["code"]["files"][m["code"]["entry_file"]]["path"]

    class TwoRanks:            # rank 0's part is this bundle, read unverified (as --ranks 1 does)
        multi_rank = True
        manifest = {"ranks": {"1": {}, "0": {}}}

        def part(self, rank, verify=True):
            assert rank == 0 and not verify
            return read_bundle(bundle, verify=False)

    two = TwoRanks()
    opts, note = _which_code(two, _source(two), RunOptions(code="bundle"))
    assert opts.entry.startswith(str(bundle / "code")) and "--code bundle" in note
    stored.write_text(stored.read_text() + "\nimport os  # altered\n")
    with pytest.raises(BadInput, match="does not match its sha256"):
        _which_code(two, _source(two), RunOptions(code="bundle"))
    # the local files chosen: the stored copy is not imported, not read
    local, _ = _which_code(two, _source(two), RunOptions(code="local"))
    assert local.entry.startswith(str(TASKS))
