"""Where a bundle is: the checks on a bundle path that need no more than the file system (it
exists, it is a directory, it holds ``manifest.json``, or it is a folder of bundles), so the
command line answers a wrong path before importing torch; `nanbisect.bundle.format.read_bundle`
starts with the same checks. Imports nothing but the standard library and `nanbisect.errors`.
Not checked here: anything inside the manifest (`read_bundle` does that).
"""
from __future__ import annotations

import os
from pathlib import Path

from nanbisect.errors import BadInput

MANIFEST = "manifest.json"


def bundles_inside(p: Path, limit: int = 10_000) -> list[str]:
    """Names of the directories directly in ``p`` that hold a manifest.json, sorted (a Guard's
    ``out`` folder); at most ``limit`` entries are looked at."""
    names = []
    try:
        with os.scandir(p) as it:
            for i, e in enumerate(it):
                if i >= limit:
                    break
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False) and \
                        os.path.isfile(os.path.join(e.path, MANIFEST)):
                    names.append(e.name)
    except OSError:
        return []
    return sorted(names)


def check_bundle_dir(path: str | Path, manifest: bool = True) -> Path:
    """``path`` as a `Path` when it is a directory (holding ``manifest.json`` when
    ``manifest``); else `BadInput` naming the problem and the fix.

    >>> check_bundle_dir("nope/step000001")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: bundle 'nope/step000001' does not exist; pass the directory ...
    """
    p = Path(path)
    if not p.exists():
        raise BadInput(f"bundle '{p}' does not exist; pass the directory written by "
                       "nanbisect.capture or Guard (it holds manifest.json)")
    if not p.is_dir():
        if p.name.endswith((".tar.gz", ".tgz", ".tar")):
            raise BadInput(f"'{p}' is a ticket archive, not a bundle; unpack it first: "
                           f"nanbisect unpack '{p}' DIR, then nanbisect run DIR/bundle")
        raise BadInput(f"bundle '{p}' is a file, not a directory; pass the bundle directory "
                       "that holds manifest.json")
    if manifest and not os.path.lexists(p / MANIFEST):
        if os.path.isfile(p / "report.json"):
            parent = p.parent if os.path.isfile(p.parent / MANIFEST) else None
            raise BadInput(f"'{p}' is a report directory, not a bundle; "
                           + (f"run its bundle: nanbisect run '{parent}'" if parent is not None
                              else "run the bundle it was written for"))
        if os.path.isfile(p / "pack.json") and os.path.isfile(p / "bundle" / MANIFEST):
            raise BadInput(f"'{p}' is an unpacked ticket; run its bundle: nanbisect run "
                           f"'{p / 'bundle'}'")
        inside = bundles_inside(p)
        if inside:
            shown = ", ".join(inside[:5]) + (f" and {len(inside) - 5} more"
                                             if len(inside) > 5 else "")
            raise BadInput(f"'{p}' is a folder of {len(inside)} bundle(s) ({shown}), not one "
                           f"bundle; pass one of them (e.g. '{p / inside[-1]}'), or replay them "
                           f"all with: nanbisect triage '{p}'")
        raise BadInput(f"bundle '{p}' has no manifest.json; it is not a nanbisect bundle or its "
                       "capture did not finish; re-capture it")
    return p
