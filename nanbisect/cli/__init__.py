"""The command line, in two stages: parse the flags (`parser`) and check the arguments and paths
(`checks`) with the standard library only, then run the command (`commands`), which imports
torch and the rest of nanbisect. A usage error, a missing bundle, a file where a directory
belongs or a malformed device string is answered by the first stage, in a fraction of a second;
``--help`` and ``--version`` never reach the second.

Exit codes: 0 replay clean, 1 culprit found (or non-finite input), 2 usage or bad input (one line
on stderr, no traceback, nothing written), 3 the recorded failure did not reproduce, 4 (`run`) an
internal error before any verdict (one line on stderr naming the log file with the traceback).
"""
from __future__ import annotations

import sys
from typing import NoReturn, Sequence

from nanbisect.cli import checks
from nanbisect.cli.parser import build
from nanbisect.errors import BadInput
from nanbisect.util.numbers import check_environment
from nanbisect.util.text import clip


def _flags_given(ns) -> set[str]:
    """The flags of ``ns`` that override a variable: given, the variable is not read."""
    given = {f"--{k.replace('_', '-')}" for k, v in vars(ns).items() if v is not None}
    if getattr(ns, "no_remedies", False):
        given.add("--remedy-budget")
    return given


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``nanbisect ARGS`` (``argv``, default ``sys.argv[1:]``): exits with the command's code.

    >>> main(["--version"])
    Traceback (most recent call last):
    ...
    SystemExit: 0
    """
    parser = build()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        parser.print_help(sys.stderr)
        sys.exit(2)
    ns, extra = parser.parse_known_args(args)
    if ns.command is None:      # only global flags, e.g. `nanbisect --json`
        parser.error(f"unrecognized arguments: {' '.join(extra)}" if extra else
                     "no command given")
    if extra:
        parser.commands[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    name = ns.command
    del ns.command
    try:
        # a NANBISECT_* number the command reads, before it starts (not one a flag overrides)
        check_environment(name, _flags_given(ns))
        getattr(checks, name)(ns)
    except BadInput as e:
        print(f"nanbisect: error: {clip(e, 2000)}", file=sys.stderr, flush=True)
        sys.exit(2)
    from nanbisect.cli import commands

    try:
        sys.exit(getattr(commands, name)(**vars(ns)))
    except KeyboardInterrupt:
        sys.exit(130)
