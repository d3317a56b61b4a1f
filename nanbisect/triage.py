"""`nanbisect triage DIR...`: every bundle under the given directories, replayed in parallel,
grouped by culprit signature, for nightly jobs.

Guarantees: bundles are replayed by joblib in at most ``jobs`` worker processes (default: as many
as cores and free memory allow, counting each bundle's files three times over); each analysis is
cached by the bundle's content hash (its manifest, which holds every file's sha256, checked
against the files before each lookup), the options
and the nanbisect version with `joblib.Memory`, so a rerun recomputes nothing that did not
change. One bad bundle is reported in ``errors`` and does not stop the others.

Exit protocol (for CI):
  0  no failures: every bundle replayed clean
  1  failures, all with known signatures (``--known``)
  3  at least one new signature
  2  no new signature, but some bundle could not be triaged (listed in ``errors``)
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from nanbisect import __version__
from nanbisect.bundle.format import MANIFEST, read_bundle
from nanbisect.errors import BadInput

SCHEMA = "nanbisect.triage/1"
EXIT_CLEAN, EXIT_KNOWN, EXIT_ERRORS, EXIT_NEW = 0, 1, 2, 3


def find_bundles(roots: list[Path]) -> list[Path]:
    """Directories holding a nanbisect manifest; the parts of a multi-rank bundle are not
    bundles of their own, and report directories are skipped."""
    found = []
    for root in roots:
        if not root.exists():
            raise BadInput(f"triage: '{root}' does not exist; pass directories holding bundles")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                                 and d != "nanbisect-report")
            if MANIFEST in filenames and _looks_like_bundle(Path(dirpath) / MANIFEST):
                found.append(Path(dirpath))
                dirnames[:] = []  # a multi-rank bundle's rank parts belong to it
    return found


def _looks_like_bundle(manifest: Path) -> bool:
    try:
        head = manifest.read_text(errors="replace")[:4096]
    except OSError:
        return False
    return "nanbisect.bundle/" in head or '"schema"' not in head  # garbage counts: reported


def normalise_module(name: str) -> str:
    """``layers.17.mlp`` -> ``layers.N.mlp``: the same code at another depth groups together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "N", name)


def signature(report: dict) -> str | None:
    c = report.get("culprit")
    if report.get("verdict") != "culprit" or not c:
        if report.get("verdict") == "input-nonfinite":
            return "input-nonfinite · data"
        if report.get("verdict") == "not-reproduced":
            return "not-reproduced · transient"
        return None
    return " · ".join([c.get("op") or "-", normalise_module(c.get("module") or ""),
                       c.get("phase") or "-", ",".join(c.get("input_dtypes") or []) or "-",
                       report.get("classification") or "-"])


def content_hash(bundle: Path) -> str:
    return hashlib.sha256((bundle / MANIFEST).read_bytes()).hexdigest()


def _analyse(digest: str, options: dict, version: str, bundle: str) -> dict:
    """One bundle -> its report as JSON (runs in a worker; cached by digest, options and
    version, not by path: a moved bundle is still a hit)."""
    from nanbisect.pipeline import RunOptions, run_bundle

    report = run_bundle(bundle, RunOptions(**options))
    return report.to_json()


@dataclass(frozen=True)
class TriageResult:
    data: dict
    exit_code: int


