"""Write a report directory: report.json, report.md and report.html together, atomically (built
beside its final place, then renamed over it)."""
from __future__ import annotations

import json
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanbisect.report.model import Report
from nanbisect.report.page import to_html
from nanbisect.report.text import to_markdown


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden directory beside ``out`` that replaces it only if the block succeeds."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        tmp.rename(out)
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
