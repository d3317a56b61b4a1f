"""`nanbisect clean` when a removal fails (issue 39): on a read-only file system, with a file
that has the immutable attribute, with a mount inside a leftover. One line per leftover it could
not remove (the path, the reason, what is left of it), the rest of the clean goes on, exit 1; it
never enters another file system, so nothing on a mount is deleted. `remove` never raises on an
OSError of one leftover, and a `min_age` that is not a finite number >= 0 is refused
(`BadInput`; a NaN made every leftover, however fresh, "old")."""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess

import pytest

from helpers import aged, cli, invoke, tree_digest
from helpers.mounts import read_only, tmpfs

from nanbisect.bundle.leftovers import find_leftovers, remove, why_kept
from nanbisect.errors import BadInput
from nanbisect.util.staging import MARKER, is_marked, make_staging_dir, mark

SOME_FAILED = 1     # clean's exit code when some leftover could not be (wholly) removed


def leftover(parent, tag="0123abcd", files=("model.safetensors", "rank0/opt.safetensors")):
    """A marked staging directory holding ``files`` (100 bytes each), written 3 days ago."""
    d = make_staging_dir(parent / f".step000001.tmp-{tag}", parents=True)
    for f in files:
        (d / f).parent.mkdir(parents=True, exist_ok=True)
        (d / f).write_bytes(b"x" * 100)
    aged(d)
    return d


def one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@contextlib.contextmanager
def immutable(path):
    """``path`` with the immutable attribute (`chattr +i`): not even root may unlink it."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr binary here to set the immutable attribute")
    p = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot set the immutable attribute here: {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@contextlib.contextmanager
def bound(src, dst):
    """The directory ``src`` bind-mounted (read-write) on the new directory ``dst``: the same
    file system (the same st_dev) seen at a second place."""
    dst.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {p.stderr.strip()}; needs root with "
                    "CAP_SYS_ADMIN")
    try:
        yield dst
    finally:
        if subprocess.run(["umount", str(dst)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(dst)], capture_output=True)


def test_clean_goes_on_past_a_read_only_file_system(tmp_path):
    """A real process: a leftover on a read-only bind mount gets one line on stderr naming it
    and "Read-only file system" (before: a 19-line traceback, exit 1, and the leftover in the
    next directory was never looked at); the one in the next directory is removed."""
    ro_dir, other = tmp_path / "ro", tmp_path / "other"
    stuck, gone = leftover(ro_dir), leftover(other, "89abcdef")
    before = tree_digest(ro_dir)
    with read_only(ro_dir):
        res = cli("clean", ro_dir, other, "--min-age", "0", fresh=True)
        assert res.code == SOME_FAILED, res.stdout + res.stderr
        line = one_line(res.stderr)
        assert f"cannot remove {stuck}: Read-only file system" in line, line
        assert "nothing in it was removed" in line, line
        assert not gone.exists() and f"removed {gone}" in res.stdout, res.stdout
        assert "removed 1 leftover(s)" in res.stdout and "could not remove 1" in res.stdout
        assert tree_digest(ro_dir) == before and is_marked(stuck)


def test_clean_says_what_is_left_beside_an_immutable_file(tmp_path):
    """A leftover holding a file with the immutable attribute: one line naming the leftover, the
    file and "Operation not permitted", and what is left of it; the rest of it removed, its
    marker kept so that a later clean finishes it; the next leftover removed."""
    d = leftover(tmp_path, files=("model.safetensors", "rank0/opt.safetensors",
                                  "rank0/grads.safetensors"))
    after = leftover(tmp_path, "fedcba98")
    stuck = d / "rank0" / "opt.safetensors"
    with immutable(stuck):
        res = invoke("clean", tmp_path, "--min-age", "0")
        assert res.code == SOME_FAILED, res.stdout + res.stderr
        line = one_line(res.stderr)
        assert f"cannot remove {d}: Operation not permitted (at {stuck})" in line, line
        assert "left in it: 1 file(s), 100 bytes, and its marker" in line, line
        assert not after.exists() and "removed 1 leftover(s)" in res.stdout, res.stdout
        assert sorted(p.name for p in d.rglob("*")) == sorted([MARKER, "rank0",
                                                               "opt.safetensors"])
        assert stuck.read_bytes() == b"x" * 100 and is_marked(d)
    res = invoke("clean", tmp_path, "--min-age", "0")      # the attribute gone: finished
    assert res.code == 0 and f"removed {d}" in res.stdout and not d.exists(), res.stdout


def test_clean_never_enters_a_mount_inside_a_leftover(tmp_path):
    """A tmpfs mounted inside a leftover (before: everything on it deleted, then EBUSY and a
    traceback): the leftover is kept, with the mount point as the reason, nothing in it or on
    the mount removed, and its bytes are not counted."""
    d = leftover(tmp_path)
    with tmpfs(d / "rank1", "1m") as mnt:
        (mnt / "weights.bin").write_bytes(b"mounted" * 10)
        aged(d)
        before = tree_digest(d)
        [x] = find_leftovers([tmp_path])
        assert x.bytes == 200 + (d / MARKER).stat().st_size      # the mount's not counted
        res = invoke("clean", tmp_path, "--min-age", "0", "--dry-run")
        assert res.code == 0 and f"would keep {d}: holds a mount point at {mnt}" in res.stdout
        res = invoke("clean", tmp_path, "--min-age", "0")
        assert res.code == 0 and f"kept {d}: holds a mount point at {mnt}" in res.stdout, \
            res.stdout + res.stderr
        assert res.stderr == "" and "removed 0 leftover(s)" in res.stdout
        assert tree_digest(d) == before and os.path.ismount(mnt)


def test_clean_never_enters_a_bind_mount_of_the_same_file_system(tmp_path):
    """A user's directory bind-mounted inside a leftover has the leftover's st_dev; the mount
    table still shows it: kept, the user's files untouched (before: deleted)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    d = leftover(tmp_path / "out")
    with bound(mine, d / "rank1") as mnt:
        aged(d)
        res = invoke("clean", tmp_path / "out", "--min-age", "0")
        assert res.code == 0 and f"kept {d}: holds a mount point at {mnt}" in res.stdout, \
            res.stdout + res.stderr
    assert (mine / "thesis.tex").read_text() == "precious"
    assert (d / "model.safetensors").exists()


