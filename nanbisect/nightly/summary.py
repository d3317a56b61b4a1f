"""The summary of a run: ``triage.json`` (rows, signature groups, exit code, notes) and
``triage.md``.

Guarantees: each write replaces the whole file atomically (a reader never sees half of one).
A bundle whose report could not be kept under ``OUT/reports`` says why on its row
(``report_error``, one line), in triage.md, and in the one line `reports_not_written` makes of
them all; such a night is never 0 or 1 (`EXIT_ERRORS`, unless a signature is new).
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nanbisect import __version__
from nanbisect.errors import BadInput
from nanbisect.nightly.find import MAX_MANIFEST, MANIFEST
from nanbisect.nightly.index import to_html
from nanbisect.nightly.reports import REPORTS, drop, report_name
from nanbisect.nightly.summary_words import (EXIT_CLEAN, EXIT_ERRORS, EXIT_KNOWN, EXIT_NEW,
                                           counts_text)
from nanbisect.report.model import Report
from nanbisect.nightly.signatures import as_report, older_signatures, signature
from nanbisect.util.files import write_atomic
from nanbisect.util.recordjson import dumps
from nanbisect.util.text import clip

SCHEMA = "nanbisect.triage/1"
MAX_ERROR = 1000    # characters of an error row's message


@dataclass(frozen=True)
class TriageResult:
    data: dict
    exit_code: int


@dataclass
class NightState:
    roots: list[Path]
    known: set
    out: Path | None
    options: dict
    backend: str
    timeout: float
    results: dict = field(default_factory=dict)     # bundle -> row
    errors: dict = field(default_factory=dict)      # bundle -> {bundle, error, ...}
    pending: set = field(default_factory=set)
    skipped: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    interrupted: str | None = None
    finished: bool = False
    started: float = field(default_factory=time.monotonic)
    written: float = 0.0
    previous: set | None = None                     # the last night's signatures, if any
    progress: Callable[[int, int], None] | None = None   # (done, total): `tell`
    notes: list = field(default_factory=list)      # one line each, said once (triage.json)

    def report_path(self, bundle: str) -> Path | None:
        """Where ``bundle``'s report is kept: ``out/reports/NAME`` (None without ``out``)."""
        return None if self.out is None else self.out / REPORTS / report_name(bundle)

    def data(self) -> dict:
        results = [self.results[k] for k in sorted(self.results)]
        errors = [self.errors[k] for k in sorted(self.errors)]
        if self.finished:
            why = (f"triage interrupted by {self.interrupted} before this bundle finished"
                   if self.interrupted else "triage ended before this bundle finished")
            errors += [{"bundle": b, "error": why, "kind": "interrupted"}
                       for b in sorted(self.pending) if b not in self.errors]
            errors.sort(key=lambda e: e["bundle"])
        groups: dict[str, dict] = {}
        for r in results:
            sig = r["signature"]
            if sig is None:
                continue
            created = r.get("created")
            # a known list or last night's summary may hold an older form of the signature
            names = {sig, *r["older"]}
            g = groups.setdefault(sig, {"signature": sig, "count": 0, "first_seen": created,
                                        "example": r["bundle"], "known": False,
                                        "new_since_last": None if self.previous is None
                                        else True,
                                        "classification": r.get("classification"),
                                        "remedies": [], "tried": [], "bundles": []})
            g["known"] = g["known"] or bool(names & self.known)
            if self.previous is not None and names & self.previous:
                g["new_since_last"] = False
            g["count"] += 1
            for kind in r.get("remedies") or []:     # what made a step of this kind finite
                if kind not in g["remedies"]:
                    g["remedies"].append(kind)
            for kind in r.get("tried") or []:        # what was replayed and did not help
                if kind not in g["tried"]:
                    g["tried"].append(kind)
            g["bundles"].append(r["bundle"])
            if created and (g["first_seen"] is None or created < g["first_seen"]):
                g["first_seen"], g["example"] = created, r["bundle"]
        sigs = sorted(groups.values(), key=lambda g: (-g["count"], g["signature"]))
        unkept = any(r.get("report_error") for r in results)
        if any(not g["known"] for g in sigs):
            code = EXIT_NEW
        elif errors or self.interrupted or self.pending or unkept:
            code = EXIT_ERRORS
        elif sigs:
            code = EXIT_KNOWN
        else:
            code = EXIT_CLEAN
        return {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "nanbisect": __version__, "roots": [str(r) for r in self.roots],
                "host": f"{socket.gethostname()}:{os.getpid()}",
                "backend": self.backend, "timeout_s": self.timeout,
                "options": self.options, "finished": self.finished,
                "interrupted": self.interrupted,
                "seconds": round(time.monotonic() - self.started, 1),
                "pending": [] if self.finished else sorted(self.pending),
                "bundles": [{k: v for k, v in r.items() if k not in ("created", "older")}
                            for r in results],
                "signatures": sigs, "errors": errors, "skipped": self.skipped,
                "leftovers": self.leftovers, "notes": list(self.notes), "exit_code": code}

    def write(self, final: bool = False) -> dict | None:
        """Replace the summary files; during the run a failed write is retried at the next
        bundle, the final one is `BadInput` when it fails. A night of more than 500 bundles is
        rewritten at most once a second (each write is of the whole summary)."""
        now = time.monotonic()
        if not final and len(self.results) + len(self.errors) > 500 and now - self.written < 1:
            return None
        self.written = now
        data = self.data()
        if self.out is not None:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                write_atomic(self.out / "triage.json", dumps(data, indent=1))
                write_atomic(self.out / "triage.md", to_markdown(data))
                write_atomic(self.out / "index.html", _index(data))
            except OSError as e:
                if final:
                    unkept = sum(bool(b.get("report_error")) for b in data["bundles"])
                    raise BadInput(f"triage: cannot write triage.json into --out '{self.out}' "
                                   f"({e.strerror or e}); pass a writable directory"
                                   + (f" (the reports of {unkept} bundle(s) could not be "
                                      "written either)" if unkept else "")) from None
        return data

    def tell(self) -> None:
        """Call ``progress(done, total)`` (bundles finished, bundles found), if any; what it
        raises is ignored (a display must never stop the night)."""
        if self.progress is None:
            return
        done = len(self.results) + len(self.errors)
        try:
            self.progress(done, done + len(self.pending))
        except Exception:  # noqa: BLE001
            pass

    def add(self, res: dict, cached: bool) -> None:
        """Record ``res``, the row of a finished bundle, and `tell`."""
        self._add(res, cached)
        self.tell()

    def _add(self, res: dict, cached: bool) -> None:
        b = res["bundle"]
        self.pending.discard(b)
        if "error" in res:    # a message may quote the bundle: one bounded line in every file
            self.errors[b] = {**res, "error": clip(res["error"], MAX_ERROR)}
            if self.report_path(b) is not None:
                drop(self.report_path(b))       # an earlier night's verdict is not tonight's
            return
        try:
            rep = as_report(res["report"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:   # not what run writes
            why = f"its report.json cannot be read ({type(e).__name__}: {str(e)[:200]})"
            rest = {k: v for k, v in res.items() if k not in ("report", "report_dir")}
            return self._add({**rest, "error": why, "kind": "crash"}, cached)
        self.results[b] = {"bundle": b, "verdict": rep.verdict.value,
                           "classification": rep.classification and rep.classification.value,
                           "signature": signature(rep), "older": older_signatures(rep),
                           "cached": cached,
                           "remedies": remedy_kinds(rep),
                           "tried": remedy_kinds(rep, ("still-failing", "error")),
                           "seconds": res.get("seconds", 0.0), "worker": res.get("worker"),
                           "threads": res.get("threads"),
                           "report_dir": self._relative(res.get("report_dir")),
                           "report_error": _report_error(res, self.out),
                           **({"same_as": res["same_as"]} if "same_as" in res else {}),
                           "created": _created(Path(b))}
        if not res.get("report_dir") and self.report_path(b) is not None:
            drop(self.report_path(b))           # an earlier night's verdict is not tonight's


    def _relative(self, path: str | None) -> str | None:
        """A kept report directory as the summary names it: relative to ``out``."""
        if not path or self.out is None:
            return None
        try:
            return Path(path).absolute().relative_to(self.out.absolute()).as_posix()
        except ValueError:
            return path


def _report_error(res: dict, out: Path | None) -> str | None:
    """Why a finished bundle's report is not under ``out`` (one bounded line), None when it
    is (or when there is no ``out``)."""
    if out is None or res.get("report_dir"):
        return None
    return clip(res.get("report_error") or "its report directory was not kept (no reason "
                "given)", MAX_ERROR)


def reports_not_written(data: dict) -> str | None:
    """One line for a night some of whose reports could not be written (the count, the first
    reason, the fix), None when every report was kept.

    >>> print(reports_not_written({"bundles": [{"bundle": "a", "report_error": None},
    ...     {"bundle": "b", "report_error": "No space left on device: '/n/reports/b-1'"}]}))
    the report of 1 of 2 bundle(s) could not be written (b: No space left on device:
    '/n/reports/b-1'); free space there (or make it writable) and run triage again;
    triage.json's report_error names each
    """
    unkept = [b for b in data.get("bundles") or [] if b.get("report_error")]
    if not unkept:
        return None
    first = unkept[0]
    return (f"the report of {len(unkept)} of {len(data['bundles'])} bundle(s) could not be "
            f"written ({clip(first['bundle'], 200)}: {clip(first['report_error'], 400)}); "
            "free space there (or make it writable) and run triage again; triage.json's "
            "report_error names each")


def _index(data: dict) -> str:
    """index.html; a bug of its own costs the page, never the night's summary."""
    try:
        return to_html(data)
    except Exception as e:  # noqa: BLE001 - triage.json and triage.md are still written
        return (f"<!doctype html><title>nanbisect triage</title><p>index.html could not be "
                f"rendered ({html.escape(type(e).__name__)}: {html.escape(str(e)[:200])}); "
                "triage.md and triage.json hold the night.</p>\n")


def remedy_kinds(report: Report | dict, outcomes: tuple[str, ...] = ("finite",)) -> list[str]:
    """The kinds of the report's remedies whose replay made the step finite (or ended in one of
    ``outcomes``), in order tried.

    >>> remedy_kinds({"verdict": "culprit",
    ...               "remedies": [{"kind": "precision", "outcome": "still-failing"},
    ...                            {"kind": "samples", "outcome": "finite"}]})
    ['samples']
    """
    kinds: list[str] = []
    for r in as_report(report).remedies:
        if r.outcome in outcomes and r.kind not in kinds:
            kinds.append(str(r.kind))
    return kinds


def _created(bundle: Path) -> str | None:
    """When the bundle was written (a multi-rank bundle written before the top manifest carried
    it: rank 0's part)."""
    for m in (bundle / MANIFEST, bundle / "rank0" / MANIFEST):
        try:
            if m.stat().st_size > MAX_MANIFEST:
                continue
            created = json.loads(m.read_text()).get("created")
        except Exception:  # noqa: BLE001 - garbage, too deep, not an object: no date
            continue
        if isinstance(created, str):
            return created
    return None


def to_markdown(data: dict) -> str:
    state = ("" if data.get("finished", True) else
             f" (running: {len(data.get('pending') or [])} bundle(s) still pending)")
    if data.get("interrupted"):
        state = f" (interrupted by {data['interrupted']})"
    notes = [f"Note: {clip(n, MAX_ERROR)}" for n in data.get("notes") or []]
    lines = ["# nanbisect triage", "", counts_text(data) + f"; exit code {data['exit_code']}"
             f"{state}.", ""] + (notes + [""] if notes else []) + [
             "| count | signature (origin @ line, module, phase, dtypes, classification) | "
             "made finite by | "
             "first seen | example | known |", "|---|---|---|---|---|---|"]
    for g in data["signatures"]:
        lines.append(f"| {g['count']} | `{clip(g['signature'], 300)}` | "
                     f"{', '.join(g.get('remedies') or []) or '-'} | {g['first_seen'] or '-'} | "
                     f"`{g['example']}` | {'yes' if g['known'] else '**new**'} |")
    if data["errors"]:
        lines += ["", "## Errors", ""] + [f"- `{e['bundle']}`: {clip(e['error'], MAX_ERROR)}"
                                          for e in data["errors"]]
    unkept = [b for b in data["bundles"] if b.get("report_error")]
    if unkept:
        lines += ["", "## Reports not written", ""] + [
            f"- `{b['bundle']}`: {clip(b['report_error'], MAX_ERROR)}" for b in unkept]
    clean = [b["bundle"] for b in data["bundles"] if b["signature"] is None]
    if clean:
        lines += ["", "## No failure", ""] + [f"- `{b}`" for b in clean]
    if data.get("pending"):
        lines += ["", "## Pending", ""] + [f"- `{b}`" for b in data["pending"]]
    if data.get("skipped"):
        lines += ["", "## Skipped (not bundles)", ""] + [f"- `{s['path']}`: {s['reason']}"
                                                         for s in data["skipped"]]
    if data.get("leftovers"):
        lines += ["", "## Leftovers of killed captures (`nanbisect clean` removes them)", ""] + [
            f"- `{x['path']}`: {x['bytes']} bytes, {x['age_s']:.0f} s old ({x['kind']})"
            if x.get("marked", True) else f"- `{x['path']}`: no nanbisect marker (an older "
            f"nanbisect's, or not nanbisect's), kept by `nanbisect clean` ({x['kind']})"
            for x in data["leftovers"]]
    return "\n".join(lines) + "\n"
