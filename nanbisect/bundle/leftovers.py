"""Leftovers of writes that never finished: the hidden staging directories a killed capture or a
killed report write leaves beside its final path.

Every bundle and report is written into ``.NAME.tmp-XXXXXXXX`` beside ``NAME`` and renamed into
place only when complete (a report being replaced also moves the old one to
``.NAME.old-XXXXXXXX`` for a moment), so a process killed half-way leaves such a directory and
never a directory that looks complete. Each carries the marker nanbisect wrote into it when it
made it (`nanbisect.util.staging.MARKER`). This module finds them and removes them.

Where it looks (`find_leftovers`): only where nanbisect stages its writes: in each directory it
is given (a Guard ``out``, the parent of a ``--out``, of an unpacked pack, or a bundle), in each
bundle directly inside one (its report's staging), and in and beside each bundle it is told of
(``beside``: triage and ``inspect`` pass the bundles they found). It never enters another
subdirectory, a hidden directory, a link, or a staging directory without the marker.

Guarantees: `find_leftovers` only reads directory entries, sizes and markers; `remove` deletes
only directories whose name has exactly that shape, that carry a valid marker (a name alone,
``.ssh.old-20240101``, is never enough: such a directory is listed and kept, as are staging
directories of nanbisect versions before the marker), that hold nothing but regular files and
directories (no links), that are not and hold no mount point (another file system, or a bind
mount of this one, listed in /proc/self/mountinfo), and that nothing has written to for
``min_age`` seconds (a capture still being written by another process is left alone); every
kept one comes with the reason. Neither function ever enters another file system. A removal that
fails part-way (a read-only file system, an immutable file) never raises: `remove` returns it
with the reason and what is left, goes on with the next leftover, and keeps the leftover's marker
while anything else is left in it, so that a later `remove` finishes it.
Not guaranteed: that a young leftover belongs to a live process (there is no lock to ask).
"""
from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nanbisect.bundle.where import MANIFEST
from nanbisect.util.numbers import NUMBERS
from nanbisect.util.staging import MARKER, is_marked, staging_kind

MIN_AGE = 600.0     # seconds without a write before `remove` takes a leftover
MAX_DIRS = 100_000  # directories looked at under one root


@dataclass(frozen=True)
class Leftover:
    """One unfinished write: where, how many bytes, how long since anything in it changed, and
    whether it carries nanbisect's marker (without one, it is neither measured nor removed)."""

    path: Path
    bytes: int | None   # None: no marker, not looked into
    age_s: float        # since anything in it changed (without a marker: the directory itself)
    kind: str           # "tmp": a write that never finished; "old": a replaced report not removed
    marked: bool = True

    def to_json(self) -> dict:
        return {"path": str(self.path), "bytes": self.bytes, "age_s": round(self.age_s, 1),
                "kind": self.kind, "marked": self.marked}


