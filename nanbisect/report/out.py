"""Where a report may go: `check_out` and what it reads (the report `MARKER`, `foreign_files`,
`older_report`). Light on purpose (the standard library, `nanbisect.errors`, `nanbisect.util`):
the command line checks ``--out`` with it before torch is imported; `nanbisect.report.write`
checks again when it writes, and documents what the checks guarantee.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from nanbisect.errors import BadInput
from nanbisect.util.files import file_sha256

MARKER = ".nanbisect-report"          # written into every report directory, holds its schema
DEFAULT_NAME = "nanbisect-report"     # BUNDLE/nanbisect-report, the default --out


def foreign_files(path: Path) -> list[str] | None:
    """What in directory ``path`` nanbisect did not write as a report, or edited since: [] for a
    report it may replace, None when ``path`` is no report nanbisect can prove its own (no
    `MARKER` listing its files: not a report, or one from before the marker, see
    `older_report`)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    head = _marker(path)
    if not (isinstance(head, dict) and isinstance(head.get("files"), dict)):
        return None
    ours = {f: d for f, d in head["files"].items() if isinstance(f, str)}
    # a file added since, or one of ours edited since (the user's notes in report.md)
    return sorted(f for f in files_under(path) if f != MARKER
                  and (f not in ours or file_sha256(path / f, missing_ok=True) != ours[f]))


def _marker(path: Path) -> dict | None:
    """The report marker in ``path`` when it is a plain file holding a report schema."""
    marker = path / MARKER
    if not marker.is_file() or marker.is_symlink():
        return None
    try:
        head = json.loads(marker.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(head, dict) or not str(head.get("schema", "")).startswith(
            "nanbisect.report/"):
        return None
    return head


def older_report(path: Path) -> bool:
    """Whether ``path`` holds a report written before the marker listed its files (report.json
    with our schema, or a marker without a file list): nanbisect wrote it, but cannot prove that
    nobody edited it since, so it is never replaced."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or foreign_files(path) is not None:
        return False
    if _marker(path) is not None:
        return True
    try:
        report = json.loads((path / "report.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(report, dict) and str(report.get("schema", "")).startswith(
        "nanbisect.report/")


def is_report_dir(path: Path) -> bool:
    """Whether ``path`` is a directory nanbisect wrote as a report (and may replace)."""
    return foreign_files(path) == []


def files_under(root: Path) -> list[str]:
    """Every entry under ``root`` but directories, as POSIX paths relative to it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        out += [(rel / n).as_posix() for n in filenames]
        out += [(rel / d).as_posix() for d in dirnames if (Path(dirpath) / d).is_symlink()]
    return out


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or under it (the paths as given: resolve them first)."""
    return path == root or root in path.parents


def check_out(out: Path, bundle: Path | None = None) -> Path:
    """Refuse an ``--out`` that would replace what nanbisect did not write; return it resolved.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "notes.txt").write_text("mine")
    >>> check_out(d)
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: --out '...': the directory exists and is not a nanbisect report ...
    """
    given, out = Path(out), Path(os.path.abspath(out))
    resolved = out.resolve()
    if bundle is not None:
        b = Path(bundle).resolve()
        default = b / DEFAULT_NAME
        if resolved == b:
            raise BadInput(f"--out '{given}' is the bundle itself; writing the report there would "
                           "replace the bundle: pass another directory (default: "
                           f"BUNDLE/{DEFAULT_NAME})")
        if inside(resolved, b) and resolved != default:
            raise BadInput(f"--out '{given}' is inside the bundle; only BUNDLE/{DEFAULT_NAME} "
                           "may be written there: pass a directory outside the bundle")
        if inside(b, resolved):
            raise BadInput(f"--out '{given}' holds the bundle; replacing it would delete the "
                           "bundle: pass a directory that does not contain it")
    if out.is_symlink():
        raise BadInput(f"--out '{given}' is a symbolic link; nanbisect does not replace links: "
                       "pass a plain directory path")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out '{given}' is a file; pass a directory path for the report")
    if out.is_dir() and os.path.ismount(out):
        raise BadInput(f"--out '{given}' is a mount point; the report directory is replaced as "
                       "a whole, which a mount point cannot be: pass a directory inside it "
                       f"(e.g. {given}/report)")
    foreign = foreign_files(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                          else "")
        raise BadInput(f"--out '{given}' is a nanbisect report, but {shown} in it was not "
                       "written by nanbisect and would be deleted: move it out, or pass a new "
                       "directory")
    if out.is_dir() and foreign is None:
        if older_report(out):
            raise BadInput(f"--out '{given}' holds a report written by an older nanbisect, which "
                           "did not record what it wrote, so nanbisect cannot prove it "
                           "unchanged and will not replace it: pass another --out, or move it "
                           "away (or delete it yourself, keeping anything of yours in it)")
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise BadInput(f"--out '{given}': the directory exists and is not a nanbisect report "
                           f"(it holds {shown}); nanbisect replaces only reports it wrote: pass a "
                           "new or empty directory")
    return out
