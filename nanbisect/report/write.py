"""Write a report directory: report.json, report.md and report.html together, atomically (built
beside its final place, then renamed over it).

Guarantees: nanbisect never deletes what it did not write. `check_out` refuses a report directory
that would replace anything but an earlier nanbisect report (recognised by its `MARKER` file,
which lists every file the report was written with and its sha256: a file added or edited since
makes the directory not ours; or, for reports written before the marker existed, by holding only
the names a report holds, in repro/ too), an
existing file, the bundle itself, a path inside the bundle other than ``BUNDLE/nanbisect-report``,
and a directory that holds the bundle; an empty directory is taken as it is. `staged` checks
again just before it renames, and once more after moving the old report aside (so a file added
in that instant is put back, not deleted); the new report is renamed in without ever replacing
a directory that appeared meanwhile.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanbisect.bundle.atomic import rename_noreplace
from nanbisect.errors import BadInput
from nanbisect.report.model import Report
from nanbisect.report.page import to_html
from nanbisect.report.text import to_markdown
from nanbisect.util.files import file_sha256
from nanbisect.util.staging import staging_path

MARKER = ".nanbisect-report"          # written into every report directory, holds its schema
REPORT_FILES = {"report.json", "report.md", "report.html", "repro", MARKER}
REPRO_FILES = {"repro.py", "inputs.safetensors", "module_repro.py", "module_inputs.safetensors"}
DEFAULT_NAME = "nanbisect-report"     # BUNDLE/nanbisect-report, the default --out


def foreign_files(path: Path) -> list[str] | None:
    """What in directory ``path`` nanbisect did not write as a report: [] for a report it may
    replace, None when ``path`` is no report at all."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return None
    marker, head = path / MARKER, None
    if marker.is_file() and not marker.is_symlink():
        try:
            head = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(head, dict) or not str(head.get("schema", "")).startswith(
                "nanbisect.report/"):
            return None
    if isinstance(head, dict) and isinstance(head.get("files"), dict):
        ours = {f: d for f, d in head["files"].items() if isinstance(f, str)}
        # a file added since, or one of ours edited since (the user's notes in report.md)
        return sorted(f for f in _files(path) if f != MARKER
                      and (f not in ours or file_sha256(path / f, missing_ok=True) != ours[f]))
    # a report from before the marker listed its files: report.json with our schema, and at the
    # top level nothing a report does not hold
    try:
        names = {p.name for p in path.iterdir()}
        report = json.loads((path / "report.json").read_text()) if head is None else {}
    except (OSError, ValueError):
        return None
    if head is None and not (isinstance(report, dict) and str(report.get("schema", "")).startswith(
            "nanbisect.report/")):
        return None
    repro = path / "repro"
    inside = ([f"repro/{f}" for f in _files(repro) if f not in REPRO_FILES]
              if repro.is_dir() and not repro.is_symlink() else [])
    return sorted(names - REPORT_FILES) + inside


def is_report_dir(path: Path) -> bool:
    """Whether ``path`` is a directory nanbisect wrote as a report (and may replace)."""
    return foreign_files(path) == []


def _files(root: Path) -> list[str]:
    """Every entry under ``root`` but directories, as POSIX paths relative to it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel = Path(dirpath).relative_to(root)
        out += [(rel / n).as_posix() for n in filenames]
        out += [(rel / d).as_posix() for d in dirnames if (Path(dirpath) / d).is_symlink()]
    return out


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_out(out: Path, bundle: Path | None = None) -> Path:
    """Refuse an ``--out`` that would replace what nanbisect did not write; return it resolved.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "notes.txt").write_text("mine")
    >>> check_out(d)
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: --out '...': the directory exists and is not a nanbisect report (it holds notes.txt); nanbisect replaces only reports it wrote: pass a new or empty directory
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
        if _inside(resolved, b) and resolved != default:
            raise BadInput(f"--out '{given}' is inside the bundle; only BUNDLE/{DEFAULT_NAME} "
                           "may be written there: pass a directory outside the bundle")
        if _inside(b, resolved):
            raise BadInput(f"--out '{given}' holds the bundle; replacing it would delete the "
                           "bundle: pass a directory that does not contain it")
    if out.is_symlink():
        raise BadInput(f"--out '{given}' is a symbolic link; nanbisect does not replace links: "
                       "pass a plain directory path")
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out '{given}' is a file; pass a directory path for the report")
    foreign = foreign_files(out)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                          else "")
        raise BadInput(f"--out '{given}' is a nanbisect report, but {shown} in it was not "
                       "written by nanbisect and would be deleted: move it out, or pass a new "
                       "directory")
    if out.is_dir() and foreign is None:
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise BadInput(f"--out '{given}': the directory exists and is not a nanbisect report "
                           f"(it holds {shown}); nanbisect replaces only reports it wrote: pass a "
                           "new or empty directory")
    return out


@contextmanager
def staged(out: Path, bundle: Path | None = None) -> Iterator[Path]:
    """A hidden directory beside ``out`` that replaces it only if the block succeeds, and only
    if ``out`` is still absent, empty or a report (`check_out`)."""
    out = check_out(out, bundle)
    tmp = staging_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise BadInput(f"--out '{out}': the report cannot be written there ({e.strerror or e}); "
                       "pass --out with a directory you can write to") from None
    try:
        yield tmp
        # the marker lists what was written, with each file's sha256: a file someone adds or
        # edits later makes the directory no longer only ours
        files = {f: file_sha256(tmp / f, missing_ok=True) for f in sorted(_files(tmp))}
        (tmp / MARKER).write_text(json.dumps({"schema": "nanbisect.report/1", "files": files},
                                             indent=1) + "\n")
        check_out(out, bundle)     # NB: again: the block ran for minutes; the path may be taken
        old = None
        if out.exists():
            was_empty = out.is_dir() and not any(out.iterdir())
            old = staging_path(out, "old")
            out.rename(old)
            # NB: and once more, now that nobody can add to it: what we delete must be ours
            if not (foreign_files(old) == [] or (was_empty and not any(old.iterdir()))):
                rename_noreplace(old, out)
                raise BadInput(f"--out '{out}' changed while the report was written (files "
                               "were added to it); nothing was replaced: pass a new directory")
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise BadInput(f"--out '{out}' was created by someone else while the report was "
                           "written; nothing was replaced"
                           + (f" (the previous report is in '{old}')" if old else "")
                           + ": pass a new directory") from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_report(r: Report, out: Path) -> None:
    """Write report.json, report.md and report.html into ``out`` (a staged directory)."""
    (out / "report.json").write_text(json.dumps(r.to_json(), indent=1, allow_nan=False))
    (out / "report.md").write_text(to_markdown(r))
    (out / "report.html").write_text(to_html(r))
