"""Write a report directory: report.json, report.md and report.html together, atomically (built
beside its final place, then renamed over it). Each file is rendered alone (`render`): one whose
rendering raises is written in a plain form and listed in the report's ``errors``, the others
are whole; report.json is strict JSON whatever numbers the report holds.

Guarantees: nanbisect never deletes what it did not write. `check_out` (its home is
`nanbisect.report.out`, which the command line calls before importing torch) refuses a report
directory that would replace anything but an earlier nanbisect report it can prove unchanged (by its
`MARKER` file, which lists every file the report was written with and its sha256: a file added
or edited since makes the directory not ours; a report from before the marker listed its files
cannot be proven unchanged and is refused with how to proceed), an existing file, a mount point,
the bundle itself, a path inside the bundle other than ``BUNDLE/nanbisect-report``, and a
directory that holds the bundle; an empty directory is taken as it is. `staged` checks again just
before it renames, and once more after moving the old report aside (so a file added in that
instant is put back, not deleted); the new report is renamed in without ever replacing a
directory that appeared meanwhile. A report that cannot be written there (no room, a read-only
or busy file system, no permission) is a one-line `BadInput` and leaves nothing behind: the
staging directory and any directories `staged` created are removed, an old report moved aside is
put back.
Not guaranteed: that an OS error without a file name during the block (no room, read-only) came
from writing the report rather than from the replay's own code.
"""
from __future__ import annotations

import contextlib
import errno
import html
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from nanbisect.bundle.atomic import rename_noreplace
from nanbisect.errors import BadInput
from nanbisect.records import StageError, after_verdict
from nanbisect.report.model import SCHEMA, Report
from nanbisect.report.page import to_html
from nanbisect.report.prose import to_markdown
from nanbisect.report.out import (DEFAULT_NAME, MARKER, check_out,  # noqa: F401
                                  files_under, foreign_files, inside, is_report_dir,
                                  older_report)
from nanbisect.util.files import file_sha256, os_error, remove_made
from nanbisect.util.recordjson import dumps
from nanbisect.util.staging import MARKER as STAGING_MARKER
from nanbisect.util.staging import make_staging_dir, mark, staging_path, unmark

