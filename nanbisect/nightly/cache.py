"""The analysis cache: a key made of what the bundle holds and of the code and versions that
would replay it now, and ``DIR/<key>.json`` files holding the reports.

Guarantees: nothing pickled; an unreadable or foreign cache file is a miss; a user source file
that is huge or special is keyed by kind and size, never read whole.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from nanbisect import __version__
from nanbisect.bundle.manifest import Manifest
from nanbisect.nightly.find import MAX_MANIFEST, MANIFEST
from nanbisect.nightly.reports import copy_in
from nanbisect.util.files import file_sha256, read_json, source_digest, write_atomic
from nanbisect.util.recordjson import dumps

# /2 (issue 38): signatures name a backward culprit by its autograd node (report.json's
# ``culprit.node``); a report cached before it existed would sign the same bug another way than
# a fresh replay does, so those entries are misses (replayed once), never mixed into a night
# /3: signatures name the code site by its function (``culprit.function``), which a report
# cached before it lacks: those entries are misses too
CACHE_SCHEMA = "nanbisect.triage-cache/3"
_MAX_SOURCE = 16 << 20              # a user source file bigger than this is keyed by size+mtime
MAX_REPORT = 64 << 20



def _entry_file(bundle: Path, view: Manifest) -> Path | None:
    """The file the replay will import for a ``path.py:func`` entry (as `resolve_entry` finds
    it: beside the bundle, here, or where it was)."""
    entry = view.entry
    if not isinstance(entry, str):
        return None
    target = entry.rpartition(":")[0]
    if not target.endswith(".py"):
        return None
    rel = view.entry_file_from_bundle
    cands = [bundle / rel] if isinstance(rel, str) and rel else []
    cands.append(Path(target))
    if isinstance(view.capture_entry_file, str):
        cands.append(Path(view.capture_entry_file))
    for c in cands:
        try:
            if c.is_file():
                return c.resolve()
        except (OSError, ValueError):
            continue
    return None


def cache_key(bundle, options: dict) -> tuple[str, dict]:
    """(key, what it was made of) for a bundle that `read_bundle` accepted."""
    import torch

    from nanbisect.bundle.code import relocation

    view = Manifest.of(bundle)
    entry_file = _entry_file(bundle.path, view)
    captured = view.entry_file
    moved = relocation(captured, str(entry_file)) if isinstance(captured, str) and entry_file \
        else None
    recorded = dict(view.sources)
    if bundle.multi_rank:
        for part in view.part_dirs.values():
            try:
                raw = (bundle.path / part / MANIFEST).read_bytes()
                recorded.update(Manifest(json.loads(raw[:MAX_MANIFEST])).sources)
            except Exception:  # noqa: BLE001 - read_bundle verified them; the key stays usable
                continue
    sources = {}
    for p in sorted(k for k in recorded if isinstance(k, str))[:100_000]:
        path = Path(p)
        if moved is not None:
            try:
                cand = moved[1] / path.relative_to(moved[0])
                if cand.is_file():
                    path = cand
            except ValueError:
                pass
        sources[p] = source_digest(path, _MAX_SOURCE)
    material = {"schema": CACHE_SCHEMA,
                "manifest": file_sha256(bundle.path / MANIFEST),
                "entry": view.entry,
                "entry_file": source_digest(entry_file, _MAX_SOURCE) if entry_file else None,
                "sources": sources, "options": options,
                "nanbisect": __version__, "torch": torch.__version__}
    key = hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()
    return key, material


def content_hash(bundle: Path) -> str:
    """sha256 of the bundle's manifest (which holds every file's sha256)."""
    return file_sha256(Path(bundle) / MANIFEST)


class Cache:
    """``DIR/<key>.json`` = {schema, key, report}; written atomically, unreadable = a miss.
    ``DIR/<key>.d/``: the report directory itself (report.html, repro/), for a hit to show."""

    def __init__(self, root: Path | None):
        self.root = root

    def get(self, key: str) -> dict | None:
        if self.root is None:
            return None
        data = read_json(self.root / f"{key}.json", MAX_REPORT)
        if isinstance(data, dict) and data.get("schema") == CACHE_SCHEMA and \
                data.get("key") == key and isinstance(data.get("report"), dict):
            return data["report"]
        return None

    def put(self, key: str, report: dict) -> None:
        if self.root is None:
            return
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / f"{key}.json",
                          dumps({"schema": CACHE_SCHEMA, "key": key, "report": report}))

    def report_dir(self, key: str) -> Path | None:
        """The cached report directory of ``key``, when one was kept."""
        d = None if self.root is None else self.root / f"{key}.d"
        return d if d is not None and (d / "report.json").is_file() else None

    def put_dir(self, key: str, src: Path) -> None:
        """Keep a copy of the report directory ``src`` for ``key`` (renamed in whole)."""
        if self.root is not None:
            copy_in(src, self.root / f"{key}.d")
