"""Values shown in one-line messages.

Guarantees: `show` never returns a newline or a control character and never more than ``limit``
characters (plus the closing quote).
"""
from __future__ import annotations

import traceback
from pathlib import Path


def show(value, limit: int = 60) -> str:
    """``value`` for a one-line message: repr (no newline or control character), cut short.

    >>> show("a\\nb"), show("x" * 100, limit=10)
    ("'a\\\\nb'", "'xxxxx...'")
    """
    r = repr(value)
    if len(r) <= limit:
        return r
    return r[:limit - 4] + "..." + (r[0] if r[0] in "'\"" else "")


def exception_line(e: BaseException, limit: int = 300) -> str:
    """What went wrong, on one line: an `OSError`'s reason and file, else the exception's own
    text (a library's, e.g. safetensors' "No space left on device"), else its type's name.

    >>> exception_line(OSError(28, "No space left on device", "/out/x"))
    "No space left on device: '/out/x'"
    >>> exception_line(RuntimeError("a\\n  b")), exception_line(KeyError())
    ('a b', 'KeyError')
    """
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror + (f": '{e.filename}'" if e.filename else "")
    else:
        text = str(e) or type(e).__name__
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def failure_line(e: BaseException, limit: int = 300) -> str:
    """An unexpected exception on one line: its type, `exception_line` and the innermost frame
    it was raised in.

    >>> try:
    ...     {}["k"]
    ... except KeyError as e:
    ...     failure_line(e).split(" at ")[0]
    "KeyError: 'k'"
    """
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    text = exception_line(e, limit)
    return f"{type(e).__name__}" + (f": {text}" if text != type(e).__name__ else "") + where
