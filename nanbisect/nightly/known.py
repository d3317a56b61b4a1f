"""The signatures a night is compared with (``--known``): a previous triage.json, a text file
with one signature a line, or (the Python API) the signatures themselves.

Guarantees: a ``--known`` file that does not exist yet is no signature at all, with a note that
says so (`check_known`): a nightly job's first night has no last night to compare with. One that
exists but is not a regular file (a directory, a device such as /dev/zero, a FIFO, a socket) is
`BadInput` naming what it is, found without opening it (a FIFO would block the reader); a file
is read whole only up to `MAX_KNOWN` bytes. Signatures given as values must be strings
(`given_known`). Imports only the standard library and nanbisect's errors and paths: the command
line checks ``--known`` before anything heavy is imported.

Not guaranteed: a file that appears or changes between the check and the read (it is read as it
is then).
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from nanbisect.errors import BadInput
from nanbisect.util.text import clip
from nanbisect.util.user_paths import user_path

MAX_KNOWN = 64 << 20               # bytes of a --known file (a triage.json of a big night fits)
_FIX = "pass a triage.json or a text file of signatures, one a line"

# what a path that is no regular file is, for the message that refuses it
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"))


def check_known(path: Path) -> str | None:
    """The note a ``--known`` file that does not exist yet gets (its signatures: none), None for
    a regular file to read; `BadInput` for anything else there.

    >>> check_known(Path("no/such/triage.json"))
    "--known 'no/such/triage.json' does not exist yet: every signature is new tonight"
    >>> check_known(Path("/dev/zero"))
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: --known '/dev/zero' is a character device, not a file; pass a ...
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"--known '{path}' does not exist yet: every signature is new tonight"
    except OSError as e:         # a file where a directory should be, a loop of links, EACCES
        raise BadInput(f"--known '{path}': {e.strerror or type(e).__name__}; {_FIX}") from None
    for test, kind in _KINDS:
        if test(st.st_mode):
            raise BadInput(f"--known '{path}' is {kind}, not a file; {_FIX}")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"--known '{path}' is not a regular file; {_FIX}")
    if st.st_size > MAX_KNOWN:
        raise BadInput(f"--known '{path}' is {st.st_size} bytes, over the {MAX_KNOWN >> 20} "
                       f"MiB a list of known signatures may be; {_FIX}")
    return None


def load_known(path: Path) -> set[str]:
    """Known signatures: a previous triage.json, or a text file with one signature a line; none
    when ``path`` does not exist yet (`check_known` says so), `BadInput` when it cannot be read.

    >>> sorted(load_known(Path("no/such/triage.json")))
    []
    """
    path = Path(path)
    if check_known(path) is not None:
        return set()
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_KNOWN + 1)[:MAX_KNOWN].decode()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--known '{path}': {getattr(e, 'strerror', None) or e}; {_FIX}"
                       ) from None
    try:
        return {g["signature"] for g in json.loads(text)["signatures"]}
    except (ValueError, KeyError, TypeError, RecursionError):
        return {line.strip() for line in text.splitlines() if line.strip()}


def given_known(value: object) -> Path | frozenset[str] | None:
    """The Python API's ``known=``: a path (of a file for `load_known`), the signatures
    themselves (an iterable of str), or None; `BadInput` for anything else.

    >>> given_known(["a · b"]), given_known("last/triage.json")
    (frozenset({'a · b'}), PosixPath('last/triage.json'))
    >>> given_known([None])
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: triage: known=[None] holds None, not a signature; pass ...
    """
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return user_path(value, "known=")
    shown = clip(repr(value), 80)
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise BadInput(f"triage: known={shown} is neither a file nor a list of signatures; "
                       "pass the path of a triage.json or of a text file, or a list of str")
    items = list(value)
    for s in items:
        if not isinstance(s, str):
            raise BadInput(f"triage: known={shown} holds {clip(repr(s), 60)}, not a signature; "
                           "pass a list of str (as triage.json's signatures[].signature)")
    return frozenset(items)
