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
directories (no links), and that nothing has written to for ``min_age`` seconds (a capture
still being written by another process is left alone); every kept one comes with the reason.
Not guaranteed: that a young leftover belongs to a live process (there is no lock to ask).
"""
from __future__ import annotations

import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nanbisect.bundle.where import MANIFEST
from nanbisect.util.staging import is_marked, staging_kind

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


def _walk(root: Path) -> tuple[int, float, bool]:
    """(bytes, newest mtime, only regular files and directories) of everything under ``root``."""
    total, newest, plain = 0, os.lstat(root).st_mtime, True
    for dirpath, dirnames, filenames in walk(root):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                plain = False       # a link or a device: not something we write
            newest = max(newest, st.st_mtime)
    return total, newest, plain


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
                    size, newest, _ = _walk(p)
                    found.append(Leftover(p, size, max(0.0, now - newest), staging_kind(d)))
                else:      # not ours to look into: listed with its own age only
                    age = max(0.0, now - os.lstat(p).st_mtime)
                    found.append(Leftover(p, None, age, staging_kind(d), marked=False))
            except OSError:
                continue
    return found


NO_MARKER = ("no nanbisect marker in it: not made by this version of nanbisect (an older one, or "
             "not nanbisect at all); remove it yourself if you know it is a leftover")


def why_kept(x: Leftover, min_age: float = MIN_AGE, now: float | None = None) -> str | None:
    """Why `remove` would keep ``x`` (checked on the disk now), or None when it may go."""
    now = time.time() if now is None else now
    if not staging_kind(x.path.name) or x.path.is_symlink() or not x.path.is_dir():
        return "not a nanbisect staging directory"
    if not is_marked(x.path):
        return NO_MARKER
    try:
        _, newest, plain = _walk(x.path)
    except OSError as e:
        return e.strerror or str(e)
    if not plain:
        return "holds links or special files, which nanbisect never writes"
    if now - newest < min_age:
        return (f"written {now - newest:.0f}s ago: may be a capture still running; remove it "
                f"after {min_age:.0f}s or pass --min-age 0")
    return None


def remove(leftovers: list[Leftover], min_age: float = MIN_AGE, dry_run: bool = False
           ) -> tuple[list[Leftover], list[tuple[Leftover, str]]]:
    """Delete the leftovers that are safe to delete (with ``dry_run``, none); return (removed,
    or would be, [(kept, why)]).

    Each one is checked again just before it goes (name, marker, no links, age), so a directory
    that changed since it was listed is kept."""
    removed, kept = [], []
    now = time.time()
    for x in leftovers:
        why = why_kept(x, min_age, now)
        if why is not None:
            kept.append((x, why))
            continue
        if not dry_run:
            shutil.rmtree(x.path)
        removed.append(x)
    return removed, kept