def walk(root: Path, max_dirs: int | None = None) -> Iterator[tuple[str, list[str], list[str]]]:
    """`os.walk` top-down without following links, iterative (Python 3.11's os.walk recurses and
    raises RecursionError on a tree 1,000 deep), stopping after ``max_dirs`` directories.
    Prune by editing the yielded ``dirnames`` in place, as with `os.walk`."""
    stack, seen = [str(root)], 0
    while stack:
        top = stack.pop()
        seen += 1
        if max_dirs is not None and seen > max_dirs:
            return
        try:
            with os.scandir(top) as it:
                entries = list(it)
        except OSError:
            continue
        dirnames = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        filenames = [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
        yield top, dirnames, filenames
        stack.extend(os.path.join(top, d) for d in reversed(dirnames))


def _walk(root: Path, mounts: set[str]) -> tuple[int, float, bool, list[Path]]:
    """(bytes, newest mtime, only regular files and directories, the directories below it on
    another file system or mounted (``mounts``, `mount_points`: a bind mount of this one too))
    of everything under ``root``, at most `MAX_DIRS` directories; those are not entered."""
    top = os.lstat(root)
    real = os.path.realpath(root)
    total, newest, plain, other = 0, top.st_mtime, True, []
    for dirpath, dirnames, filenames in walk(root, MAX_DIRS):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and (st.st_dev != top.st_dev or os.path.join(
                    real, os.path.relpath(os.path.join(dirpath, name), root)) in mounts):
                other.append(Path(dirpath, name))
                dirnames.remove(name)       # a mount point: never entered, never measured
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                plain = False       # a link or a device: not something we write
            newest = max(newest, st.st_mtime)
    return total, newest, plain, other


def mount_points() -> set[str]:
    """Every mount point of this process (from /proc/self/mountinfo; empty where that cannot be
    read): a bind mount of a file system shows in it though its st_dev is its source's."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    octal = re.compile(rb"\\([0-7]{3})")      # a space in a path is written \040
    return {os.fsdecode(octal.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), f[4]))
            for f in (line.split(b" ") for line in lines) if len(f) > 4}


def _mounts_in(path: Path, mounts: set[str]) -> list[Path]:
    """The mount points in ``mounts`` at or below ``path``, as paths below ``path``."""
    real = os.path.realpath(path)
    below = real.rstrip("/") + "/"
    return sorted(path / os.path.relpath(m, real) for m in mounts
                  if m == real or m.startswith(below))


def _places(roots: list[Path], beside: list[Path]) -> list[Path]:
    """The directories nanbisect stages writes in, of those ``roots`` and ``beside`` name."""
    out: list[Path] = []
    seen: set = set()

    def add(d: Path) -> None:
        try:
            st = os.lstat(d)
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(d)

    for root in map(Path, roots):
        add(root)
        try:
            with os.scandir(root) as it:
                children = sorted(e.name for e in it if not e.name.startswith(".")
                                  and e.is_dir(follow_symlinks=False))
        except OSError:
            continue
        for name in children[:MAX_DIRS]:
            if os.path.isfile(root / name / MANIFEST):      # a bundle: its report's staging
                add(root / name)
    for b in map(Path, beside):
        add(b)
        add(b.parent)
    return out


def find_leftovers(roots: list[Path], beside: list[Path] = ()) -> list[Leftover]:
    """Every staging directory in ``roots``, in the bundles directly inside them, and in and
    beside the bundles ``beside`` (see the module's docstring): marked ones measured, others
    listed only.

    >>> import tempfile
    >>> from nanbisect.util.staging import make_staging_dir
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = make_staging_dir(d / ".step000001.tmp-0123abcd")
    >>> _ = (d / ".step000001.tmp-0123abcd" / "model.safetensors").write_bytes(b"12345")
    >>> (d / ".ssh.old-20240101").mkdir()
    >>> [(x.path.name, x.kind, x.marked, x.bytes is None) for x in find_leftovers([d])]
    [('.ssh.old-20240101', 'old', False, True), ('.step000001.tmp-0123abcd', 'tmp', True, False)]
    """
    found: list[Leftover] = []
    now = time.time()
    mounts: set[str] | None = None      # the mount table, read once, when a leftover needs it
    for place in _places(list(roots), list(beside)):
        try:
            with os.scandir(place) as it:
                names = sorted(e.name for e in it if staging_kind(e.name)
                               and e.is_dir(follow_symlinks=False))
        except OSError:
            continue
        for d in names:
            p = place / d
            try:
                if is_marked(p):
                    mounts = mount_points() if mounts is None else mounts
                    size, newest, _, _ = _walk(p, mounts)
                    found.append(Leftover(p, size, max(0.0, now - newest), staging_kind(d)))
                else:      # not ours to look into: listed with its own age only
                    age = max(0.0, now - os.lstat(p).st_mtime)
                    found.append(Leftover(p, None, age, staging_kind(d), marked=False))
            except OSError:
                continue
    return found


NO_MARKER = ("no nanbisect marker in it: not made by this version of nanbisect (an older one, or "
             "not nanbisect at all); remove it yourself if you know it is a leftover")


def check_min_age(min_age: float) -> float:
    """``min_age`` when it is a number of seconds within ``--min-age``'s range; else `BadInput`
    (a NaN made every leftover "old": ``age < nan`` is False)."""
    return float(NUMBERS["--min-age"].check(min_age, "clean"))


def why_kept(x: Leftover, min_age: float = MIN_AGE, now: float | None = None) -> str | None:
    """Why `remove` would keep ``x`` (checked on the disk now), or None when it may go.
    `BadInput` when ``min_age`` is out of ``--min-age``'s range (`check_min_age`)."""
    check_min_age(min_age)
    now = time.time() if now is None else now
    try:
        if not staging_kind(x.path.name) or x.path.is_symlink() or not x.path.is_dir():
            return "not a nanbisect staging directory"
        if not is_marked(x.path):
            return NO_MARKER
        table = mount_points()
        mounts = _mounts_in(x.path, table)
        if x.path in mounts or os.lstat(x.path).st_dev != os.lstat(x.path.parent).st_dev:
            return "is a mount point: clean never removes one, nor anything on it"
        _, newest, plain, other = _walk(x.path, table)
    except OSError as e:
        return _reason(e)
    mounts = sorted(set(mounts) | set(other))
    if mounts:
        more = f" and {len(mounts) - 1} more" if len(mounts) > 1 else ""
        return (f"holds a mount point at {mounts[0]}{more}: clean never enters another file "
                f"system; unmount it, then clean again")
    if not plain:
        return "holds links or special files, which nanbisect never writes"
    if now - newest < min_age:
        return (f"written {now - newest:.0f}s ago: may be a capture still running; remove it "
                f"after {min_age:.0f}s or pass --min-age 0")
    return None


def _reason(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) else None) or str(e) or type(e).__name__


@dataclass(frozen=True)
class Failure:
    """A leftover `remove` could not remove (wholly): the first thing that failed and why, how
    many failed, and what is left of it (its marker stays while anything else is left)."""

    leftover: Leftover
    path: Path          # the first file or directory that could not be removed
    reason: str         # its strerror ("Read-only file system")
    failures: int       # how many removals failed in all
    removed: int        # files and directories of it that were removed
    left_files: int     # regular files left in it, its marker aside
    left_bytes: int
    marked: bool        # still carries its marker: a later clean finishes it

    def __str__(self) -> str:
        at = [f"at {self.path}"] if self.path != self.leftover.path else []
        at += [f"{self.failures} removals failed"] if self.failures > 1 else []
        where = f" ({'; '.join(at)})" if at else ""
        if self.removed == 0:
            left = "nothing in it was removed"
        elif self.marked:
            left = (f"left in it: {self.left_files} file(s), {self.left_bytes} bytes, and its "
                    f"marker: clean removes the rest once that is fixed")
        else:
            left = (f"left in it: {self.left_files} file(s), {self.left_bytes} bytes, without "
                    f"its marker: remove the rest yourself")
        return f"cannot remove {self.leftover.path}: {self.reason}{where}; {left}"

    def to_json(self) -> dict:
        return {"path": str(self.leftover.path), "failed": str(self.path),
                "reason": self.reason, "failures": self.failures, "removed": self.removed,
                "left_files": self.left_files, "left_bytes": self.left_bytes,
                "marked": self.marked}


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MOUNT_NOT_ENTERED = "holds a mount point, not entered"


def _entries(fd: int) -> list[tuple[str, bool]]:
    with os.scandir(fd) as it:
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]


