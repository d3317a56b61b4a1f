"""Every path a user gives is checked before use (issue 62): a component over the file system's
255 bytes, an empty path where a directory is written, a NUL byte: one line, exit 2, for every
command (they gave a ~45-line traceback, and ``--entry``/``--inject`` an internal error, exit 4;
``run --out ''`` wrote into the working directory)."""
from __future__ import annotations

import pytest

from helpers import FIXTURES, invoke, one_line_exit_2

LONG = "x" * 300
SQRT = str(FIXTURES / "forward_nan_behind_mask")


@pytest.mark.parametrize("args, names", [
    (["inspect", f"/tmp/{LONG}"], "BUNDLE"),
    (["clean", f"/tmp/{LONG}"], "DIRS"),
    (["triage", f"/tmp/{LONG}"], "DIRS"),
    (["unpack", "/tmp/a.tar.gz", f"/tmp/{LONG}"], "DEST"),
    (["run", "--ckpt", SQRT, "--out", f"/tmp/{LONG}"], "--out"),
    (["run", f"/tmp/{LONG}"], "BUNDLE"),
    (["pack", SQRT, "-o", f"/tmp/{LONG}"], "--output"),
    (["run", "--ckpt", SQRT, "--entry", f"/tmp/{LONG}.py:task"], "--entry's file"),
    (["run", "--ckpt", SQRT, "--inject", f"/tmp/{LONG}.py:corrupt"], "--inject's file"),
], ids=["inspect", "clean", "triage", "unpack", "run-out", "run-bundle", "pack-o", "entry",
        "inject"])
def test_a_name_over_the_file_systems_length_is_one_line(tmp_path, args, names):
    line = one_line_exit_2(invoke(*args), names, "bytes, over the 255 a file name may have")
    assert len(line) < 400


@pytest.mark.parametrize("args, names", [
    (["run", "--ckpt", SQRT, "--out", ""], "--out '' is empty; pass a directory (. for this one)"),
    (["run", "--ckpt", SQRT, "--out="], "--out '' is empty"),
    (["inspect", ""], "BUNDLE '' is empty"),
    (["pack", SQRT, "-o", ""], "--output '' is empty"),
])
def test_an_empty_path_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch,
                                                                     args, names):
    monkeypatch.chdir(tmp_path)
    one_line_exit_2(invoke(*args), names)
    assert list(tmp_path.iterdir()) == []        # nothing written here
