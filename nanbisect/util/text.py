"""Values shown in one-line messages.

Guarantees: `show` never returns a newline or a control character and never more than ``limit``
characters (plus the closing quote); `clip` neither, at most ``limit`` characters and a note of
how many more. Every message that quotes a bundle (an untrusted manifest may list 2**20 ranks or
hold strings of megabytes) names ranks through `ranks_text` (runs of consecutive ranks, the
first `MAX_RANGES` of them, and the count) or `ranks_arg` (a ``--ranks`` value of at most 16
ranks), and strings through `show` or `clip`: its length does not grow with the bundle.
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


def first_line(text: str, limit: int = 200) -> str:
    """The first non-blank line of ``text``, spaces collapsed, cut at a word boundary with
    "..." when longer than ``limit`` (never mid-word, never a newline).

    >>> first_line("Recomputed values differ.\\ntensor at position 0")
    'Recomputed values differ.'
    >>> first_line("alpha beta gamma delta", limit=14)
    'alpha beta...'
    """
    line = next((" ".join(t.split()) for t in str(text).splitlines() if t.strip()), "")
    if len(line) <= limit:
        return line
    cut = line[:limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."


def raised_at(e: BaseException) -> str | None:
    """``file:line`` (the file's name alone) of the innermost frame ``e`` was raised in; None
    when it carries no traceback.

    >>> try:
    ...     {}["k"]
    ... except KeyError as e:
    ...     raised_at(e).startswith("<doctest")
    True
    """
    tb = traceback.extract_tb(e.__traceback__)
    return f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else None


def error_record(e: BaseException, limit: int = 2000) -> dict:
    """An exception recorded whole, for a report: ``error`` (its type and the first line of its
    message: what one line of text shows), ``error_type``, ``error_message`` (the whole
    message, newlines kept, at most ``limit`` characters) and ``error_where`` (the innermost
    frame's file name and line).

    >>> try:
    ...     raise ValueError("bad value\\nsecond line")
    ... except ValueError as e:
    ...     r = error_record(e)
    >>> r["error"], r["error_type"], r["error_message"]
    ('ValueError: bad value', 'ValueError', 'bad value\\nsecond line')
    """
    message = str(e)
    head = first_line(message)
    return {"error": f"{type(e).__name__}: {head}" if head else type(e).__name__,
            "error_type": type(e).__name__,
            "error_message": message if len(message) <= limit else message[:limit] + "...",
            "error_where": raised_at(e)}


def failure_line(e: BaseException, limit: int = 300) -> str:
    """An unexpected exception on one line: its type, `exception_line` and the innermost frame
    it was raised in.

    >>> try:
    ...     {}["k"]
    ... except KeyError as e:
    ...     failure_line(e).split(" at ")[0]
    "KeyError: 'k'"
    """
    where = f" at {at}" if (at := raised_at(e)) else ""
    text = exception_line(e, limit)
    return f"{type(e).__name__}" + (f": {text}" if text != type(e).__name__ else "") + where


# --------------------------------------------------------------------------------------------
# bounded lists and text: what a message quoting a bundle (untrusted: a manifest may list 2**20
# ranks or hold 4096-character strings) shows of it

MAX_RANGES = 8      # runs of consecutive ranks a message shows
MAX_LINE = 500      # characters of one line of `inspect`'s text, a report's or triage's row


def runs(ranks) -> list[tuple[int, int]]:
    """``ranks`` (integers, any order, repeats allowed) as runs of consecutive numbers.

    >>> runs([9, 0, 1, 2, 3, 5, 7, 8, 3])
    [(0, 3), (5, 5), (7, 9)]
    """
    out: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def ranges(ranks, limit: int = MAX_RANGES) -> str:
    """``ranks`` as runs of consecutive numbers ('0-3, 5, 7-9'), the first ``limit`` of them
    and how many more: at most ``limit`` * 16 + 30 characters whatever the list's length.

    >>> ranges([0, 1, 2, 3, 5, 7, 8, 9]), ranges(range(1, 1 << 20)), ranges([])
    ('0-3, 5, 7-9', '1-1048575', '-')
    >>> ranges(range(0, 40, 2), limit=3)
    '0, 2, 4, ... and 17 more ranges'
    """
    rs = runs(ranks)
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in rs[:limit]) or "-"
    return text + (f", ... and {len(rs) - limit:,} more ranges" if len(rs) > limit else "")


def ranks_text(ranks, limit: int = MAX_RANGES) -> str:
    """``ranks`` named in a message: 'rank 1', or their ranges (`ranges`) and their count.

    >>> ranks_text([1]), ranks_text([0, 1, 2, 3, 5, 7, 8, 9])
    ('rank 1', 'ranks 0-3, 5, 7-9 (8 ranks)')
    >>> ranks_text(range(1, 1 << 20))
    'ranks 1-1048575 (1,048,575 ranks)'
    """
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {ranges(rs, limit)} ({len(rs):,} ranks)"


def ranks_arg(ranks, limit: int = 16) -> str:
    """``ranks`` as a ``--ranks`` value ('0,3'), or, for more than ``limit`` ranks, a
    placeholder naming them by `ranks_text` (a message stays one short line; a command with
    thousands of ranks is not one to copy).

    >>> ranks_arg([3, 0]), ranks_arg(range(100))
    ('0,3', 'R,... (any of ranks 0-99 (100 ranks))')
    """
    rs = sorted(set(ranks))
    if len(rs) <= limit:
        return ",".join(map(str, rs))
    return f"R,... (any of {ranks_text(rs)})"


def clip(text, limit: int = MAX_LINE) -> str:
    """``text`` (any value: str() of it) on one line, control characters shown escaped, at most
    ``limit`` characters and a note of how many more there were.

    >>> clip("a\\x1b[2Jb"), clip("x" * 100, limit=10)
    ('a\\\\x1b[2Jb', 'xxxxxxxxxx... (90 more characters)')
    """
    text, out, size = str(text), [], 0
    for i, c in enumerate(text):
        c = c if c.isprintable() else repr(c)[1:-1]
        if size + len(c) > limit:
            return "".join(out) + f"... ({len(text) - i:,} more characters)"
        out.append(c)
        size += len(c)
    return "".join(out)
