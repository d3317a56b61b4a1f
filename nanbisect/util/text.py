"""Values shown in one-line messages.

Guarantees: `show` never returns a newline or a control character and never more than ``limit``
characters (plus the closing quote).
"""
from __future__ import annotations


def show(value, limit: int = 60) -> str:
    """``value`` for a one-line message: repr (no newline or control character), cut short.

    >>> show("a\\nb"), show("x" * 100, limit=10)
    ("'a\\\\nb'", "'xxxxx...'")
    """
    r = repr(value)
    if len(r) <= limit:
        return r
    return r[:limit - 4] + "..." + (r[0] if r[0] in "'\"" else "")
