"""Where triage keeps each bundle's report: ``OUT/reports/NAME/`` (report.json, report.md,
report.html, repro/), never inside the bundle, one directory per bundle path, replaced whole
each night.

Guarantees: a report directory appears whole or not at all (staged beside its place, then
renamed in); an earlier night's report of a bundle that has none tonight is removed, so a link
never shows a stale verdict; only directories holding a ``report.json`` are ever removed.
Not guaranteed: a report kept from a cluster's worker that does not see ``OUT`` (the row then
has no ``report_dir``).
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
    """Move the report directory ``src`` to ``dest``, replacing what an earlier night put
    there; the new one is renamed in whole (staged beside ``dest`` first, which copies when
    ``src`` is on another file system). False when ``dest`` cannot be written, or when the
    directory above ``dest``'s (triage's ``OUT``, made before any replay) is not there: a
    cluster's worker that does not see ``OUT`` keeps nothing (rather than a copy where nobody
    looks)."""
    stage = old = None
    try:
        dest.parent.mkdir(exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        shutil.move(str(src), str(stage / "report"))
        if dest.is_symlink() or dest.is_file():
            return False                 # not a directory triage made: left alone
        if dest.exists():
            if not (dest / "report.json").exists() and any(dest.iterdir()):
                return False
            old = dest.parent / f".{dest.name}.old-{os.getpid()}-{threading.get_ident()}"
            os.rename(dest, old)
        os.rename(stage / "report", dest)
        return True
    except OSError:
        return False
    finally:
        for d in (stage, old):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def copy_in(src: Path, dest: Path) -> bool:
    """`place` a copy of the report directory ``src`` (a cached one) at ``dest``."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.copy-", dir=dest.parent))
    except OSError:
        return False
    try:
        shutil.copytree(src, tmp / "r", symlinks=True)
        return place(tmp / "r", dest)
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def drop(dest: Path) -> None:
    """Remove an earlier night's report at ``dest`` (a bundle with none tonight)."""
    with contextlib.suppress(OSError):
        if dest.is_dir() and not dest.is_symlink() and (dest / "report.json").is_file():
            shutil.rmtree(dest, ignore_errors=True)
