"""The command-line reference (docs/reference/cli.md), made from the typer app itself: every
command, argument and flag with its value, default and help, and the exit codes, so that the
reference cannot drift from the code (tests/cli/test_cli_reference.py fails when the committed file
is not what this makes now).

    python -m nanbisect.cli.reference            # print it
    python -m nanbisect.cli.reference --write    # rewrite docs/reference/cli.md in a checkout
    python -m nanbisect.cli.reference --check    # exit 1 when docs/reference/cli.md is stale

Made from the click command tree typer builds (`nanbisect.cli.click_command`), with its own
usage lines and tables rather than typer's help renderer, so the text does not depend on the
terminal's width or on how a typer version draws its help.
"""
from __future__ import annotations

import sys
from pathlib import Path

from nanbisect.cli import click_command
from nanbisect.cli.app import EXIT_CODES

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"
HEADER = """\
<!-- Generated from the typer app in nanbisect/cli/ by `python -m nanbisect.cli.reference
--write`: do not edit by hand (tests/cli/test_cli_reference.py fails when it is stale). -->
# Command-line reference

Every command of `nanbisect`, with its arguments and flags, their defaults and help, as
`nanbisect COMMAND --help` shows them. `-h` is `--help` everywhere; a mistyped flag or command
is answered with the nearest one (`did you mean --reference?`).
"""


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _names(p) -> str:
    names = ", ".join(f"`{o}`" for o in p.opts)
    return names + "".join(f" / `{o}`" for o in p.secondary_opts)


def _value(p) -> str:
    if p.param_type_name == "argument":
        return f"`{p.metavar or p.name.upper()}`" + ("..." if p.nargs == -1 else "")
    # (a `|` in a metavar, as in `local|bundle`, escaped: it would end the table's cell)
    return "" if p.is_flag else f"`{_cell(p.metavar)}`" if p.metavar else ""


def _default(p) -> str:
    if isinstance(p.show_default, str):
        return p.show_default
    if p.param_type_name == "argument":
        return "required" if p.required else "-"
    if getattr(p, "is_flag", False):
        if p.secondary_opts:        # --full/--no-full: the one in force
            return f"`{(p.opts if p.default else p.secondary_opts)[0]}`"
        return "off" if not p.default else "on"
    if p.default is None:
        return "-"
    return f"`{p.default}`"


def _table(params: list) -> list[str]:
    rows = ["| argument or flag | value | default | what it does |", "|---|---|---|---|"]
    for p in params:
        name = f"`{p.metavar or p.name.upper()}`" if p.param_type_name == "argument" \
            else _names(p)
        value = "" if p.param_type_name == "argument" else _value(p)
        rows.append(f"| {name} | {value} | {_cell(_default(p))} | {_cell(p.help or '')} |")
    return rows


def _usage(path: str, params: list, tail: str = "") -> str:
    words = [path, "[OPTIONS]"]
    for p in params:
        if p.param_type_name == "argument":
            name = (p.metavar or p.name.upper()) + ("..." if p.nargs == -1 else "")
            words.append(name if p.required else f"[{name}]")
    return " ".join(words + ([tail] if tail else []))


def _shown(cmd, ctx) -> list:
    """The parameters a reader sets: all but hidden ones and --help (the same everywhere)."""
    helps = set(ctx.help_option_names)
    return [p for p in cmd.get_params(ctx) if not getattr(p, "hidden", False)
            and not helps & set(p.opts)]


def _panels(params: list) -> dict[str, list]:
    """``params`` by help panel, in the order the panels first appear (arguments first)."""
    panels: dict[str, list] = {}
    for p in params:
        default = "Arguments" if p.param_type_name == "argument" else "Options"
        panels.setdefault(getattr(p, "rich_help_panel", None) or default, []).append(p)
    return dict(sorted(panels.items(), key=lambda kv: kv[0] != "Arguments"))


def _command(name: str, cmd, parent) -> list[str]:
    ctx = cmd.make_context(name, [], parent=parent, resilient_parsing=True)
    params = _shown(cmd, ctx)
    lines = [f"## `nanbisect {name}`", "", f"    {_usage(ctx.command_path, params)}", ""]
    lines += [cmd.help or "", "", cmd.epilog or "", ""]
    for panel, ps in _panels(params).items():
        lines += [f"### {panel}", "", *_table(ps), ""]
    return lines


def render() -> str:
    """The reference, as docs/reference/cli.md holds it."""
    group = click_command()
    top = group.make_context("nanbisect", [], resilient_parsing=True)
    lines = [HEADER, f"    {_usage('nanbisect', [], 'COMMAND [ARGS]...')}", "",
             group.help or "", "", "| command | what it does |", "|---|---|"]
    lines += [f"| [`{n}`](#nanbisect-{n}) | {_cell(c.short_help or '')} |"
              for n, c in group.commands.items()]
    lines += ["", "### Options", "", *_table(_shown(group, top)), ""]
    lines += ["### Exit codes", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in EXIT_CODES.items()]
    lines += ["", "A command's own codes, where they differ (`triage`, `clean`), are in its help.",
              ""]
    for name, cmd in group.commands.items():
        lines += _command(name, cmd, top)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if "--write" in args:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(text)
    elif "--check" in args:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m nanbisect.cli.reference --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
