"""The command line's flags and help: one `argparse` parser per command (standard library only:
it loads in milliseconds, so a usage error never waits for a heavy import).

A usage error (unknown command or flag, a value of the wrong type, a missing argument) is one
line on stderr, ``nanbisect: error: ...; see 'nanbisect CMD --help'``, and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from nanbisect.util.numbers import NUMBERS

COMMANDS = ("run", "inspect", "triage", "pack", "unpack", "clean", "selftest")


class Parser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors are one line (exit 2), never the usage
    block, and whose options are never abbreviated (``--tar`` is not ``--target``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument COMMAND: invalid choice:"):
            given = message.split("invalid choice:", 1)[1].split("(", 1)[0].strip()
            message = f"unknown command {given}; the commands are {', '.join(COMMANDS)}"
        sys.stderr.write(f"nanbisect: error: {message}; see '{self.prog} --help'\n")
        sys.exit(2)


def _number(p: argparse.ArgumentParser, name: str, help: str, **kw) -> None:
    """A flag whose value goes through `nanbisect.util.numbers` (its range in its help)."""
    n = NUMBERS[name]
    p.add_argument(name, type=n.arg, help=n.help(help), **kw)


def _flag(p: argparse.ArgumentParser, name: str, help: str, dest: str | None = None) -> None:
    p.add_argument(name, action="store_true", help=help, **({"dest": dest} if dest else {}))


def _run(sub) -> None:
    p = sub.add_parser(
        "run", help="Replay a bundle, bisect the failure, write report.json, report.md and "
        "report.html.",
        description="Replay a bundle, bisect the failure, write report.json, report.md and "
        "report.html.\n\nRuns the entry's code (it rebuilds the model and replays the step), as "
        "running the training\nscript would; `nanbisect inspect` never runs any. --out is "
        "replaced only when it is new,\nempty, or a report nanbisect wrote.\n\nExit: 0 clean, 1 "
        "culprit (or non-finite input), 2 usage or bad input, 3 not reproduced,\n4 internal "
        "error before any verdict (the traceback in the log file its one line names).")
    p.add_argument("bundle", nargs="?", type=Path, metavar="BUNDLE",
                   help="bundle directory to replay")
    p.add_argument("--ckpt", type=Path, metavar="PATH",
                   help="the bundle, as a flag (same as BUNDLE)")
    p.add_argument("--target", metavar="DEVICE", help="device to replay on (default: the "
                   "capture device when present, else cpu)")
    p.add_argument("--reference", metavar="DEVICE[:DTYPE]", help="DEVICE[:DTYPE] or none "
                   "(default: cpu when the target is not cpu, else none)")
    p.add_argument("--inject", metavar="FILE.py:FUNC", help="FILE.py:FUNC whose context "
                   "manager wraps every target-side execution")
    p.add_argument("--out", type=Path, metavar="DIR", help="report directory: report.json, "
                   "report.md, report.html, repro/ (default: BUNDLE/nanbisect-report); new, "
                   "empty, or a report nanbisect wrote (only that is replaced)")
    p.add_argument("--entry", metavar="ENTRY", help="override the bundle's entry string")
    p.add_argument("--ranks", metavar="R,...", help="R,... (multi-rank bundles captured by "
                   "Guard): replay only these ranks, each alone, with the other ranks' "
                   "collective results as recorded")
    _number(p, "--steps", "K (bundles of Guard(lookback=...)): replay the last K recorded "
            "steps on target and reference, find the first step where they part and bisect it",
            metavar="K")
    _flag(p, "--no-remedies", "do not replay the step with remedies once the culprit is found "
          "(report remedies: [])")
    _number(p, "--remedy-budget", "extra replays of the step the remedies may use (default: "
            "NANBISECT_REMEDY_BUDGET, else 4)", metavar="N")
    _flag(p, "--json", "print report.json instead of a summary", dest="as_json")


def _inspect(sub) -> None:
    p = sub.add_parser(
        "inspect", help="Summarise a bundle; never runs any of its code.",
        description="Summarise a bundle; never runs any of its code (imports no user code, "
        "unpickles nothing,\nbounded time and memory): safe on untrusted bundles.")
    p.add_argument("bundle", type=Path, metavar="BUNDLE", help="bundle directory (or a "
                   "directory of bundles: lists them and any leftovers of killed captures)")
    _flag(p, "--json", "print the summary as JSON", dest="as_json")


def _triage(sub) -> None:
    p = sub.add_parser(
        "triage", help="Replay every bundle under DIRS in parallel and group failures by "
        "culprit signature.",
        description="Replay every bundle under DIRS in parallel and group failures by culprit "
        "signature.\n\nOne bundle that hangs, crashes or is malformed is its own error row; "
        "triage.json and\ntriage.md in --out are kept current while it runs and written on "
        "SIGTERM/SIGINT too.\nExit: 0 all clean, 1 known signatures only, 3 new signatures, 2 "
        "errors only.")
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIRS",
                   help="directories to search for bundles")
    p.add_argument("--out", type=Path, default=Path("nanbisect-triage"), metavar="DIR",
                   help="where triage.json/.md and the cache go (default: nanbisect-triage)")
    _number(p, "--jobs", "parallel replays (default: by cores and free memory; on a cluster: "
            "all its slots)", metavar="N")
    p.add_argument("--known", type=Path, metavar="FILE", help="a previous triage.json or a file "
                   "of known signatures, one a line")
    p.add_argument("--target", metavar="DEVICE", help="device to replay on")
    _number(p, "--timeout", "seconds one bundle's replay may take before it is killed and "
            "becomes an error row (default: 1800)", default=1800.0, metavar="S")
    p.add_argument("--backend", default="loky", metavar="NAME", help="loky (processes here, "
                   "the default), dask or ray (an existing cluster, through joblib)")
    p.add_argument("--scheduler", metavar="ADDR", help="Dask scheduler address for --backend "
                   "dask, e.g. tcp://10.0.0.5:8786")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster address for --backend ray, "
                   "e.g. 10.0.0.5:6379")
    _flag(p, "--json", "print triage.json", dest="as_json")


def _pack(sub) -> None:
    p = sub.add_parser(
        "pack", help="One archive for a ticket: report, repro, manifest(s), environment.",
        description="One archive for a ticket: report, repro, manifest(s), environment (under "
        "10 MB).\n\nNever replaces what it did not write: an existing -o is refused (with "
        "--force, unless it is\nan earlier pack), as is -o inside a bundle or inside the "
        "directory being packed.")
    p.add_argument("src", type=Path, metavar="SRC",
                   help="a bundle (after `run`) or a report directory")
    p.add_argument("-o", "--output", type=Path, default=Path("nanbisect-ticket.tar.gz"),
                   metavar="FILE", help="the archive to write: a new path outside any bundle "
                   "(default: nanbisect-ticket.tar.gz)")
    p.add_argument("--full", action=argparse.BooleanOptionalAction, default=False,
                   help="include the model and optimizer state (default: --no-full)")
    _flag(p, "--force", "replace -o when it is an earlier pack (never any other file)")


def _unpack(sub) -> None:
    p = sub.add_parser(
        "unpack", help="Extract a ticket archive safely.",
        description="Extract a ticket archive safely (no absolute paths, no '..', no links, no "
        "compression\nbombs, nothing left behind on refusal).")
    p.add_argument("archive", type=Path, metavar="ARCHIVE",
                   help="an archive written by nanbisect pack")
    p.add_argument("dest", type=Path, metavar="DEST",
                   help="new or empty directory to extract into")
    _number(p, "--max-bytes", "most uncompressed bytes to accept (default: "
            "NANBISECT_UNPACK_MAX_BYTES, else 50x the archive, at least 64 MiB, at most 4 GiB)",
            metavar="N")


def _clean(sub) -> None:
    p = sub.add_parser(
        "clean", help="Remove what killed captures and report writes left behind.",
        description="Remove what killed captures and report writes left behind (hidden "
        ".NAME.tmp-XXXXXXXX\ndirectories that carry nanbisect's marker); never a bundle, a "
        "report or anything else.\n\nLooks in each DIR and in the bundles directly inside it, "
        "nowhere deeper; a directory with\nthat name shape but without the marker (an older "
        "nanbisect's, or yours) is listed and kept.\n\nA directory that is or holds a mount "
        "point is kept: clean never enters another\nfile system. One that cannot be removed "
        "(read-only, immutable) is one line on\nstderr; the rest are removed all the same."
        "\n\nExit: 0 done (removed, or kept for the reason printed), 1 some leftover could"
        "\nnot be removed, or only in part, 2 bad input (nothing removed).")
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIRS", help="directories to search "
                   "for leftovers: Guard's out, a bundle, the parent of a --out")
    _number(p, "--min-age", "remove only leftovers nothing has written to for this many "
            "seconds (default: 600)", default=600.0, metavar="S")
    _flag(p, "--dry-run", "list what would be removed")


def _selftest(sub) -> None:
    p = sub.add_parser(
        "selftest", help="Plant built-in faults, catch them with Guard, bisect them.",
        description="Plant built-in faults, catch them with Guard, bisect them; exit 1 if one "
        "is missed.")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="device to plant and find the faults on (default: cpu)")
    _flag(p, "--json", "print the results as JSON", dest="as_json")


def build() -> Parser:
    """The parser of ``nanbisect [--version] COMMAND ...``.

    >>> build().parse_args(["run", "b", "--steps", "3"]).steps
    3
    """
    from nanbisect import __version__

    top = Parser(prog="nanbisect", description="Find the first operation that breaks a "
                 "PyTorch training step.")
    top.add_argument("--version", action="version", version=f"nanbisect {__version__}",
                     help="print the version and exit")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add in (_run, _inspect, _triage, _pack, _unpack, _clean, _selftest):
        add(sub)
    top.commands = sub.choices      # name -> its parser (its usage errors name its --help)
    return top
