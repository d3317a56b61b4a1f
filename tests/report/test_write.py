"""`run --out` never deletes what nanbisect did not write (report/write.py): existing
directories that are not reports, the bundle, paths inside it or above it, files, links, a
report someone added files to or edited, and a report from before the marker (which cannot be
proven unedited) are refused with exit 2 and left byte for byte; an earlier report is replaced.
An --out that cannot be written (a full, read-only or busy file system, no permission) is one
line, exit 2, with nothing written."""
from __future__ import annotations

import os

import pytest
from helpers import cli, invoke, one_line_exit_2, tree_digest
from helpers.mounts import mode_bits_apply, read_only, tmpfs
from safetensors.torch import save_file

from nanbisect.errors import BadInput
from nanbisect.report.write import MARKER, check_out, is_report_dir, older_report, staged
from nanbisect.util.staging import MARKER as STAGING_MARKER
from nanbisect.util.staging import is_marked


def refused(bundle, out, words: str):
    before_bundle = tree_digest(bundle)
    res = invoke("run", bundle, "--out", out)
    assert res.code == 2, res.stdout + res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and words in line, line
    assert tree_digest(bundle) == before_bundle
    return line


def test_existing_user_directory_is_refused_and_kept(fixture_bundle, tmp_path):
    b = fixture_bundle("nan_batch")
    mine = tmp_path / "results"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "sub" / "data.csv").write_text("1,2,3")
    before = tree_digest(mine)
    line = refused(b, mine, "is not a nanbisect report")
    assert "thesis.tex" in line and "new or empty directory" in line
    assert tree_digest(mine) == before


@pytest.mark.parametrize("where", ["bundle", "inside", "parent", "file", "link"])
def test_paths_that_would_lose_data_are_refused(fixture_bundle, tmp_path, where):
    b = fixture_bundle("nan_batch")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    out = {"bundle": b, "inside": b / "sub" / "report", "parent": tmp_path,
           "file": target / "keep.txt", "link": tmp_path / "ln"}[where]
    if where == "link":
        os.symlink(target, out)
    words = {"bundle": "is the bundle itself", "inside": "is inside the bundle",
             "parent": "holds the bundle", "file": "is a file", "link": "symbolic link"}[where]
    refused(b, out, words)
    assert (target / "keep.txt").read_text() == "keep"
    assert not (b / "sub").exists()


def test_report_is_replaced_but_not_with_a_users_file_in_it(fixture_bundle, tmp_path):
    b = fixture_bundle("nan_batch")
    out = tmp_path / "r"
    assert invoke("run", b, "--out", out).code == 1
    assert is_report_dir(out) and (out / MARKER).is_file()
    first = (out / "report.json").stat().st_mtime_ns
    assert invoke("run", b, "--out", out).code == 1      # our own report: replaced
    assert (out / "report.json").stat().st_mtime_ns != first
    (out / "my-notes.md").write_text("triage notes")
    line = refused(b, out, "was not written by nanbisect")
    assert "my-notes.md" in line
    assert (out / "my-notes.md").read_text() == "triage notes"


def test_default_report_and_empty_directory_are_accepted(fixture_bundle, tmp_path):
    b = fixture_bundle("nan_batch")
    res = cli("run", b)          # the default BUNDLE/nanbisect-report, twice, end to end
    assert res.code == 1 and cli("run", b).code == 1, res.stderr
    assert is_report_dir(b / "nanbisect-report")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("run", b, "--out", empty).code == 1
    assert (empty / "report.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging left


def test_an_edited_report_file_is_not_replaced(fixture_bundle, tmp_path):
    b = fixture_bundle("nan_batch")
    out = tmp_path / "r"
    assert invoke("run", b, "--out", out).code == 1
    (out / "report.md").write_text("my triage notes, written into the report")
    line = refused(b, out, "was not written by nanbisect")
    assert "report.md" in line
    assert (out / "report.md").read_text() == "my triage notes, written into the report"


def test_report_from_before_the_marker_is_refused_not_replaced(fixture_bundle, tmp_path):
    """Recognised by its names and report.json's schema, but nothing proves it unedited: a
    report.md the user wrote notes into must not be replaced. One line says how to proceed."""
    old = tmp_path / "old"
    (old / "repro").mkdir(parents=True)
    (old / "report.json").write_text('{"schema": "nanbisect.report/1"}')
    (old / "report.md").write_text("# old report\n\nmy notes: the loader's shard 7 is bad")
    (old / "repro" / "repro.py").write_text("# ours")
    assert older_report(old) and not is_report_dir(old)
    with pytest.raises(BadInput, match="older nanbisect"):
        check_out(old)
    before = tree_digest(old)
    line = refused(fixture_bundle("nan_batch"), old, "written by an older nanbisect")
    assert "another --out" in line and "move it away" in line
    assert tree_digest(old) == before
    # a marker without the file list (the first marker format) proves nothing either
    (old / MARKER).write_text('{"schema": "nanbisect.report/1"}')
    assert older_report(old) and not is_report_dir(old)
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / MARKER).write_text("not json")
    (forged / "x").write_text("user")
    assert not is_report_dir(forged) and not older_report(forged)


