"""The typer application the commands register on (`nanbisect.cli.commands`), and what their
annotations share: the number flags' parser, the help panels, each command's exit codes (the
first-stage checks each command makes before it imports anything heavy are
`nanbisect.cli.checks`).

Guarantees: imports typer and the standard library only (typer, with the pydantic a recent typer
converts values with, loads in well under 0.1 s; torch and numpy never, and rich only to draw
``--help``), so a usage error is answered before anything heavy; a flag's name, default and help
are written once, in its command's signature.
"""
from __future__ import annotations

import difflib
import inspect
from pathlib import PurePath
from typing import Any, Callable

import typer
from typer.core import TyperCommand, TyperGroup

from nanbisect.errors import BadInput
from nanbisect.util.library_internals import click_exceptions
from nanbisect.util.numbers import NUMBERS
from nanbisect.util.user_paths import user_path

click_errors = click_exceptions()     # typer's own copy of click, or click

# `run`'s exit codes (DESIGN.md's); every command's are in its --help, from its `command(exits=)`
EXIT_CODES = {
    0: "replay clean",
    1: "culprit found (or non-finite input)",
    2: "usage or bad input (one line on stderr naming the problem, no traceback, nothing "
       "written)",
    3: "the recorded failure did not reproduce",
    4: "internal error before any verdict (one line on stderr naming the log file that holds "
       "the traceback)",
}
DONE_CODES = {0: "done", 2: EXIT_CODES[2]}      # inspect, pack, unpack

# help panels of `run`'s (and `triage`'s) flags
BUNDLE_PANEL, DEVICE_PANEL, SCOPE_PANEL = "Bundle and report", "Devices", "What to replay"
REMEDY_PANEL, CLUSTER_PANEL = "Remedies", "Cluster"


class Refused(click_errors.UsageError):
    """A flag's value refused by its parser: the message names the flag, the value and the
    range (`nanbisect.util.numbers`), and is printed as it is."""


class UnknownCommand(click_errors.UsageError):
    """A command name that is none of nanbisect's: the message names the commands and, when one
    is close, suggests it."""


def _tidy(params: list) -> list:
    """``params`` as the help shows them: an on/off flag (``--help``, ``--install-completion``)
    with no value type, a flag whose default is None (not given) with no default."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
        if p.default is None and not isinstance(getattr(p, "show_default", None), str):
            p.show_default = False
    return params


class Command(TyperCommand):
    """A command: typer's, its on/off flags shown as flags, and every path it was given checked
    before its code runs (`nanbisect.util.user_paths.user_path`: empty, a NUL byte, a name over
    the file system's length: one line, exit 2)."""

    def get_params(self, ctx):
        return _tidy(super().get_params(ctx))

    def parse_args(self, ctx, args):
        ctx.meta["nanbisect.args"] = list(args)      # as given: a Path of '' reads as '.'
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        named = {p.name: p for p in self.params}
        raw = ctx.meta.get("nanbisect.args") or []
        for key, value in ctx.params.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            p = named.get(key)
            option = p is not None and p.param_type_name == "option" and p.opts
            what = max(p.opts, key=len) if option else \
                (getattr(p, "metavar", None) or key.upper())
            for v in values:
                if not isinstance(v, PurePath):
                    continue
                if str(v) == "." and _given_empty(raw, p.opts if option else None):
                    v = ""
                user_path(v, what)
        return super().invoke(ctx)


def _given_empty(args: list[str], opts: list[str] | None) -> bool:
    """Was an empty string given for the option ``opts`` (``--out ''``, ``--out=``), or, for an
    argument (``opts`` None), as a bare argument?"""
    if opts is None:
        return "" in args
    return any((a in opts and i + 1 < len(args) and args[i + 1] == "") or a in
               {f"{o}=" for o in opts} for i, a in enumerate(args))


class Group(TyperGroup):
    """The top-level group: an unknown command is refused with the list of commands and, for a
    typo, the nearest one (whatever typer's version does on its own)."""

    def get_params(self, ctx):
        return _tidy(super().get_params(ctx))

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name is not None and not name.startswith("-") and \
                self.get_command(ctx, name) is None:
            near = difflib.get_close_matches(name, list(self.commands))
            hint = f" (did you mean {' or '.join(repr(m) for m in near)}?)" if near else ""
            raise UnknownCommand(f"unknown command {name!r}{hint}; the commands are "
                                 f"{', '.join(self.commands)}", ctx)
        return super().resolve_command(ctx, args)


def prose(doc: str) -> str:
    """A docstring as help text: its paragraphs, each on one line (the help wraps them)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def exit_line(exits: dict[int, str]) -> str:
    """``Exit: 0 ..., 1 ...`` (a command's help ends with it)."""
    return "Exit: " + ", ".join(f"{code} {what}" for code, what in sorted(exits.items())) + "."


def command(short_help: str, exits: dict[int, str]) -> Callable[[Callable], Callable]:
    """Register the decorated function as a command of `app`: its signature the flags, its
    docstring the help, ``short_help`` its line in ``nanbisect --help``, ``exits`` its exit
    codes (the last line of its help)."""
    def register(func: Callable) -> Callable:
        return app.command(cls=Command, short_help=short_help, help=prose(func.__doc__ or ""),
                           epilog=exit_line(exits))(func)
    return register


def flag(*names: str, panel: str | None = None, **kw) -> Any:
    """An option's declaration (names, help, metavar, help panel; a default explained in words,
    ``show_default="..."``, where the value itself is None)."""
    return typer.Option(*names, rich_help_panel=panel, **kw)


def switch(*names: str, help: str, panel: str | None = None) -> Any:
    """An on/off flag's declaration (it takes no value: `Command` shows none)."""
    return typer.Option(*names, help=help, rich_help_panel=panel)


def number_flag(name: str, text: str, metavar: str, panel: str | None = None, **kw) -> Any:
    """A number flag's declaration: parsed by `nanbisect.util.numbers` (a refusal names the
    flag, the value, the unit and the range), its unit and range in its help."""
    return typer.Option(name, parser=number(name), help=NUMBERS[name].help(text),
                        metavar=metavar, rich_help_panel=panel, **kw)


def number(name: str) -> Callable[[Any], Any]:
    """The parser of the number flag ``name``: `nanbisect.util.numbers`'s, its refusal a
    `Refused` (a default, already a number, is checked as a library keyword is)."""
    n = NUMBERS[name]

    def parse(raw: Any) -> Any:
        try:
            return n.parse(raw) if isinstance(raw, str) else n.check(raw)
        except BadInput as e:
            raise Refused(str(e)) from None
    parse.__name__ = name.lstrip("-").replace("-", "_")
    return parse


def _version(value: bool) -> None:
    if value:
        from nanbisect import __version__

        print(f"nanbisect {__version__}", flush=True)
        raise typer.Exit(0)


app = typer.Typer(
    name="nanbisect", cls=Group, add_completion=True, pretty_exceptions_enable=False,
    rich_markup_mode="rich", context_settings={"help_option_names": ["-h", "--help"]},
    help="Find the first operation that breaks a PyTorch training step.",
    epilog="Each command's exit codes are in its --help; 2 is always a usage error or bad input "
    "(one line on stderr).")


@app.callback()
def _top(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Find the first operation that breaks a PyTorch training step."""
