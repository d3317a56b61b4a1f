"""Put a finished directory in its final place without ever replacing anything there.

Guarantees: `place` renames a complete staging directory to its final name in one step, and
never over an existing file or directory (Linux ``renameat2(RENAME_NOREPLACE)``; elsewhere, or
on file systems without it, an exclusive ``mkdir`` reserves the name first and the rename then
replaces only that empty directory of our own; a file is hard-linked to its name, then
unlinked). With ``unique``, a taken name is not an error:
the next free ``NAME-1``, ``NAME-2``, ... is used, so two processes writing "the same" bundle at
once both keep theirs.
Not guaranteed: on the fallback path a process killed between the reservation and the rename
leaves an empty ``NAME`` directory (no manifest: it never looks like a bundle).
"""
from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` (a directory or a file) to ``dst``; `FileExistsError` when ``dst`` exists
    (nothing is replaced)."""
    src, dst = os.fsencode(src), os.fsencode(dst)
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), os.fsdecode(dst))
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), os.fsdecode(dst))
    if not os.path.isdir(src):
        os.link(src, dst)    # NB: a file: exclusive, raises FileExistsError when the name is taken
        os.unlink(src)
        return
    os.mkdir(dst)            # NB: exclusive: raises FileExistsError when the name is taken
    try:
        os.rename(src, dst)  # replaces only the empty directory just made
    except BaseException:
        os.rmdir(dst)
        raise


def place(tmp: Path, final: Path, unique: bool = False) -> Path:
    """Rename the finished ``tmp`` to ``final`` (or, with ``unique``, the first free
    ``final-N``); return where it went.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> (d / "a").mkdir(); (d / "b").mkdir(); (d / "b" / "x").touch()
    >>> place(d / "a", d / "b", unique=True).name
    'b-1'
    """
    tmp, final = Path(tmp), Path(final)
    candidate, i = final, 1
    while True:
        try:
            rename_noreplace(tmp, candidate)
            return candidate
        except FileExistsError:
            if not unique:
                raise FileExistsError(f"{final} already exists; choose a new bundle path or "
                                      "remove it") from None
            candidate, i = final.with_name(f"{final.name}-{i}"), i + 1
