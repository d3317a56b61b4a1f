"""Exit 0 when this Python already has what `scripts/setup.sh` would install, else 1 (then the
set-up runs pip): nanbisect installed editable from this checkout at pyproject.toml's version,
with its commands, and every requirement pyproject.toml lists now (its dependencies, plus the
extras named in argv[1], e.g. ".[test]") met by an installed distribution, one level of extras
deep. A plain check of installed metadata, in well under a second, where `pip install -e` takes
20 s to say "already satisfied". Any doubt (a missing file, an unreadable version) answers 1.

Usage: python scripts/setup_satisfied.py '.[test]'
"""
from __future__ import annotations

import json
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _met(req: Requirement, extra: str = "") -> bool:
    if req.marker is not None and not req.marker.evaluate({"extra": extra}):
        return True
    try:
        dist = metadata.distribution(req.name)
    except metadata.PackageNotFoundError:
        return False
    if not req.specifier.contains(Version(dist.version), prereleases=True):
        return False
    for want in req.extras:      # the extra's own requirements, one level
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is not None and sub.marker.evaluate({"extra": want}) and \
                    not sub.marker.evaluate({"extra": ""}):
                sub.marker = None
                if not _met(sub):
                    return False
    return True


def _editable_here(direct_url: str | None) -> bool:
    url = json.loads(direct_url or "{}")
    return bool(url.get("dir_info", {}).get("editable")) and url.get("url") == ROOT.as_uri()


def satisfied(what: str) -> bool:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the installed one (a checkout's own nanbisect.egg-info, on sys.path under pytest, is not)
    dist = next((d for d in metadata.distributions(name=project["name"])
                 if _editable_here(d.read_text("direct_url.json"))), None)
    if dist is None:
        return False
    if dist.version != project["version"] or project.get("scripts", {}) != {
            ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}:
        return False
    wanted = list(project.get("dependencies", []))
    m = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", what)
    if m is None:
        return False
    for extra in filter(None, (e.strip() for e in (m.group(1) or "").split(","))):
        wanted += project.get("optional-dependencies", {}).get(extra, [None])
    return None not in wanted and all(_met(Requirement(r)) for r in wanted)


if __name__ == "__main__":
    try:
        ok = satisfied(sys.argv[1] if len(sys.argv) > 1 else ".")
    except Exception:  # noqa: BLE001 - any doubt: let pip decide
        ok = False
    sys.exit(0 if ok else 1)
