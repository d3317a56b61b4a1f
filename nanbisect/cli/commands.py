"""Command line: parses flags, calls the library, prints, exits. Holds no logic of its own.

Exit codes: 0 replay clean, 1 culprit found (or non-finite input), 2 usage or bad input (one line
on stderr, no traceback, nothing written), 3 the recorded failure did not reproduce.
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from nanbisect.errors import BadInput

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Find the first operation that breaks a PyTorch training step.")


def _version(value: bool) -> None:
    if value:
        from nanbisect import __version__

        typer.echo(f"nanbisect {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Find the first operation that breaks a PyTorch training step."""


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


def _fail(e: BadInput) -> None:
    typer.echo(f"nanbisect: error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def run(
    bundle: Optional[Path] = typer.Argument(None, show_default=False,
                                            help="bundle directory to replay"),
    ckpt: Optional[Path] = typer.Option(None, "--ckpt", show_default=False,
                                        help="the bundle, as a flag (same as BUNDLE)"),
    target: Optional[str] = typer.Option(None, help="device to replay on (default: the capture "
                                                    "device when present, else cpu)"),
    reference: Optional[str] = typer.Option(None, help="DEVICE[:DTYPE] or none (default: cpu "
                                                       "when the target is not cpu, else none)"),
    inject: Optional[str] = typer.Option(None, help="FILE.py:FUNC whose context manager wraps "
                                                    "every target-side execution"),
    out: Optional[Path] = typer.Option(None, help="report directory: report.json, report.md, "
                                                  "report.html, repro/ (default: "
                                                  "BUNDLE/nanbisect-report); new, empty, or a "
                                                  "report nanbisect wrote (only that is "
                                                  "replaced)"),
    entry: Optional[str] = typer.Option(None, help="override the bundle's entry string"),
    ranks: Optional[str] = typer.Option(None, help="R,... (multi-rank bundles captured by "
                                                   "Guard): replay only these ranks, each "
                                                   "alone, with the other ranks' collective "
                                                   "results as recorded"),
    steps: Optional[int] = typer.Option(None, help="K (bundles of Guard(lookback=...)): replay "
                                                   "the last K recorded steps on target and "
                                                   "reference, find the first step where they "
                                                   "part and bisect it"),
    no_remedies: bool = typer.Option(False, "--no-remedies",
                                     help="do not replay the step with remedies once the culprit "
                                          "is found (report remedies: [])"),
    remedy_budget: Optional[int] = typer.Option(None, "--remedy-budget", min=0,
                                                help="extra replays of the step the remedies "
                                                     "may use (default: NANBISECT_REMEDY_BUDGET, "
                                                     "else 4)"),
    as_json: bool = typer.Option(False, "--json", help="print report.json instead of a summary"),
) -> None:
    """Replay a bundle, bisect the failure, write report.json, report.md and report.html.

    Runs the entry's code (it rebuilds the model and replays the step), as running the training
    script would; `nanbisect inspect` never runs any. --out is replaced only when it is new,
    empty, or a report nanbisect wrote."""
    if bundle is not None and ckpt is not None and bundle != ckpt:
        _fail(BadInput(f"run: two bundles given ('{bundle}' and --ckpt '{ckpt}'); pass one"))
    path = bundle if bundle is not None else ckpt
    if path is None:
        _fail(BadInput("run: no bundle given; pass it as `nanbisect run BUNDLE` (or --ckpt "
                       "BUNDLE)"))
    from nanbisect.report.rerun import prestart
    prestart(path, target)    # a repro's interpreter imports torch while this one does
    from nanbisect.pipeline import RunOptions, run_bundle
    from nanbisect.report.text import terminal

    out_dir = out or Path(path) / "nanbisect-report"
    try:
        with _progress() as progress:
            report = run_bundle(path, RunOptions(target=target, reference=reference,
                                                 inject=inject, entry=entry, ranks=ranks,
                                                 steps=steps,
                                                 remedies=0 if no_remedies else remedy_budget),
                                out_dir, progress)
    except BadInput as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=1))
    else:
        typer.echo(terminal(report, out_dir))
    raise typer.Exit(report.exit_code)