class _Removal:
    """What one `_rmtree` has done: the first failures, how many failed and were removed, the
    directories under which something failed; and each of its moves (leave a directory, remove
    a file, enter a directory), each going on past its own failure."""

    def __init__(self, root: Path, mounts: set[str]) -> None:
        self.root, self.mounts = root, mounts
        self.first: list[tuple[Path, str]] = []
        self.count = self.removed = 0
        self.failed_in: set[Path] = set()     # the directories under which something failed
        self.real = os.path.realpath(root)
        self.dev: int | None = None

    def fail(self, p: Path, why: str) -> None:
        self.count += 1
        if len(self.first) < 10:
            self.first.append((p, why))
        q = p.parent
        while q not in self.failed_in and (q == self.root or self.root in q.parents):
            self.failed_in.add(q)
            q = q.parent

    def leave(self, stack: list) -> bool:
        """Close the emptied directory on top of ``stack`` and remove it from its parent; False
        when it was the root (removed last, by `_rmtree`)."""
        fd, path, _ = stack.pop()
        os.close(fd)
        if not stack:
            return False
        try:
            os.rmdir(path.name, dir_fd=stack[-1][0])
            self.removed += 1
        except OSError as e:
            if path not in self.failed_in:       # else: what failed in it is the reason
                self.fail(path, _reason(e))
        return True

    def file(self, fd: int, path: Path, name: str) -> None:
        if path == self.root and name == MARKER and self.count:
            return            # still marked: a later clean finishes what is left
        try:
            os.unlink(name, dir_fd=fd)
            self.removed += 1
        except OSError as e:
            self.fail(path / name, _reason(e))

    def enter(self, fd: int, path: Path, name: str) -> tuple | None:
        """(its descriptor, its path, its entries) of the directory ``name`` in ``fd``; None
        when it cannot be opened or is another file system or a mount point (a failure)."""
        p = path / name
        try:
            sub = os.open(name, _DIR, dir_fd=fd)
        except OSError as e:
            self.fail(p, _reason(e))
            return None
        try:
            mount = os.fstat(sub).st_dev != self.dev \
                or os.path.join(self.real, os.path.relpath(p, self.root)) in self.mounts
            listed = [] if mount else _entries(sub)
        except OSError as e:
            os.close(sub)
            self.fail(p, _reason(e))
            return None
        if mount:
            os.close(sub)
            self.fail(p, MOUNT_NOT_ENTERED)
            return None
        return sub, p, listed


