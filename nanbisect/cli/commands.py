"""The commands: each calls the library with the flags `nanbisect.cli.parser` parsed and
`nanbisect.cli.checks` checked, prints, and returns its exit code. Holds no logic of its own;
imports what a command needs only when it runs (torch among it).

Exit codes: 0 replay clean, 1 culprit found (or non-finite input), 2 usage or bad input (one line
on stderr, no traceback, nothing written), 3 the recorded failure did not reproduce, 4 (`run`)
an internal error before any verdict (one line on stderr naming the log file that holds the
traceback: `internal_error`).
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import NoReturn, Optional

from nanbisect.errors import BadInput


def echo(text: str, err: bool = False) -> None:
    """One line (or block) of output, to stdout or stderr."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


@contextlib.contextmanager
def _progress(delay: float = 2.0):
    """A spinner with the current pass on stderr, shown only on a terminal and only once the run
    has taken ``delay`` seconds; yields the callback the pipeline reports its passes to."""
    if not sys.stderr.isatty():
        yield lambda key, msg: None
        return
    from rich.console import Console

    state = {"msg": "starting", "status": None}
    lock = threading.Lock()

    def show():
        with lock:
            if state["status"] is None:
                state["status"] = Console(stderr=True).status(state["msg"])
                state["status"].start()

    timer = threading.Timer(delay, show)
    timer.daemon = True
    timer.start()

    def update(key: str, msg: str) -> None:
        with lock:
            state["msg"] = msg
            if state["status"] is not None:
                state["status"].update(msg)
    try:
        yield update
    finally:
        timer.cancel()
        with lock:
            if state["status"] is not None:
                state["status"].stop()


def _fail(e: BadInput) -> NoReturn:
    from nanbisect.util.text import clip

    echo(f"nanbisect: error: {clip(e, 2000)}", err=True)    # one line, whatever it quotes
    raise SystemExit(2)


INTERNAL_ERROR = 4     # `run`: an exception of nanbisect's own before a verdict (never 0-3)


def internal_error(e: BaseException) -> NoReturn:
    """An exception that is not a `BadInput` escaped `run` (no verdict, so no report): one line
    on stderr naming it and the log its traceback went to, a new file in the temporary
    directory (created exclusively: it never replaces a file), and exit `INTERNAL_ERROR`."""
    import tempfile
    import traceback

    from nanbisect.util.text import failure_line

    try:
        fd, log = tempfile.mkstemp(prefix="nanbisect-error-", suffix=".log")
        with open(fd, "w") as f:
            f.write("nanbisect run: " + " ".join(sys.argv) + "\n")
            traceback.print_exception(type(e), e, e.__traceback__, file=f)
        where = f"the traceback is in {log}"
    except OSError as err:
        where = f"its traceback could not be written ({err.strerror or err})"
    echo(f"nanbisect: internal error (exit {INTERNAL_ERROR}, no verdict, no report): "
         f"{failure_line(e)}; {where}: a bug of nanbisect's, please report it with that file",
         err=True)
    raise SystemExit(INTERNAL_ERROR)


def run(bundle: Optional[Path] = None, ckpt: Optional[Path] = None, target: Optional[str] = None,
        reference: Optional[str] = None, inject: Optional[str] = None,
        out: Optional[Path] = None, entry: Optional[str] = None, ranks: Optional[str] = None,
        steps: Optional[int] = None, no_remedies: bool = False,
        remedy_budget: Optional[int] = None, as_json: bool = False) -> int:
    """Replay a bundle, bisect the failure, write report.json, report.md and report.html.

    Runs the entry's code (it rebuilds the model and replays the step), as running the training
    script would; `nanbisect inspect` never runs any. --out is replaced only when it is new,
    empty, or a report nanbisect wrote."""
    path = bundle if bundle is not None else ckpt     # one of them (nanbisect.cli.checks.run)
    out_dir = out or Path(path) / "nanbisect-report"
    try:
        from nanbisect.report.rerun import prestart
        prestart(path, target)    # a repro's interpreter imports torch while this one does
        from nanbisect.pipeline import RunOptions, run_bundle
        from nanbisect.report.text import terminal
        from nanbisect.util.recordjson import dumps
        from nanbisect.util.text import failure_line

        with _progress() as progress:
            report = run_bundle(path, RunOptions(target=target, reference=reference,
                                                 inject=inject, entry=entry, ranks=ranks,
                                                 steps=steps,
                                                 remedies=0 if no_remedies else remedy_budget),
                                out_dir, progress)
    except BadInput as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001 - no verdict: exit 4, the traceback in a log file
        internal_error(e)
    # the report is written: what follows only prints it (report.json's own encoding)
    try:
        text = dumps(report.to_json(), indent=1) if as_json else terminal(report, out_dir)
    except Exception as e:  # noqa: BLE001 - the verdict stands; its report is on disk
        text = (f"nanbisect: {report.verdict}; the summary could not be printed "
                f"({failure_line(e)}): see {out_dir / 'report.md'}")
    echo(text)
    return report.exit_code


def inspect(bundle: Path, as_json: bool = False) -> int:
    """Summarise a bundle; never runs any of its code (imports no user code, unpickles nothing,
    bounded time and memory): safe on untrusted bundles."""
    from nanbisect.bundle.summary import (directory_summary, directory_text, summarize,
                                          summary_text)

    listing = directory_summary(bundle)   # a folder of bundles, or of a killed capture's leftovers
    if listing is not None:
        echo(json.dumps(listing, indent=1) if as_json else directory_text(listing))
        return 0
    try:
        info = summarize(bundle)
    except BadInput as e:
        _fail(e)
    echo(json.dumps(info, indent=1) if as_json else summary_text(info))
    return 0