@app.command()
def inspect(
    bundle: Path = typer.Argument(..., help="bundle directory (or a directory of bundles: lists "
                                            "them and any leftovers of killed captures)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Summarise a bundle; never runs any of its code (imports no user code, unpickles nothing,
    bounded time and memory): safe on untrusted bundles."""
    from nanbisect.bundle.summary import (directory_summary, directory_text, summarize,
                                          summary_text)

    listing = directory_summary(bundle)   # a folder of bundles, or of a killed capture's leftovers
    if listing is not None:
        typer.echo(json.dumps(listing, indent=1) if as_json else directory_text(listing))
        raise typer.Exit(0)
    try:
        info = summarize(bundle)
    except BadInput as e:
        _fail(e)
    typer.echo(json.dumps(info, indent=1) if as_json else summary_text(info))


@app.command()
def triage(
    dirs: list[Path] = typer.Argument(..., help="directories to search for bundles"),
    out: Path = typer.Option(Path("nanbisect-triage"), help="where triage.json/.md and the "
                                                             "cache go"),
    jobs: Optional[int] = typer.Option(None, help="parallel replays (default: by cores and "
                                                  "free memory; on a cluster: all its slots)"),
    known: Optional[Path] = typer.Option(None, help="a previous triage.json or a file of "
                                                    "known signatures, one a line"),
    target: Optional[str] = typer.Option(None, help="device to replay on"),
    timeout: float = typer.Option(1800.0, help="seconds one bundle's replay may take before "
                                               "it is killed and becomes an error row"),
    backend: str = typer.Option("loky", help="loky (processes here), dask or ray (an existing "
                                             "cluster, through joblib)"),
    scheduler: Optional[str] = typer.Option(None, help="Dask scheduler address for --backend "
                                                       "dask, e.g. tcp://10.0.0.5:8786"),
    address: Optional[str] = typer.Option(None, help="Ray cluster address for --backend ray, "
                                                     "e.g. 10.0.0.5:6379"),
    as_json: bool = typer.Option(False, "--json", help="print triage.json"),
) -> None:
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
        typer.echo(json.dumps(res.data, indent=1))
    else:
        typer.echo(to_markdown(res.data).rstrip())
    raise typer.Exit(res.exit_code)


@app.command()
def pack(
    src: Path = typer.Argument(..., help="a bundle (after `run`) or a report directory"),
    output: Path = typer.Option(Path("nanbisect-ticket.tar.gz"), "-o", "--output",
                                help="the archive to write: a new path outside any bundle"),
    full: bool = typer.Option(False, help="include the model and optimizer state"),
    force: bool = typer.Option(False, "--force", help="replace -o when it is an earlier pack "
                                                      "(never any other file)"),
) -> None:
    """One archive for a ticket: report, repro, manifest(s), environment (under 10 MB).

    Never replaces what it did not write: an existing -o is refused (with --force, unless it is
    an earlier pack), as is -o inside a bundle or inside the directory being packed."""
    from nanbisect.bundle.pack import pack as do_pack

    try:
        dest = do_pack(src, output, full=full, force=force)
    except BadInput as e:
        _fail(e)
    typer.echo(f"nanbisect: wrote {dest} ({dest.stat().st_size} bytes)")


@app.command()
def unpack(
    archive: Path = typer.Argument(..., help="an archive written by nanbisect pack"),
    dest: Path = typer.Argument(..., help="new or empty directory to extract into"),
    max_bytes: Optional[int] = typer.Option(
        None, "--max-bytes", help="most uncompressed bytes to accept (default: 50x the archive, "
        "at least 64 MiB, at most 4 GiB; env NANBISECT_UNPACK_MAX_BYTES)"),
) -> None:
    """Extract a ticket archive safely (no absolute paths, no '..', no links, no compression
    bombs, nothing left behind on refusal)."""
    from nanbisect.bundle.pack import unpack as do_unpack

    try:
        do_unpack(archive, dest, max_bytes=max_bytes)
    except BadInput as e:
        _fail(e)
    typer.echo(f"nanbisect: extracted into {dest}")


@app.command()
def clean(
    dirs: list[Path] = typer.Argument(..., help="directories to search for leftovers: Guard's "
                                                "out, a bundle, the parent of a --out"),
    min_age: float = typer.Option(600.0, "--min-age", help="remove only leftovers nothing has "
                                                         "written to for this many seconds"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed"),
) -> None:
    """Remove what killed captures and report writes left behind (hidden .NAME.tmp-XXXXXXXX
    directories that carry nanbisect's marker); never a bundle, a report or anything else.

    Looks in each DIR and in the bundles directly inside it, nowhere deeper; a directory with
    that name shape but without the marker (an older nanbisect's, or yours) is listed and kept."""
    from nanbisect.bundle.leftovers import find_leftovers, remove

    for d in dirs:
        if not d.is_dir():
            _fail(BadInput(f"clean: '{d}' is not a directory; pass directories that hold "
                           "bundles"))
    removed, kept = remove(find_leftovers(dirs), min_age, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for x in removed:
        typer.echo(f"{verb} {x.path} ({x.bytes} bytes, {x.age_s:.0f}s old)")
    for x, why in kept:
        typer.echo(f"{'would keep' if dry_run else 'kept'} {x.path}: {why}")
    typer.echo(f"nanbisect: {verb} {len(removed)} leftover(s), "
               f"{sum(x.bytes or 0 for x in removed)} bytes; kept {len(kept)}")


@app.command()
def selftest(
    device: str = typer.Option("cpu", help="device to plant and find the faults on"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON"),
) -> None:
    """Plant built-in faults, catch them with Guard, bisect them; exit 1 if one is missed."""
    from nanbisect.replay.replayer import parse_device
    from nanbisect.selftest import run

    try:
        parse_device(device, flag="--device")
        rows = run(device)
    except BadInput as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
    else:
        for r in rows:
            typer.echo(f"{'ok  ' if r['ok'] else 'MISS'} {r['case']:<45} {r['seconds']:>6}s  "
                       + ("" if r["ok"] else f"expected {r['expected']}, found {r['found']}"))
    raise typer.Exit(0 if all(r["ok"] for r in rows) else 1)


def main() -> None:
    try:
        app(prog_name="nanbisect")
    except KeyboardInterrupt:
        sys.exit(130)
