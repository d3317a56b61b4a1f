"""A path a user gives (a command's argument or flag, a keyword of the Python API, the file of an
``--entry`` or ``--inject``), checked before anything uses it (`user_path`).

Guarantees: `user_path` refuses, as one `BadInput` line that names the value and the fix, a value
that is not a str or an ``os.PathLike`` of one, an empty one, one holding a NUL byte, one with a
component longer than the file system allows (255 bytes on Linux and macOS) and one longer than a
path may be (4096 bytes); it touches no file. What it passes may still not exist, or not be
writable: those are the caller's checks, with its own words.
"""
from __future__ import annotations

import os
from pathlib import Path

from nanbisect.errors import BadInput

NAME_MAX = 255      # bytes of one path component (Linux, macOS)
PATH_MAX = 4096     # bytes of a whole path (Linux)
# the values that name a directory to write into: an empty one is refused with "." as the fix
DIRECTORIES = {"--out", "out", "-o", "--output", "output", "--cache", "cache", "dest", "DEST"}


def _shown(text: str, limit: int = 60) -> str:
    """A long value as a one-line message shows it: its start, its end and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:24]}...{text[-24:]} ({len(text)} characters)"


def user_path(value: object, what: str) -> Path:
    """``value`` as a `Path`, or `BadInput` (``what``: how the message names it, ``--out``,
    ``out=``, ``the bundle``).

    >>> user_path("runs/step3", "--out")
    PosixPath('runs/step3')
    >>> user_path("", "out=")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: out='' is empty; pass a directory (. for this one)
    >>> user_path("a/" + "x" * 300, "--out")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: --out 'a/xxx...xxx (302 characters)': its component ... is 300
    bytes, over the 255 a file name may have; pass a shorter name
    >>> user_path(5, "out=")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: out=5 is not a path; pass a str or a pathlib.Path
    """
    if isinstance(value, bytes) or not isinstance(value, (str, os.PathLike)):
        raise BadInput(f"{_name(what, value)} is not a path; pass a str or a pathlib.Path")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise BadInput(f"{_name(what, value)} is not a path of text; pass a str or a "
                       "pathlib.Path")
    if text == "":
        fix = "a directory (. for this one)" if what.rstrip("=") in DIRECTORIES else "a path"
        raise BadInput(f"{_name(what, text)} is empty; pass {fix}")
    if "\0" in text:
        raise BadInput(f"{_name(what, text.replace(chr(0), '?'))} holds a NUL byte, which no "
                       "path may; pass the path without it")
    try:
        raw = os.fsencode(text)
    except UnicodeError:
        raise BadInput(f"{_name(what, text)} cannot be encoded for the file system; pass a "
                       "path in its encoding") from None
    if len(raw) > PATH_MAX:
        raise BadInput(f"{_name(what, text)} is {len(raw)} bytes, over the {PATH_MAX} a path may "
                       "have; pass a shorter path")
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            raise BadInput(f"{_name(what, text)}: its component '{_shown(os.fsdecode(part))}' is "
                           f"{len(part)} bytes, over the {NAME_MAX} a file name may have; pass "
                           "a shorter name")
    return Path(text)


def _name(what: str, value: object) -> str:
    """How a message names the value: a keyword as Python writes it (``out=''``), a flag or an
    argument with the value quoted (``--out 'x'``)."""
    if not isinstance(value, str):
        return f"{what}{value!r}" if what.endswith("=") else f"{what} {value!r}"
    return f"{what}{_shown(value)!r}" if what.endswith("=") else f"{what} '{_shown(value)}'"
