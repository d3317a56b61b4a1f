"""Finding bundles under the directories triage is given: what is a bundle, what is skipped
and why.

Guarantees: iterative (any depth), never follows a link, never opens more than the first 4 KiB
of a manifest, never searches hidden directories, report directories or a bundle's own parts.
What triage is given to search and to write into is refused before anything runs
(`check_roots`, `check_outputs`), with the standard library only (no torch).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from nanbisect.errors import BadInput

MANIFEST = "manifest.json"          # = nanbisect.bundle.format.MANIFEST (not imported: torch)
MAX_MANIFEST = 64 << 20            # read_bundle's own bound; checked before reading a head



def _manifest_kind(path: Path) -> str | None:
    """None: a bundle candidate (also when its manifest is garbage: that is reported);
    otherwise why this manifest.json is not nanbisect's."""
    try:
        st = os.stat(path)
    except OSError:
        return None                      # dangling link, unreadable: an error row says why
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return None
    m = re.search(r'"schema"\s*:\s*"([^"]{0,200})"', head)
    if m and not m.group(1).startswith("nanbisect.bundle/"):
        return f"manifest.json is not a nanbisect manifest (schema {m.group(1)[:60]!r})"
    return None


def _is_report(path: Path) -> bool:
    return path.name == "nanbisect-report" or (path / ".nanbisect-report").exists()


def discover(roots: list[Path], exclude: tuple[Path, ...] = ()
             ) -> tuple[list[Path], list[dict]]:
    """(bundles, skipped) under ``roots``.

    A bundle is a directory holding a nanbisect ``manifest.json`` (one whose head names another
    schema is skipped); a multi-rank bundle's rank parts belong to it and report directories are
    ours, so neither is searched. Hidden directories (leftovers of killed captures among them)
    and ``exclude`` (triage's own output) are not searched. ``skipped`` lists the topmost
    directories holding no bundle, and links, each as {path, reason}. Iterative: a directory
    tree of any depth is fine.
    """
    bundles: list[Path] = []
    notes: dict[Path, str] = {}          # visited non-bundle dirs / links -> reason
    parent_of: dict[Path, Path | None] = {}
    excluded = {_ident(e) for e in exclude if os.path.isdir(e)}
    seen: set = set()
    for root in roots:
        stack: list[tuple[Path, Path | None]] = [(Path(root), None)]
        while stack:
            d, parent = stack.pop()
            real = _ident(d)
            if real in seen or real in excluded:
                continue
            seen.add(real)
            parent_of[d] = parent
            try:
                has_manifest = (d / MANIFEST).exists() or (d / MANIFEST).is_symlink()
            except OSError as e:       # a directory we may not search (another user's job)
                notes[d] = f"cannot look inside it ({e.strerror or e})"
                continue
            if has_manifest:
                why = _manifest_kind(d / MANIFEST)
                if why is None:
                    bundles.append(d)
                else:
                    notes[d] = why
                continue
            notes[d] = "no manifest.json in it or below it"
            stack += _below(d, notes, parent_of)
    return bundles, _skipped(bundles, notes, parent_of)


def _ident(p: Path):
    """What identifies a directory however it is reached (device and inode; the path when it
    cannot be stat'ed): O(1) per directory, unlike Path.resolve."""
    try:
        st = os.stat(p)
        return st.st_dev, st.st_ino
    except OSError:
        return str(p)


def _below(d: Path, notes: dict[Path, str], parent_of: dict[Path, Path | None]
           ) -> list[tuple[Path, Path]]:
    """The directories to search below ``d`` (last name first: popped in name order); hidden
    ones, report directories and files left out, a link to a directory noted, not followed."""
    try:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        notes[d] = f"cannot list it ({e.strerror or e})"
        return []
    out = []
    for e in reversed(entries):
        if e.name.startswith(".") or e.name == "nanbisect-report":
            continue
        p = Path(e.path)
        try:
            if e.is_symlink():
                if p.is_dir():
                    parent_of[p] = d
                    notes[p] = "a symbolic link to a directory, not followed"
                continue
            if not e.is_dir(follow_symlinks=False) or _is_report(p):
                continue
        except OSError:
            continue
        out.append((p, d))
    return out


def _skipped(bundles: list[Path], notes: dict[Path, str],
             parent_of: dict[Path, Path | None]) -> list[dict]:
    """The topmost noted directories holding no bundle (and links), each as {path, reason}."""
    containers: set[Path] = set()
    for b in bundles:
        p = parent_of.get(b)
        while p is not None and p not in containers:
            containers.add(p)
            p = parent_of.get(p)
    return [{"path": str(d), "reason": why} for d, why in sorted(notes.items())
            if d not in containers and (parent_of.get(d) is None
                                        or parent_of[d] in containers)]


def find_bundles(roots: list[Path]) -> list[Path]:
    """The bundles under ``roots`` (see `discover`); a missing root is `BadInput`."""
    check_roots(roots)
    return discover(roots)[0]


def check_roots(roots: list[Path]) -> None:
    if not roots:
        raise BadInput("triage: no directory given; pass the directories that hold bundles")
    for root in roots:
        if not Path(root).exists():
            raise BadInput(f"triage: '{root}' does not exist; pass directories holding bundles")
        if not Path(root).is_dir():
            raise BadInput(f"triage: '{root}' is a file, not a directory; pass directories "
                           "holding bundles")


def check_outputs(out: Path | None, cache: Path | None) -> None:
    """`BadInput` when ``--out`` or ``--cache`` names something that is not a directory (either
    may not exist yet: triage makes it)."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise BadInput(f"triage: --out '{out}' is a file; pass a directory for triage.json, "
                       "triage.md and the cache")
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        raise BadInput(f"triage: --cache '{cache}' is a file; pass a directory for the cached "
                       "analyses (a new one, or the --cache of earlier nights)")