def test_clean_keeps_a_leftover_that_is_a_mount_point(tmp_path):
    """A tmpfs mounted on a staging-shaped, marked directory: kept, nothing on it removed."""
    d = tmp_path / ".step000001.tmp-0123abcd"
    with tmpfs(d, "1m"):
        (d / "model.safetensors").write_bytes(b"x" * 10)
        mark(d)
        aged(d)
        res = invoke("clean", tmp_path, "--min-age", "0")
        assert res.code == 0 and f"kept {d}: is a mount point" in res.stdout, res.stdout
        assert (d / "model.safetensors").exists()


@pytest.mark.parametrize("how", ["tmpfs", "bind"])
def test_the_removal_itself_never_enters_a_mount(tmp_path, monkeypatch, how):
    """Should a file system be mounted in a leftover after `why_kept` looked (a race, played
    here by a `why_kept` that always says yes), the removal checks each directory's st_dev and
    the mount table before it enters it: the mount untouched, the leftover a failure, still
    marked."""
    from nanbisect.bundle import leftovers

    monkeypatch.setattr(leftovers, "why_kept", lambda *a, **k: None)
    mine = tmp_path / "mine"
    mine.mkdir()
    d = leftover(tmp_path / "out")
    mount = tmpfs(d / "rank1", "1m") if how == "tmpfs" else bound(mine, d / "rank1")
    with mount as mnt:
        (mnt / "weights.bin").write_bytes(b"mounted")
        removed, kept, [f] = remove(find_leftovers([tmp_path / "out"]), min_age=0)
        assert (removed, kept) == ([], []) and os.path.realpath(mnt) in leftovers.mount_points()
        assert (f.path, f.reason, f.failures) == (mnt, "holds a mount point, not entered", 1)
        assert (mnt / "weights.bin").read_bytes() == b"mounted" and f.marked and is_marked(d)
        assert not (d / "model.safetensors").exists()       # the rest of it removed
    assert how == "tmpfs" or (mine / "weights.bin").read_bytes() == b"mounted"


def test_remove_records_failures_and_never_raises(tmp_path):
    """The library: an OSError while removing one leftover is returned, not raised, and the
    next leftover is removed."""
    ro_dir = tmp_path / "ro"
    stuck, gone = leftover(ro_dir), leftover(tmp_path, "89abcdef")
    with read_only(ro_dir):
        removed, kept, failed = remove(find_leftovers([ro_dir, tmp_path]), min_age=0)
    assert [x.path for x in removed] == [gone] and kept == []
    [f] = failed
    assert f.leftover.path == stuck and f.reason == "Read-only file system"
    assert (f.left_files, f.left_bytes, f.removed, f.marked) == (2, 200, 0, True)
    assert str(f).startswith(f"cannot remove {stuck}: Read-only file system (")


@pytest.mark.parametrize("bad", [math.nan, -math.inf, math.inf, -5.0, -1e-9])
def test_min_age_must_be_finite_and_not_negative(tmp_path, bad):
    """``min_age`` nan made `now - newest < min_age` False: a leftover written 0 s ago (maybe a
    running capture) was removed; -5 acted as 0. Refused, and nothing removed."""
    d = make_staging_dir(tmp_path / ".step000001.tmp-0123abcd")     # written just now
    [x] = find_leftovers([tmp_path])
    with pytest.raises(BadInput, match="min_age"):
        why_kept(x, bad)
    with pytest.raises(BadInput, match="min_age"):
        remove([x], bad)
    assert is_marked(d)
    res = invoke("clean", tmp_path, "--min-age", str(bad))
    assert res.code == 2 and "--min-age" in one_line(res.stderr), res.stdout + res.stderr
    assert is_marked(d)
