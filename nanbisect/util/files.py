"""Small file chores every stage does the same way: sha256 of a file, reading a JSON file that
may be missing or garbage, writing a small file atomically, reading a file's bytes at an offset
into a buffer (`read_at`).

Guarantees: `file_sha256` streams (a file of any size costs 1 MiB of memory); `source_digest`
never reads more than ``max_bytes`` nor blocks on a special file; `read_json` never raises for
a missing, unreadable, oversized, malformed or too-deeply nested file; `atomic_file` leaves
either the old file or the complete new one at ``dest``, never a partial one, and no staging
file behind when its block fails.
Not guaranteed: durability across a power loss (nothing here fsyncs).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Iterator

from nanbisect.util.staging import staging_path

_CHUNK = 1 << 20


def file_sha256(path: Path, missing_ok: bool = False) -> str | None:
    """sha256 (hex) of the file at ``path``; OSError when it cannot be read, or None then with
    ``missing_ok``.

    >>> file_sha256(Path("/nonexistent"), missing_ok=True) is None
    True
    """
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    except OSError:
        if missing_ok:
            return None
        raise
    return h.hexdigest()


def source_digest(path: Path, max_bytes: int) -> str | None:
    """sha256 of a regular file on disk now (None: missing); a file over ``max_bytes`` or a
    special one by kind and size, so a hostile manifest listing /dev/zero cannot stall it.

    >>> source_digest(Path("/dev/null"), 10).startswith("not-a-file:")
    True
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return f"not-a-file:{stat.S_IFMT(st.st_mode)}"
    if st.st_size > max_bytes:
        return f"large:{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            h.update(f.read(max_bytes + 1))
    except OSError:
        return None
    return h.hexdigest()


def read_json(path: Path, max_bytes: int | None = None):
    """The JSON in ``path``, or None when it is missing, unreadable, over ``max_bytes``, not
    JSON or nested too deep to parse.

    >>> read_json(Path("/nonexistent")) is None
    True
    """
    try:
        if max_bytes is not None and Path(path).stat().st_size > max_bytes:
            return None
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


@contextlib.contextmanager
def atomic_file(dest: Path) -> Iterator[Path]:
    """A staging path beside ``dest`` to write; renamed over ``dest`` (`os.replace`) when the
    block succeeds, removed whatever happens.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> with atomic_file(d / "a.txt") as tmp:
    ...     _ = tmp.write_text("x")
    >>> [p.name for p in d.iterdir()], (d / "a.txt").read_text()
    (['a.txt'], 'x')
    """
    tmp = staging_path(dest)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_atomic(path: Path, text: str) -> None:
    """Replace the file ``path`` with ``text`` so that a reader sees the old or the new one."""
    with atomic_file(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def remove_made(made: list[Path]) -> None:
    """Remove the directories a failed write created (innermost first), each only while empty:
    never one that something else put a file in meanwhile."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            break


def read_at(fd: int, buf: memoryview, offset: int) -> int:
    """Read ``fd`` from ``offset`` into ``buf`` (a writable byte view) until it is full or the
    file ends (a short read is continued); the bytes read.

    >>> import tempfile; f = tempfile.TemporaryFile(); _ = f.write(b"abcdef"); f.flush()
    >>> buf = bytearray(3); read_at(f.fileno(), memoryview(buf), 2), bytes(buf)
    (3, b'cde')
    >>> read_at(f.fileno(), memoryview(bytearray(3)), 5)
    1
    """
    got, n = 0, len(buf)
    while got < n:
        k = os.preadv(fd, [buf[got:]], offset + got)
        if k <= 0:
            break
        got += k
    return got


def os_error(e: BaseException) -> OSError | None:
    """The OS error ``e`` stands for: ``e`` itself when it is an `OSError`, or the one a library
    wrapped in its own exception type (safetensors raises ``SafetensorError("... No space left
    on device (os error 28)")``), else None.

    >>> os_error(RuntimeError("I/O error: No space left on device (os error 28)")).strerror
    'No space left on device'
    >>> os_error(ValueError("bad")) is None
    True
    """
    if isinstance(e, OSError):
        return e
    m = _OS_ERROR.search(str(e))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code))