def _jobs(bundles: list[Path], jobs: int | None) -> int:
    if jobs:
        return max(1, jobs)
    cores = os.cpu_count() or 1
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return cores
    biggest = max((sum(f.stat().st_size for f in b.rglob("*.safetensors")) for b in bundles),
                  default=0)
    return max(1, min(cores, len(bundles), int(avail // max(3 * biggest, 1 << 28))))


def triage(roots: list[Path], *, jobs: int | None = None, known: set[str] = frozenset(),
           cache: Path | None = None, options: dict | None = None) -> TriageResult:
    """Triage every bundle under ``roots``.

    >>> import shutil, tempfile
    >>> night = Path(tempfile.mkdtemp())
    >>> _ = shutil.copytree("fixtures/bundles/nan_batch", night / "job1" / "step5",
    ...                     ignore=shutil.ignore_patterns("nanbisect-report"))
    >>> [(g["signature"], g["count"]) for g in triage([night], jobs=1).data["signatures"]]
    [('input-nonfinite · data', 1)]
    """
    from joblib import Memory, Parallel, delayed

    bundles = find_bundles(roots)
    options = {"reference": "none", **(options or {})}
    memory = Memory(str(cache) if cache else None, verbose=0)
    analyse = memory.cache(_analyse, ignore=["bundle"])
    results, errors = [], []
    digests = {}
    for b in bundles:
        try:
            read_bundle(b)  # NB: checksums first: the cache key trusts the manifest's sha256s
            digests[b] = content_hash(b)
        except BadInput as e:
            errors.append({"bundle": str(b), "error": str(e)})
    todo = [b for b in bundles if b in digests]

    # what the cache already holds, asked before the workers run (triage.json says, per bundle)
    cached = {b: analyse.check_call_in_cache(digests[b], options, __version__, bundle=str(b))
              for b in todo}

    def guarded(b: Path):
        try:
            return {"bundle": str(b), "report": analyse(digests[b], options, __version__,
                                                         bundle=str(b)), "cached": cached[b]}
        except BadInput as e:
            return {"bundle": str(b), "error": str(e)}
        except Exception as e:  # noqa: BLE001 - one broken bundle must not stop the night
            return {"bundle": str(b), "error": f"{type(e).__name__}: {str(e)[:300]}"}

    outs = Parallel(n_jobs=_jobs(todo, jobs), backend="loky")(delayed(guarded)(b) for b in todo) \
        if todo else []
    for o in outs:
        (errors if "error" in o else results).append(o)
    groups: dict[str, dict] = {}
    for r in results:
        sig = signature(r["report"])
        if sig is None:
            continue
        created = _created(Path(r["bundle"]))
        g = groups.setdefault(sig, {"signature": sig, "count": 0, "first_seen": created,
                                    "example": r["bundle"], "known": sig in known,
                                    "classification": r["report"].get("classification"),
                                    "bundles": []})
        g["count"] += 1
        g["bundles"].append(r["bundle"])
        if created and (g["first_seen"] is None or created < g["first_seen"]):
            g["first_seen"], g["example"] = created, r["bundle"]
    sigs = sorted(groups.values(), key=lambda g: (-g["count"], g["signature"]))
    data = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "nanbisect": __version__, "roots": [str(r) for r in roots],
            "bundles": [{"bundle": r["bundle"], "verdict": r["report"]["verdict"],
                         "signature": signature(r["report"]), "cached": r["cached"]}
                        for r in results],
            "signatures": sigs, "errors": errors}
    if any(not g["known"] for g in sigs):
        code = EXIT_NEW
    elif errors:
        code = EXIT_ERRORS
    elif sigs:
        code = EXIT_KNOWN
    else:
        code = EXIT_CLEAN
    data["exit_code"] = code
    return TriageResult(data, code)


def _created(bundle: Path) -> str | None:
    """When the bundle was written (a multi-rank bundle written before the top manifest carried
    it: rank 0's part)."""
    for m in (bundle / MANIFEST, bundle / "rank0" / MANIFEST):
        try:
            created = json.loads(m.read_text()).get("created")
        except (OSError, ValueError):
            continue
        if created:
            return created
    return None


def load_known(path: Path) -> set[str]:
    """Known signatures: a previous triage.json, or a text file with one signature a line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise BadInput(f"--known '{path}': {e.strerror}; pass a triage.json or a text file") \
            from None
    try:
        return {g["signature"] for g in json.loads(text)["signatures"]}
    except (ValueError, KeyError, TypeError):
        return {line.strip() for line in text.splitlines() if line.strip()}


def to_markdown(data: dict) -> str:
    lines = ["# nanbisect triage", "", f"{len(data['bundles'])} bundle(s) triaged, "
             f"{len(data['signatures'])} signature(s), {len(data['errors'])} error(s); exit "
             f"code {data['exit_code']}.", "",
             "| count | signature (op, module, phase, dtypes, classification) | first seen | "
             "example | known |", "|---|---|---|---|---|"]
    for g in data["signatures"]:
        lines.append(f"| {g['count']} | `{g['signature']}` | {g['first_seen'] or '-'} | "
                     f"`{g['example']}` | {'yes' if g['known'] else '**new**'} |")
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- `{e['bundle']}`: {e['error']}"
                                          for e in data["errors"]]
    clean = [b["bundle"] for b in data["bundles"] if b["signature"] is None]
    if clean:
        lines += ["", "## No failure", ""] + [f"- `{b}`" for b in clean]
    return "\n".join(lines) + "\n"
