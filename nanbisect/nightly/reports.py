"""Where triage keeps each bundle's report: ``OUT/reports/NAME/`` (report.json, report.md,
report.html, repro/), never inside the bundle, one directory per bundle path, replaced whole
each night.

Guarantees: a report directory appears whole or not at all (staged beside its place, then
renamed in; what a failed write staged is removed); an earlier night's report of a bundle that
has none tonight is removed, so a link never shows a stale verdict; only directories holding a
``report.json`` or the report marker (``.nanbisect-report``) are ever replaced or removed. A
report that cannot be placed says why, in one line (the OSError's strerror and the path: ``No
space left on device: 'OUT/reports/...'``, or what is in its way): `place_report`,
`copy_report`; the summary puts it on the bundle's row (``report_error``).
Not guaranteed: a report kept from a cluster's worker that does not see ``OUT`` (the row then
has no ``report_dir``, and its ``report_error`` says so).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

REPORTS = "reports"
MARKER = ".nanbisect-report"    # = nanbisect.report.out.MARKER, in every report directory


def _ours(path: Path) -> bool:
    """A report directory nanbisect wrote: it holds a report.json or the report marker."""
    return (path / "report.json").exists() or (path / MARKER).exists()


def report_name(bundle: str) -> str:
    """The directory name of ``bundle``'s report under ``OUT/reports``: its last two path parts
    (readable) and a hash of its absolute path (unique, the same every night).

    >>> report_name("/nights/job1/step000005")[:-9]
    'job1-step000005'
    """
    p = Path(bundle)
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(p.parts[-2:]))[-80:].lstrip(".")
    return f"{tail or 'bundle'}-{hashlib.sha256(os.path.abspath(bundle).encode()).hexdigest()[:8]}"


def place(src: Path, dest: Path) -> bool:
    """`place_report`, as True when it placed the report."""
    return place_report(src, dest) is None


def place_report(src: Path, dest: Path) -> str | None:
    """Move the report directory ``src`` to ``dest``, replacing what an earlier night put
    there; the new one is renamed in whole (staged beside ``dest`` first, which copies when
    ``src`` is on another file system). None when it is in place; else why not, one line: a
    write that failed (the OSError's strerror and the path), a file or a foreign directory in
    its way (left alone), or the directory above ``dest``'s (triage's ``OUT``, made before any
    replay) not there: a cluster's worker that does not see ``OUT`` keeps nothing (rather than
    a copy where nobody looks)."""
    stage = old = None
    try:
        if not dest.parent.parent.is_dir():
            return (f"--out '{dest.parent.parent}' is not there where the replay ran (a "
                    "cluster's worker that does not see it); put --out on a file system the "
                    "workers share")
        dest.parent.mkdir(exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        shutil.move(str(src), str(stage / "report"))
        if dest.is_symlink() or dest.is_file():     # not a directory triage made: left alone
            return f"'{dest}' is a file or a link, not a report triage wrote; remove it"
        if dest.exists():
            if not _ours(dest) and any(dest.iterdir()):
                return (f"'{dest}' holds files that are not a report triage wrote; "
                        "remove them")
            old = dest.parent / f".{dest.name}.old-{os.getpid()}-{threading.get_ident()}"
            os.rename(dest, old)
        os.rename(stage / "report", dest)
        return None
    except OSError as e:
        return write_error(e, dest)
    finally:
        for d in (stage, old):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def copy_in(src: Path, dest: Path) -> bool:
    """`copy_report`, as True when it placed the copy."""
    return copy_report(src, dest) is None


def copy_report(src: Path, dest: Path) -> str | None:
    """`place_report` a copy of the report directory ``src`` (a cached one) at ``dest``: None
    when it is in place, else why not (one line)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.copy-", dir=dest.parent))
    except OSError as e:
        return write_error(e, dest)
    try:
        shutil.copytree(src, tmp / "r", symlinks=True)
        return place_report(tmp / "r", dest)
    except OSError as e:
        return write_error(e, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_error(e: OSError, dest: Path) -> str:
    """A report that could not be written to ``dest`` as one line: the OSError's strerror and
    ``dest`` (not the staged file that failed: that is gone); a copy's `shutil.Error`, which
    lists one failure per file, by its first.

    >>> write_error(OSError(28, "No space left on device", "/n/reports/.a.tmp-1/r.html"),
    ...             Path("/n/reports/a"))
    "No space left on device: '/n/reports/a'"
    >>> write_error(shutil.Error([("/t/r.md", "/n/r.md", "[Errno 13] Permission denied: 'x'")]),
    ...             Path("/n/reports/a"))
    "Permission denied: '/n/reports/a'"
    """
    why = e.strerror
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        first = e.args[0][0]
        text = str(first[2] if isinstance(first, tuple) and len(first) == 3 else first)
        m = re.match(r"\[Errno \d+\] (.*?)(?:: '.*)?$", text)
        why = m.group(1) if m else text
    return " ".join(f"{why or type(e).__name__}: '{dest}'".split())[:500]


def drop(dest: Path) -> None:
    """Remove an earlier night's report at ``dest`` (a bundle with none tonight)."""
    with contextlib.suppress(OSError):
        if dest.is_dir() and not dest.is_symlink() and _ours(dest):
            shutil.rmtree(dest, ignore_errors=True)