@contextmanager
def staged(out: Path, bundle: Path | None = None) -> Iterator[Path]:
    """A hidden directory beside ``out`` that replaces it only if the block succeeds, and only
    if ``out`` is still absent, empty or a report (`check_out`). A failure to write there (in
    the block too: the repro's tensors, the report's files) is a one-line `BadInput`."""
    out = check_out(out, bundle)
    made = [d for d in (out.parent, *out.parent.parents) if not d.exists()]   # innermost first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_staging_dir(staging_path(out))   # marked: `nanbisect clean` may remove it
    except OSError as e:
        remove_made(made)
        raise _cannot_write(out, e) from None
    try:
        yield tmp
        # the marker lists what was written, with each file's sha256: a file someone adds or
        # edits later makes the directory no longer only ours
        files = {f: file_sha256(tmp / f, missing_ok=True) for f in sorted(files_under(tmp))
                 if f != STAGING_MARKER}
        (tmp / MARKER).write_text(json.dumps({"schema": "nanbisect.report/1", "files": files},
                                             indent=1) + "\n")
        check_out(out, bundle)     # NB: again: the block ran for minutes; the path may be taken
        _replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made(made)
        err = None if isinstance(e, BadInput) else os_error(e)
        if err is not None and _about_out(err, out, tmp):
            raise _cannot_write(out, err) from None
        raise


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``, moving an earlier report there aside first and
    deleting it only after; on any failure the earlier report is put back."""
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
        with contextlib.suppress(OSError):
            mark(old)       # proven ours: if we are killed now, `nanbisect clean` may remove it
    try:
        unmark(tmp)
        rename_noreplace(tmp, out)
    except BaseException as e:
        if old is not None:
            with contextlib.suppress(OSError):
                unmark(old)
            if not isinstance(e, FileExistsError):
                with contextlib.suppress(OSError):
                    rename_noreplace(old, out)      # put the earlier report back
                    old = None
        if isinstance(e, FileExistsError):
            raise BadInput(f"--out '{out}' was created by someone else while the report was "
                           "written; nothing was replaced"
                           + (f" (the previous report is in '{old}')" if old else "")
                           + ": pass a new directory") from None
        err = os_error(e)
        if old is not None and err is not None:
            raise BadInput(f"--out '{out}': the report cannot be written there "
                           f"({err.strerror or err}); the previous report is in '{old}': move "
                           "it back, or pass --out with a directory you can write to") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# what a write to a file system can fail with, whoever's file it was
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _about_out(err: OSError, out: Path, tmp: Path) -> bool:
    """Whether ``err`` came from writing the report: it names a path there (beside ``out`` or
    inside ``tmp`` or ``out``), or it names none and says the file system is full or
    read-only."""
    names = [n for n in (err.filename, err.filename2) if n is not None]
    if not names:
        return err.errno in _NO_ROOM
    paths = [Path(os.path.abspath(os.fsdecode(n))) for n in names]
    return any(p.parent == out.parent or inside(p, tmp) or inside(p, out) for p in paths)


def _cannot_write(out: Path, e: OSError) -> BadInput:
    return BadInput(f"--out '{out}': the report cannot be written there ({e.strerror or e}); "
                    "nothing was written: pass --out with a directory you can write to, on a "
                    "file system with room for it")


def write_report(r: Report, out: Path) -> Report:
    """Write report.json, report.md and report.html into ``out`` (a staged directory); the
    report as written: ``r``, plus in ``errors`` each rendering that raised (``markdown``,
    ``page``, ``plots``, ``json``: written then in a plain form that lists the errors).
    report.json is strict JSON: non-finite numbers are "nan", "inf", "-inf"
    (`nanbisect.util.recordjson`). What writing a file raises goes through (`staged`)."""
    r, text, page, data = render(r)
    (out / "report.json").write_text(data)
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(page)
    return r


def render(r: Report) -> tuple[Report, str, str, str]:
    """(``r`` with the renderings that failed in ``errors``, report.md, report.html,
    report.json): each rendered alone, so that one that raises leaves the others whole."""
    def all_three(r: Report, failed: list[StageError]
                  ) -> tuple[str | None, str | None, str | None]:
        plots: list[StageError] = []            # a plot that raised: the page without it
        text = after_verdict(failed, "markdown", lambda: to_markdown(r), None)
        data = after_verdict(failed, "json", lambda: dumps(r.to_json(), indent=1), None)
        folded = data if data is not None else dumps(_plain_json(r), indent=1)
        page = after_verdict(failed, "page", lambda: to_html(r, plots, folded), None)
        failed += plots
        return text, page, data

    failed: list[StageError] = []
    text, page, data = all_three(r, failed)
    if failed:
        r = replace(r, errors=[*r.errors, *failed])
        text, page, data = all_three(r, [])     # again: each lists every error now
    text = text if text is not None else _plain_markdown(r)
    return (r, text, page if page is not None else _plain_page(r, text),
            data if data is not None else dumps(_plain_json(r), indent=1))


def _plain_json(r: Report) -> dict:
    """What report.json holds when the report's own JSON cannot be made."""
    return {"schema": SCHEMA, "verdict": str(r.verdict),
            "classification": None if r.classification is None else str(r.classification),
            "phase": r.phase, "kind": r.kind,
            "errors": [{"stage": e.stage, "message": e.message} for e in r.errors]}


def _plain_markdown(r: Report) -> str:
    """report.md when the report cannot be rendered: the verdict and the errors."""
    return "\n".join([f"# nanbisect report: {r.verdict}", "", "## Errors", ""]
                     + [f"- {e.stage}: {e.message}" for e in r.errors]) + "\n"


def _plain_page(r: Report, text: str) -> str:
    """report.html when the page cannot be rendered: report.md as preformatted text."""
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>nanbisect: {html.escape(str(r.verdict))}</title></head><body>"
            f"<pre>{html.escape(text)}</pre></body></html>\n")