def test_the_staging_directory_carries_the_marker_and_the_report_does_not(tmp_path):
    out = tmp_path / "r"
    with staged(out) as tmp:
        assert is_marked(tmp) and tmp.parent == tmp_path     # `nanbisect clean` may take it
        (tmp / "report.json").write_text('{"schema": "nanbisect.report/1"}')
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "report.json"]
    assert STAGING_MARKER not in (out / MARKER).read_text() and is_report_dir(out)
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


@pytest.mark.parametrize("fixture,size", [("nan_batch", "4k"),
                                          ("forward_nan_behind_mask", "16k")])
def test_out_on_a_full_file_system_is_one_line(fixture_bundle, tmp_path, fixture, size):
    """ENOSPC from report.md (nan_batch) and from the repro's tensors, which safetensors raises
    as its own SafetensorError (forward_nan_behind_mask): exit 2, nothing left there."""
    b = fixture_bundle(fixture)
    with tmpfs(tmp_path / "full", size) as fs:
        res = invoke("run", b, "--out", fs / "deeper" / "r")
        one_line_exit_2(res, "No space left on device", "nothing was written")
        assert list(fs.iterdir()) == []       # no staging, no half report, no `deeper/`


def test_out_on_an_empty_mount_point_is_one_line(fixture_bundle, tmp_path):
    """The report directory is renamed into place, which a mount point cannot be (EBUSY):
    refused before the replay."""
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        line = one_line_exit_2(invoke("run", fixture_bundle("nan_batch"), "--out", mnt),
                               "is a mount point", "inside it")
        assert list(mnt.iterdir()) == [] and "nanbisect-report" not in line


def test_out_on_a_read_only_file_system_is_one_line(fixture_bundle, tmp_path):
    with read_only(tmp_path / "ro") as ro:
        one_line_exit_2(invoke("run", fixture_bundle("nan_batch"), "--out", ro / "r"),
                        "Read-only file system")
        assert list(ro.iterdir()) == []


def test_out_without_permission_is_one_line(fixture_bundle, tmp_path):
    """EACCES by mode bits: as root only with CAP_DAC_OVERRIDE dropped (tests/helpers/mounts.py)."""
    b = fixture_bundle("nan_batch")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with mode_bits_apply():
            res = invoke("run", b, "--out", locked / "sub" / "r")
    finally:
        locked.chmod(0o755)
    one_line_exit_2(res, "Permission denied")
    assert list(locked.iterdir()) == []


def test_a_failed_write_in_the_block_is_bad_input_and_keeps_the_old_report(tmp_path):
    """`staged` itself, on a real full tmpfs: the earlier report survives a replacement that
    runs out of room, and a SafetensorError from the repro writer is one line too."""
    with tmpfs(tmp_path / "fs", "64k") as fs:
        out = fs / "r"
        with staged(out) as tmp:
            (tmp / "report.json").write_text('{"schema": "nanbisect.report/1", "n": 1}')
        before = tree_digest(out)
        import torch
        with pytest.raises(BadInput, match="No space left on device"):
            with staged(out) as tmp:
                save_file({"x": torch.zeros(1 << 16)}, str(tmp / "inputs.safetensors"))
        assert tree_digest(out) == before and sorted(p.name for p in fs.iterdir()) == ["r"]


def test_report_and_repro_files_follow_the_umask(fixture_bundle, tmp_path):
    """safetensors writes 0600; a colleague must be able to read the repro's inputs."""
    b = fixture_bundle("forward_nan_behind_mask")
    old = os.umask(0o022)
    try:
        res = cli("run", b, "--out", tmp_path / "r")
    finally:
        os.umask(old)
    assert res.code == 1, res.stderr
    modes = {p.relative_to(tmp_path / "r").as_posix(): p.stat().st_mode & 0o777
             for p in [tmp_path / "r", *(tmp_path / "r").rglob("*")]}
    assert modes["repro/inputs.safetensors"] == 0o644
    assert {m for p, m in modes.items() if (tmp_path / "r" / p).is_dir()} == {0o755}, modes
    assert {m for p, m in modes.items() if (tmp_path / "r" / p).is_file()} == {0o644}, modes