def _rmtree(root: Path, mounts: set[str]) -> tuple[list[tuple[Path, str]], int, int]:
    """Remove ``root`` and everything in it, going on past each failure; never following a link
    and never entering another file system (st_dev) or a mount point in ``mounts``. Its marker
    goes last, and only when nothing before it failed. Iterative, with a directory descriptor
    per level (no recursion, no path a link could redirect). Returns (the first failures, up to
    10, as (path, strerror)), how many failed, how many entries were removed)."""
    r = _Removal(root, mounts)
    try:
        fd = os.open(root, _DIR)
    except OSError as e:
        return [(root, _reason(e))], 1, 0
    try:
        r.dev = os.fstat(fd).st_dev
        top = _entries(fd)
    except OSError as e:
        os.close(fd)
        return [(root, _reason(e))], 1, 0
    top.sort(key=lambda e: e[0] != MARKER)              # popped from the end: the marker last
    stack = [(fd, root, top)]
    try:
        while stack:
            fd, path, entries = stack[-1]
            if not entries:
                if not r.leave(stack):
                    break
                continue
            name, is_dir = entries.pop()
            if not is_dir:
                r.file(fd, path, name)
                continue
            entered = r.enter(fd, path, name)
            if entered is not None:
                stack.append(entered)
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    if not r.count:
        try:
            os.rmdir(root)
            r.removed += 1
        except OSError as e:
            r.fail(root, _reason(e))
    return r.first, r.count, r.removed


def _left(path: Path) -> tuple[int, int]:
    """(regular files, bytes) left under ``path``, its marker aside, not entering another file
    system."""
    files = total = 0
    try:
        dev = os.lstat(path).st_dev
    except OSError:
        return 0, 0
    for dirpath, dirnames, filenames in walk(path):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_dev != dev:
                dirnames.remove(name)
            elif stat.S_ISREG(st.st_mode) and not (name == MARKER and dirpath == str(path)):
                files, total = files + 1, total + st.st_size
    return files, total


def remove(leftovers: list[Leftover], min_age: float = MIN_AGE, dry_run: bool = False
           ) -> tuple[list[Leftover], list[tuple[Leftover, str]], list[Failure]]:
    """Delete the leftovers that are safe to delete (with ``dry_run``, none); return (removed,
    or would be, [(kept, why)], [what could not be removed, or only in part]).

    Each one is checked again just before it goes (name, marker, no links, no mount point, age),
    so a directory that changed since it was listed is kept. An OSError while removing one is
    recorded in its `Failure` and the next one is removed all the same: this never raises one.
    `BadInput` (before anything is removed) when ``min_age`` is out of ``--min-age``'s range."""
    check_min_age(min_age)
    removed, kept, failed = [], [], []
    now = time.time()
    for x in leftovers:
        why = why_kept(x, min_age, now)
        if why is not None:
            kept.append((x, why))
            continue
        if not dry_run:
            try:
                first, count, gone = _rmtree(x.path, mount_points())
            except OSError as e:                # not expected: _rmtree records its own
                first, count, gone = [(x.path, _reason(e))], 1, 0
            if count:
                (path, reason), (files, size) = first[0], _left(x.path)
                failed.append(Failure(x, path, reason, count, gone, files, size,
                                      is_marked(x.path)))
                continue
        removed.append(x)
    return removed, kept, failed
