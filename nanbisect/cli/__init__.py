"""The command line, in two stages: parse the flags (typer: `app` and the annotated functions in
`commands`) and check the arguments and paths (`checks`) with typer and the standard library
only, then run the command, which imports torch and the rest of nanbisect. A usage error, a
missing bundle, a file where a directory belongs or a malformed device string is answered by the
first stage, in a fraction of a second; ``--help`` and ``--version`` never reach the second.

A usage error (unknown command or flag, a value of the wrong type, a missing argument) and any
bad input is one line on stderr, ``nanbisect: error: ...`` (a usage error adds ``; see
'nanbisect CMD --help'``), exit code 2, never click's usage block or a traceback. The exit codes:
`nanbisect.cli.app.EXIT_CODES`; the reference of every flag: docs/reference/cli.md
(`nanbisect.cli.reference`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, NoReturn, Sequence

import typer

from nanbisect.cli.app import app, click_errors
from nanbisect.errors import BadInput
from nanbisect.util.text import clip

COMPLETE_VAR = "_NANBISECT_COMPLETE"     # set by the shell completion `--install-completion` adds


@functools.lru_cache(maxsize=1)
def click_command():
    """The click command tree of the typer app, its commands registered (built once a
    process): what runs, and what docs/reference/cli.md is made from."""
    from nanbisect.cli import commands  # noqa: F401 - registers the commands on `app`

    return typer.main.get_command(app)


def run_app(args: list[str]) -> Any:
    """The app on ``args`` (not standalone: errors raise, the command's return value returns)."""
    return click_command().main(args, prog_name="nanbisect", complete_var=COMPLETE_VAR,
                                standalone_mode=False)


def print_help(file=None) -> None:
    """The top-level help, on ``file`` (default stdout)."""
    with contextlib.redirect_stdout(file or sys.stdout):
        run_app(["--help"])


def _said(e: click_errors.UsageError) -> str:
    """What went wrong, in argparse's words where they are the clearer ones."""
    if isinstance(e, click_errors.NoSuchOption):
        near = sorted(e.possibilities or ())
        hint = f" (did you mean {' or '.join(near)}?)" if near else ""
        return f"unrecognized arguments: {e.option_name}{hint}"
    if isinstance(e, click_errors.MissingParameter) and e.param is not None and \
            e.param.param_type_name == "argument":
        return f"the following arguments are required: {e.param.metavar or e.param.name.upper()}"
    text = e.format_message().strip().rstrip(".")
    return text[:1].lower() + text[1:]


def usage_line(e: click_errors.UsageError, args: Sequence[str] = ()) -> str:
    """The one line a usage error prints: the problem and which ``--help`` to read (the
    command's, also where click gives no context: an option without its value)."""
    if e.ctx is not None:
        prog = e.ctx.command_path
    else:
        named = args[0] if args and args[0] in click_command().commands else None
        prog = f"nanbisect {named}" if named else "nanbisect"
    return f"nanbisect: error: {clip(_said(e), 2000)}; see '{clip(prog, 200)} --help'"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``nanbisect ARGS`` (``argv``, default ``sys.argv[1:]``): exits with the command's code.

    >>> main(["--version"])
    Traceback (most recent call last):
    ...
    SystemExit: 0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args and COMPLETE_VAR not in os.environ:    # (a completion request has no args)
        print_help(sys.stderr)
        sys.exit(2)
    try:
        code = run_app(args)
    except click_errors.UsageError as e:
        print(usage_line(e, args), file=sys.stderr, flush=True)
        sys.exit(2)
    except BadInput as e:
        print(f"nanbisect: error: {clip(e, 2000)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:   # (click answers one inside a command with exit 130 itself)
        sys.exit(130)
    except typer.Abort as e:    # end of input where a prompt read one; or a Ctrl-C that an
        # older click turned into Abort: 130, as for any interrupt
        interrupted = isinstance(e.__context__ or e.__cause__, KeyboardInterrupt)
        sys.exit(130 if interrupted else 1)
    sys.exit(0 if code is None else code)
