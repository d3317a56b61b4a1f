"""The commands, one annotated function each: its signature declares the command's flags, their
defaults and help (typer reads them from it: `nanbisect.cli.app`), its docstring the command's
help; its body checks the arguments with its typed parameters (`nanbisect.cli.checks`, no heavy
import; ``run``'s become a `nanbisect.options.RunOptions` there, once), calls the library with
them, prints, and returns the exit code (`nanbisect.cli.app.EXIT_CODES`). Holds no logic of its
own; imports what a command needs only when it runs (torch among it).
"""

import json
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from nanbisect.cli import checks
from nanbisect.cli.app import (BUNDLE_PANEL, CLUSTER_PANEL, DEVICE_PANEL, DONE_CODES,
                               EXIT_CODES, REMEDY_PANEL, SCOPE_PANEL, command, flag,
                               number_flag, switch)
from nanbisect.errors import BadInput, TopLevelOptIn
from nanbisect.options import RunOptions


def echo(text: str, err: bool = False) -> None:
    """One line (or block) of output, to stdout or stderr."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


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


@command("Replay a bundle, bisect the failure, write report.json, report.md and "
         "report.html.", exits=EXIT_CODES)
def run(
    bundle: Annotated[Optional[Path], typer.Argument(
        metavar="BUNDLE", help="bundle directory to replay", show_default=False)] = None,
    ckpt: Annotated[Optional[Path], flag(
        "--ckpt", metavar="PATH", help="the bundle, as a flag (same as BUNDLE)",
        panel=BUNDLE_PANEL)] = None,
    out: Annotated[Optional[Path], flag(
        "--out", metavar="DIR", help="report directory: report.json, report.md, report.html, "
        "repro/; new, empty, or a report nanbisect wrote (only that is replaced)",
        show_default="BUNDLE/nanbisect-report", panel=BUNDLE_PANEL)] = None,
    as_json: Annotated[bool, switch(
        "--json", help="print report.json instead of a summary", panel=BUNDLE_PANEL)] = False,
    target: Annotated[Optional[str], flag(
        "--target", metavar="DEVICE", help="device to replay on",
        show_default="the capture device when present, else cpu", panel=DEVICE_PANEL)] = None,
    reference: Annotated[Optional[str], flag(
        "--reference", metavar="DEVICE[:DTYPE]", help="DEVICE[:DTYPE] or none",
        show_default="cpu when the target is not cpu, else none", panel=DEVICE_PANEL)] = None,
    entry: Annotated[Optional[str], flag(
        "--entry", metavar="ENTRY", help="override the bundle's entry string",
        panel=SCOPE_PANEL)] = None,
    ranks: Annotated[Optional[str], flag(
        "--ranks", metavar="R,...", help="R,... (multi-rank bundles captured by Guard): replay "
        "only these ranks, each alone, with the other ranks' collective results as recorded",
        panel=SCOPE_PANEL)] = None,
    steps: Annotated[Optional[int], number_flag(
        "--steps", "K (bundles of Guard(lookback=...)): replay the last K recorded steps on "
        "target and reference, find the first step where they part and bisect it", "K",
        panel=SCOPE_PANEL)] = None,
    inject: Annotated[Optional[str], flag(
        "--inject", metavar="FILE.py:FUNC", help="FILE.py:FUNC whose context manager wraps "
        "every target-side execution", panel=SCOPE_PANEL)] = None,
    code: Annotated[Optional[str], flag(
        "--code", metavar="local|bundle", help="which copy of the user's code the replay "
        "imports: local (the files on disk) or bundle (the copies the bundle carries)",
        show_default="the local files when present and unchanged, else the bundle's copies",
        panel=SCOPE_PANEL)] = None,
    run_top_level: Annotated[bool, switch(
        "--run-top-level", help="let the entry file's module-level statements run when it is "
        "imported, as Task(run_top_level=True) does (else an entry whose top level acts at "
        "import, training, writing, downloading or starting processes, is refused)",
        panel=SCOPE_PANEL)] = False,
    no_remedies: Annotated[bool, switch(
        "--no-remedies", help="do not replay the step with remedies once the culprit is found "
        "(report remedies: [])", panel=REMEDY_PANEL)] = False,
    remedy_budget: Annotated[Optional[int], number_flag(
        "--remedy-budget", "extra replays of the step the remedies may use", "N",
        show_default="NANBISECT_REMEDY_BUDGET, else 4", panel=REMEDY_PANEL)] = None,
    quiet: Annotated[bool, switch(
        "-q", "--quiet", help="no progress on stderr (drawn only when stderr is a terminal) "
        "and no early culprit line; errors and warnings still print",
        panel=BUNDLE_PANEL)] = False,
) -> int:
    """Replay a bundle, bisect the failure, write report.json, report.md and report.html.

    Runs the entry's code (it rebuilds the model and replays the step), as running the training
    script would; `nanbisect inspect` never runs any. --out is replaced only when it is new,
    empty, or a report nanbisect wrote. On a terminal, stderr shows the stage, the replays done
    and the time (--quiet: none); piped, it shows no progress. The moment the culprit is known
    (before the remedies and the report), one line on stderr names it (--quiet: none)."""
    from nanbisect.api import run_options

    checks.environment("run", ["--remedy-budget"] if no_remedies or remedy_budget is not None
                       else [])
    path = checks.one_bundle(bundle, ckpt)
    try:
        options = run_options(path, target=target, reference=reference, entry=entry,
                              inject=inject, code=code, ranks=ranks, steps=steps,
                              remedies=False if no_remedies else remedy_budget,
                              run_top_level=run_top_level,
                              out=out if out is not None else path / "nanbisect-report")
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. --out unreadable: no verdict, exit 4
        internal_error(e)
    return _run(path, options, as_json=as_json, quiet=quiet)


def _telling_culprit(progress, options: RunOptions, quiet: bool):
    """``progress`` that also prints the culprit on stderr the moment the run knows it (one
    line, before the remedies and the report; not with --quiet): a run stopped after it, or
    one whose remedies take long, has already said what it found."""
    from nanbisect.pipeline.common import CULPRIT
    from nanbisect.util.text import clip

    def told(key: str, text: str) -> None:
        if key == CULPRIT and not quiet:
            follow = "the report follows" if options.remedies == 0 else \
                "remedies and the report follow"
            print(f"nanbisect: culprit found: {clip(text, 400)}; {follow}", file=sys.stderr,
                  flush=True)
        progress(key, text)
    return told


def _run(path: Path, options: RunOptions, *, as_json: bool, quiet: bool) -> int:
    """`run` with its options parsed (`nanbisect.api.run_options`): the run, then its summary."""
    out_dir = options.out
    try:
        from nanbisect import api
        from nanbisect.util import memory

        memory.own_process()        # the replay's own: its allocator may be tuned
        api.start(path, options)    # a repro's interpreter imports torch while this one does
        import warnings

        from nanbisect.cli.progress import run_progress
        from nanbisect.report.prose import terminal
        from nanbisect.util.recordjson import dumps
        from nanbisect.util.text import failure_line
        from nanbisect.util.torch_internals import check_torch_version

        if (too_old := check_torch_version()) is not None:
            print(f"nanbisect: warning: {too_old}", file=sys.stderr)
        with run_progress(quiet) as progress, warnings.catch_warnings():
            warnings.simplefilter("ignore", api.TorchTooOld)    # said above, in one line
            warnings.simplefilter("always", TopLevelOptIn)
            shown = warnings.showwarning

            def say(message, category, *rest, **kw):     # an opt-in: one line, at once
                if issubclass(category, TopLevelOptIn):
                    print(f"nanbisect: warning: {message}", file=sys.stderr, flush=True)
                else:
                    shown(message, category, *rest, **kw)
            warnings.showwarning = say
            report = api.replay(path, options, _telling_culprit(progress, options, quiet))
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


@command("Summarise a bundle; never runs any of its code.", exits=DONE_CODES)
def inspect(
    bundle: Annotated[Path, typer.Argument(
        metavar="BUNDLE", help="bundle directory (or a directory of bundles: lists them and any "
        "leftovers of killed captures)", show_default=False)],
    as_json: Annotated[bool, switch("--json", help="print the summary as JSON")] = False,
) -> int:
    """Summarise a bundle; never runs any of its code (imports no user code, unpickles nothing,
    bounded time and memory): safe on untrusted bundles."""
    checks.environment("inspect")
    checks.inspect(bundle)
    from nanbisect.bundle.describe import (directory_summary, directory_text, summarize,
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


@command("Replay every bundle under DIRS in parallel and group failures by culprit "
         "signature.", exits={0: "all clean", 1: "known signatures only", 2: "no new signature, "
                              "but errors or reports not written (or bad input)",
                              3: "new signatures"})
def triage(
    dirs: Annotated[list[Path], typer.Argument(
        metavar="DIRS", help="directories to search for bundles", show_default=False)],
    out: Annotated[Path, flag(
        "--out", metavar="DIR", help="where triage.json/.md, index.html, the reports and (without "
        "--cache) the cache go")
    ] = Path("nanbisect-triage"),
    jobs: Annotated[Optional[int], number_flag(
        "--jobs", "parallel replays", "N",
        show_default="by cores and free memory; on a cluster: all its slots")] = None,
    known: Annotated[Optional[Path], flag(
        "--known", metavar="FILE", help="a previous triage.json or a file of known "
        "signatures, one a line; one that does not exist yet is none (a first night: every "
        "signature is new, and a note says so)")] = None,
    cache: Annotated[Optional[Path], flag(
        "--cache", metavar="DIR", help="where the analyses are cached: a directory that "
        "later runs reuse, such as one shared by dated --out folders",
        show_default="DIR/cache of --out")] = None,
    target: Annotated[Optional[str], flag(
        "--target", metavar="DEVICE", help="device to replay on")] = None,
    timeout: Annotated[float, number_flag(
        "--timeout", "seconds one bundle's replay may take before it is killed and becomes an "
        "error row", "S")] = 1800.0,
    as_json: Annotated[bool, switch("--json", help="print triage.json")] = False,
    backend: Annotated[str, flag(
        "--backend", metavar="NAME", help="loky (processes here), dask or ray (an existing "
        "cluster, through joblib)", panel=CLUSTER_PANEL)] = "loky",
    scheduler: Annotated[Optional[str], flag(
        "--scheduler", metavar="ADDR", help="Dask scheduler address for --backend dask, e.g. "
        "tcp://10.0.0.5:8786", panel=CLUSTER_PANEL)] = None,
    address: Annotated[Optional[str], flag(
        "--address", metavar="ADDR", help="Ray cluster address for --backend ray, e.g. "
        "10.0.0.5:6379", panel=CLUSTER_PANEL)] = None,
    quiet: Annotated[bool, switch(
        "-q", "--quiet", help="no progress on stderr (drawn only when stderr is a terminal; "
        "errors still print)")] = False,
) -> int:
    """Replay every bundle under DIRS in parallel and group failures by culprit signature.

    One bundle that hangs, crashes or is malformed is its own error row; triage.json and
    triage.md in --out are kept current while it runs and written on SIGTERM/SIGINT too. A
    report that cannot be written under --out (a full disk) is named on its row (report_error)
    and in one line on stderr. On a terminal, stderr shows the bundles done of the total, the
    time and an estimate of the time left (--quiet: none); piped, it shows no progress."""
    from nanbisect.api import check_triage

    checks.environment("triage")
    notes = check_triage(dirs, out=out, known=known, target=target, backend=backend,
                         scheduler=scheduler, address=address, cache=cache)
    for note in notes:              # before the night: a cron log says it first
        echo(f"nanbisect: note: {note}", err=True)
    from nanbisect import api
    from nanbisect.cli.progress import triage_progress
    from nanbisect.nightly import reports_not_written, to_markdown

    try:
        with triage_progress(quiet) as progress:
            res = api.triage(dirs, out=out, jobs=jobs, known=known, target=target,
                             timeout=timeout, backend=backend, scheduler=scheduler,
                             address=address, progress=progress, cache=cache)
    except BadInput as e:
        _fail(e)
    except Exception as e:  # noqa: BLE001 - a nightly job gets one line and exit 2, never 1
        _fail(BadInput(f"triage failed: {type(e).__name__}: {str(e)[:200]}; "
                       f"{out}/triage.json holds the bundles finished so far"))
    if as_json:
        from nanbisect.util.recordjson import dumps

        echo(dumps(res.data, indent=1))
    else:
        echo(to_markdown(res.data).rstrip())
        echo(f"\nIn a browser: {out / 'index.html'} (each bundle's report.html under "
             f"{out / 'reports'})")
    unkept = reports_not_written(res.data)
    if unkept:                      # a full disk: the night's one line on it, never silent
        echo(f"nanbisect: warning: {unkept}", err=True)
    return res.exit_code


@command("One archive for a ticket: report, repro, manifest(s), environment.",
         exits=DONE_CODES)
def pack(
    src: Annotated[Path, typer.Argument(
        metavar="SRC", help="a bundle (after `run`) or a report directory", show_default=False)],
    output: Annotated[Path, flag(
        "-o", "--output", metavar="FILE", help="the archive to write: a new path outside any "
        "bundle")] = Path("nanbisect-ticket.tar.gz"),
    full: Annotated[bool, switch(
        "--full/--no-full", help="include the model and optimizer state")] = False,
    force: Annotated[bool, switch(
        "--force", help="replace -o when it is an earlier pack (never any other file)")] = False,
) -> int:
    """One archive for a ticket: report, repro, manifest(s), environment (under 10 MB).

    Never replaces what it did not write: an existing -o is refused (with --force, unless it is
    an earlier pack), as is -o inside a bundle or inside the directory being packed."""
    checks.environment("pack")   # pack checks its own paths before importing torch
    from nanbisect.bundle.pack import pack as do_pack

    try:
        dest = do_pack(src, output, full=full, force=force,
                       say=lambda text: echo(text, err=True))
    except BadInput as e:
        _fail(e)
    echo(f"nanbisect: wrote {dest} ({dest.stat().st_size} bytes)")
    return 0


@command("Extract a ticket archive safely.", exits=DONE_CODES)
def unpack(
    archive: Annotated[Path, typer.Argument(
        metavar="ARCHIVE", help="an archive written by nanbisect pack", show_default=False)],
    dest: Annotated[Path, typer.Argument(
        metavar="DEST", help="new or empty directory to extract into", show_default=False)],
    max_bytes: Annotated[Optional[int], number_flag(
        "--max-bytes", "most uncompressed bytes to accept", "N",
        show_default="NANBISECT_UNPACK_MAX_BYTES, else 50x the archive, at least 64 MiB, at "
        "most 4 GiB")] = None,
) -> int:
    """Extract a ticket archive safely (no absolute paths, no '..', no links, no compression
    bombs, nothing left behind on refusal)."""
    checks.environment("unpack", ["--max-bytes"] if max_bytes is not None else [])
    from nanbisect.bundle.pack import unpack as do_unpack

    dropped: list[str] = []
    try:
        do_unpack(archive, dest, max_bytes=max_bytes, dropped=dropped)
    except BadInput as e:
        _fail(e)
    if dropped:
        print(f"nanbisect: left out {len(dropped)} cached bytecode file(s) ({dropped[0]}"
              f"{', ...' if len(dropped) > 1 else ''}): a replay imports the sources only",
              file=sys.stderr)
    echo(f"nanbisect: extracted into {dest}")
    return 0


@command("Remove what killed captures and report writes left behind.", exits={
    0: "done (every leftover removed or kept for the reason printed)",
    1: "some leftover could not be removed (or only in part: each named on stderr)",
    2: "bad input (nothing removed)"})
def clean(
    dirs: Annotated[list[Path], typer.Argument(
        metavar="DIRS", help="directories to search for leftovers: Guard's out, a bundle, "
        "the parent of a --out", show_default=False)],
    min_age: Annotated[float, number_flag(
        "--min-age", "remove only leftovers nothing has written to for this many seconds",
        "S")] = 600.0,
    dry_run: Annotated[bool, switch("--dry-run", help="list what would be removed")] = False,
) -> int:
    """Remove what killed captures and report writes left behind (hidden .NAME.tmp-XXXXXXXX
    directories that carry nanbisect's marker); never a bundle, a report or anything else.

    Looks in each DIR and in the bundles directly inside it, nowhere deeper; a directory with
    that name shape but without the marker (an older nanbisect's, or yours) is listed and kept,
    as is one that is or holds a mount point (clean never enters another file system).
    A leftover that cannot be removed (a read-only file system, an immutable file) is one line
    on stderr naming it, the reason and what is left of it; the others are removed all the same.
    """
    checks.environment("clean")
    checks.clean(dirs)
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


@command("Plant built-in faults, catch them with Guard, bisect them.", exits={
    0: "every fault found", 1: "a fault missed", 2: EXIT_CODES[2]})
def selftest(
    device: Annotated[str, flag(
        "--device", metavar="DEVICE", help="device to plant and find the faults on")] = "cpu",
    as_json: Annotated[bool, switch("--json", help="print the results as JSON")] = False,
) -> int:
    """Plant built-in faults, catch them with Guard, bisect them."""
    checks.environment("selftest")
    spec = checks.selftest(device)
    from nanbisect import devices
    from nanbisect.selftest import run

    try:
        devices.resolve(spec, flag="--device")
        rows = run(str(spec))
    except BadInput as e:
        _fail(e)
    if as_json:
        echo(json.dumps(rows, indent=1))
    else:
        for r in rows:
            echo(f"{'ok  ' if r['ok'] else 'MISS'} {r['case']:<45} {r['seconds']:>6}s  "
                 + ("" if r["ok"] else f"expected {r['expected']}, found {r['found']}"))
    return 0 if all(r["ok"] for r in rows) else 1
