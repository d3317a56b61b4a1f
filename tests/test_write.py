"""`run --out` never deletes what nanbisect did not write (report/write.py): existing
directories that are not reports, the bundle, paths inside it or above it, files, links, and a
report someone added files to are refused with exit 2 and left byte for byte; an earlier report
is replaced."""
from __future__ import annotations

import hashlib
import os

import pytest
from conftest import cli, invoke

from nanbisect.report.write import MARKER, check_out, is_report_dir


def tree_digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


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


def test_report_without_marker_from_an_older_version_is_recognised(tmp_path):
    old = tmp_path / "old"
    (old / "repro").mkdir(parents=True)
    (old / "report.json").write_text('{"schema": "nanbisect.report/1"}')
    (old / "report.md").write_text("# old")
    assert is_report_dir(old) and check_out(old) == old
    (old / "repro" / "repro.py").write_text("# ours")
    assert is_report_dir(old)
    (old / "repro" / "my_fix.py").write_text("# the user's")      # inside repro/ too
    assert not is_report_dir(old)
    (old / "repro" / "my_fix.py").unlink()
    (old / "extra.txt").write_text("user")
    assert not is_report_dir(old)
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / MARKER).write_text("not json")
    (forged / "x").write_text("user")
    assert not is_report_dir(forged)


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
