"""Leftovers of writes that never finished: the hidden staging directories a killed capture or a
killed report write leaves beside its final path.

Every bundle and report is written into ``.NAME.tmp-XXXXXXXX`` beside ``NAME`` and renamed into
place only when complete (a report being replaced also moves the old one to
``.NAME.old-XXXXXXXX`` for a moment), so a process killed half-way leaves such a directory and
never a directory that looks complete. This module finds them and removes them.

Guarantees: `find_leftovers` only reads directory entries and sizes (no file is opened); `remove`
deletes only directories whose name has exactly that shape, that hold nothing but regular files
and directories (no links), and that nothing has written to for ``min_age`` seconds (a capture
still being written by another process is left alone).
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

from nanbisect.util.staging import staging_kind

MIN_AGE = 600.0     # seconds without a write before `remove` takes a leftover
MAX_DIRS = 100_000  # directories looked at under one root


@dataclass(frozen=True)
class Leftover:
    """One unfinished write: where, how many bytes, how long since anything in it changed."""

    path: Path
    bytes: int
    age_s: float
    kind: str        # "tmp": a write that never finished; "old": a replaced report not removed

    def to_json(self) -> dict:
        return {"path": str(self.path), "bytes": self.bytes, "age_s": round(self.age_s, 1),
                "kind": self.kind}


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


def find_leftovers(roots: list[Path]) -> list[Leftover]:
    """Every staging directory under ``roots`` (not descending into bundles' own hidden dirs).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> (d / ".step000001.tmp-0123abcd").mkdir()
    >>> _ = (d / ".step000001.tmp-0123abcd" / "model.safetensors").write_bytes(b"12345")
    >>> [(x.path.name, x.bytes, x.kind) for x in find_leftovers([d])]
    [('.step000001.tmp-0123abcd', 5, 'tmp')]
    """
    found: list[Leftover] = []
    now = time.time()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for dirpath, dirnames, _ in walk(root, MAX_DIRS):
            keep = []
            for d in sorted(dirnames):
                kind = staging_kind(d)       # util.staging names every staging directory
                p = Path(dirpath) / d
                if kind and not p.is_symlink():
                    try:
                        size, newest, _ = _walk(p)
                    except OSError:
                        continue
                    found.append(Leftover(p, size, max(0.0, now - newest), kind))
                elif not d.startswith("."):
                    keep.append(d)
            dirnames[:] = keep
    return found


def remove(leftovers: list[Leftover], min_age: float = MIN_AGE) -> tuple[list[Leftover],
                                                                          list[tuple[Leftover,
                                                                                     str]]]:
    """Delete the leftovers that are safe to delete; return (removed, [(kept, why)]).

    Each one is checked again just before it goes (name, no links, age), so a directory that
    changed since it was listed is kept."""
    removed, kept = [], []
    now = time.time()
    for x in leftovers:
        if not staging_kind(x.path.name) or x.path.is_symlink() or not x.path.is_dir():
            kept.append((x, "not a nanbisect staging directory"))
            continue
        try:
            _, newest, plain = _walk(x.path)
        except OSError as e:
            kept.append((x, e.strerror or str(e)))
            continue
        if not plain:
            kept.append((x, "holds links or special files, which nanbisect never writes"))
        elif now - newest < min_age:
            kept.append((x, f"written {now - newest:.0f}s ago: may be a capture still running; "
                            f"remove it after {min_age:.0f}s or pass --min-age 0"))
        else:
            shutil.rmtree(x.path)
            removed.append(x)
    return removed, kept
