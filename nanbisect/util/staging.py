"""Staging names: every directory or file nanbisect writes is built as ``.NAME.tmp-XXXXXXXX``
beside ``NAME`` (8 hex digits) and renamed into place; a report being replaced is moved to
``.NAME.old-XXXXXXXX`` for a moment.

Guarantees: `staging_name` makes only names `staging_kind` recognises, with a fresh random tag
each call (two writers of one destination never share a staging path).
Not guaranteed: that a recognised name was made by a live process.
"""
from __future__ import annotations

import re
import uuid
from pathlib import Path

# `.step000012.tmp-0123abcd` / `.nanbisect-report.old-89abcdef`
PATTERN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{8}$")
KINDS = ("tmp", "old")   # "tmp": a write that never finished; "old": a replaced report not removed


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
