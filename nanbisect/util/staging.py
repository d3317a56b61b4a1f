"""Staging names: every directory or file nanbisect writes is built as ``.NAME.tmp-XXXXXXXX``
beside ``NAME`` (8 hex digits) and renamed into place; a report being replaced is moved to
``.NAME.old-XXXXXXXX`` for a moment.

Every staging *directory* carries a marker file (`MARKER`) from the moment it is made
(`make_staging_dir`) until just before it is renamed into place (`unmark`); a report moved aside
gets one once it is proven nanbisect's (`mark`). `nanbisect clean` removes only directories that
carry it (`is_marked`): a name alone (``.ssh.old-20240101`` has that shape) is never enough.

Guarantees: `staging_name` makes only names `staging_kind` recognises, with a fresh random tag
each call (two writers of one destination never share a staging path); `make_staging_dir`
leaves either nothing or a directory that carries its marker.
Not guaranteed: that a recognised name was made by a live process; a process killed between
`unmark` and its rename leaves a staging directory without a marker (kept by `clean`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import uuid
from pathlib import Path

# `.step000012.tmp-0123abcd` / `.nanbisect-report.old-89abcdef`
PATTERN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{8}$")
KINDS = ("tmp", "old")   # "tmp": a write that never finished; "old": a replaced report not removed
MARKER = ".nanbisect-staging"       # in every staging directory nanbisect makes
MARKER_SCHEMA = "nanbisect.staging/1"
_MARKER_MAX = 4096


def staging_name(name: str, kind: str = "tmp") -> str:
    """The hidden staging name of ``name``.

    >>> bool(PATTERN.match(staging_name("step000012"))), staging_name("r", "old")[:7]
    (True, '.r.old-')
    """
    assert kind in KINDS, kind
    return f".{name}.{kind}-{uuid.uuid4().hex[:8]}"


def staging_path(dest: Path, kind: str = "tmp") -> Path:
    """A fresh staging path beside ``dest`` (``DIR/.NAME.tmp-XXXXXXXX`` for ``DIR/NAME``)."""
    dest = Path(dest)
    return dest.parent / staging_name(dest.name, kind)


def staging_kind(name: str) -> str | None:
    """``"tmp"`` or ``"old"`` when ``name`` is a staging name, else None.

    >>> staging_kind(".step000001.tmp-0123abcd"), staging_kind("step000001"), \\
    ...     staging_kind(".x.tmp-0123ABCD")
    ('tmp', None, None)
    """
    m = PATTERN.match(name)
    return m["kind"] if m else None


def mark(path: Path) -> None:
    """Write the staging marker into the directory ``path`` (a staging directory of ours).

    The marker names the directory it was written into, so a marker copied elsewhere proves
    nothing about another directory."""
    path = Path(path)
    data = json.dumps({"schema": MARKER_SCHEMA, "name": path.name, "pid": os.getpid()})
    fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(data + "\n")


def make_staging_dir(path: Path, parents: bool = False) -> Path:
    """Create the staging directory ``path`` (exclusively) with its marker; on any failure
    (no room for the marker) remove it again and raise.

    >>> import tempfile
    >>> d = make_staging_dir(staging_path(Path(tempfile.mkdtemp()) / "step000001"))
    >>> is_marked(d), [p.name for p in d.iterdir()]
    (True, ['.nanbisect-staging'])
    """
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    try:
        mark(path)
    except BaseException:
        with contextlib.suppress(OSError):
            unmark(path)
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return path


def unmark(path: Path) -> None:
    """Remove the marker from a finished staging directory, just before it is renamed into
    place (a bundle, report or unpacked pack never holds one)."""
    try:
        os.unlink(Path(path) / MARKER)
    except FileNotFoundError:
        pass


def is_marked(path: Path) -> bool:
    """Whether the directory ``path`` carries the marker nanbisect wrote into it when it made it:
    a regular file (not a link) holding `MARKER_SCHEMA` and this directory's own name.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / ".ssh.old-20240101"
    >>> d.mkdir(); is_marked(d)
    False
    """
    try:
        fd = os.open(Path(path) / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            head = json.loads(f.read(_MARKER_MAX + 1)[:_MARKER_MAX])
    except (OSError, ValueError):
        return False
    return isinstance(head, dict) and head.get("schema") == MARKER_SCHEMA \
        and head.get("name") == Path(path).name