def triage(dirs: list[Path], out: Path = Path("nanbisect-triage"), jobs: Optional[int] = None,
           known: Optional[Path] = None, target: Optional[str] = None, timeout: float = 1800.0,
           backend: str = "loky", scheduler: Optional[str] = None,
           address: Optional[str] = None, as_json: bool = False) -> int:
    """Replay every bundle under DIRS in parallel and group failures by culprit signature.

    One bundle that hangs, crashes or is malformed is its own error row; triage.json and
    triage.md in --out are kept current while it runs and written on SIGTERM/SIGINT too.
    Exit: 0 all clean, 1 known signatures only, 3 new signatures, 2 errors only."""
    from nanbisect.triage import load_known, to_markdown
    from nanbisect.triage import triage as run_triage

    try:
        known_set = load_known(known) if known else set()
        res = run_triage(dirs, out=out, jobs=jobs, known=known_set, timeout=timeout,
                         backend=backend, scheduler=scheduler, address=address,
                         options={"target": target} if target else None)
    except BadInput as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001 - a nightly job gets one line and exit 2, never 1
        _fail(BadInput(f"triage failed: {type(e).__name__}: {str(e)[:200]}; {out}/triage.json "
                       "holds the bundles finished so far"))
    if as_json:
        from nanbisect.util.recordjson import dumps

        echo(dumps(res.data, indent=1))
    else:
        echo(to_markdown(res.data).rstrip())
        echo(f"\nIn a browser: {out / 'index.html'} (each bundle's report.html under "
             f"{out / 'reports'})")
    return res.exit_code


def pack(src: Path, output: Path = Path("nanbisect-ticket.tar.gz"), full: bool = False,
         force: bool = False) -> int:
    """One archive for a ticket: report, repro, manifest(s), environment (under 10 MB).

    Never replaces what it did not write: an existing -o is refused (with --force, unless it is
    an earlier pack), as is -o inside a bundle or inside the directory being packed."""
    from nanbisect.bundle.pack import pack as do_pack

    try:
        dest = do_pack(src, output, full=full, force=force)
    except BadInput as e:
        _fail(e)
    echo(f"nanbisect: wrote {dest} ({dest.stat().st_size} bytes)")
    return 0


def unpack(archive: Path, dest: Path, max_bytes: Optional[int] = None) -> int:
    """Extract a ticket archive safely (no absolute paths, no '..', no links, no compression
    bombs, nothing left behind on refusal)."""
    from nanbisect.bundle.pack import unpack as do_unpack

    try:
        do_unpack(archive, dest, max_bytes=max_bytes)
    except BadInput as e:
        _fail(e)
    echo(f"nanbisect: extracted into {dest}")
    return 0


def clean(dirs: list[Path], min_age: float = 600.0, dry_run: bool = False) -> int:
    """Remove what killed captures and report writes left behind (hidden .NAME.tmp-XXXXXXXX
    directories that carry nanbisect's marker); never a bundle, a report or anything else.

    Looks in each DIR and in the bundles directly inside it, nowhere deeper; a directory with
    that name shape but without the marker (an older nanbisect's, or yours) is listed and kept,
    as is one that is or holds a mount point (clean never enters another file system).
    A leftover that cannot be removed (a read-only file system, an immutable file) is one line
    on stderr naming it, the reason and what is left of it; the others are removed all the same.

    Exit: 0 done (every leftover removed or kept for the reason printed), 1 some leftover could
    not be removed (or only in part: each named on stderr), 2 bad input (nothing removed)."""
    from nanbisect.bundle.leftovers import find_leftovers, remove

    try:
        removed, kept, failed = remove(find_leftovers(dirs), min_age, dry_run=dry_run)
    except BadInput as e:       # a min_age out of range (the flag's parser refuses it first)
        _fail(e)
    verb = "would remove" if dry_run else "removed"
    for x in removed:
        echo(f"{verb} {x.path} ({x.bytes} bytes, {x.age_s:.0f}s old)")
    for x, why in kept:
        echo(f"{'would keep' if dry_run else 'kept'} {x.path}: {why}")
    for f in failed:
        echo(f"nanbisect: {f}", err=True)
    echo(f"nanbisect: {verb} {len(removed)} leftover(s), "
         f"{sum(x.bytes or 0 for x in removed)} bytes; kept {len(kept)}"
         + (f"; could not remove {len(failed)} (see above)" if failed else ""))
    return 1 if failed else 0


def selftest(device: str = "cpu", as_json: bool = False) -> int:
    """Plant built-in faults, catch them with Guard, bisect them; exit 1 if one is missed."""
    from nanbisect.replay.replayer import parse_device
    from nanbisect.selftest import run

    try:
        parse_device(device, flag="--device")
        rows = run(device)
    except BadInput as e:
        _fail(e)
    if as_json:
        echo(json.dumps(rows, indent=1))
    else:
        for r in rows:
            echo(f"{'ok  ' if r['ok'] else 'MISS'} {r['case']:<45} {r['seconds']:>6}s  "
                 + ("" if r["ok"] else f"expected {r['expected']}, found {r['found']}"))
    return 0 if all(r["ok"] for r in rows) else 1

