"""docs/reference/cli.md is what `nanbisect.cli.reference` makes from the typer app now: a flag,
default, help text or exit code changed in code and not regenerated fails here
(``python -m nanbisect.cli.reference --write`` regenerates it)."""
from __future__ import annotations

import difflib


def test_the_cli_reference_is_current():
    from nanbisect.cli.reference import DOC, render

    made, committed = render(), DOC.read_text()
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), made.splitlines(True),
                                             "committed", "made now"))[:40])
    assert committed == made, ("docs/reference/cli.md is stale: run python -m "
                               "nanbisect.cli.reference --write\n" + diff)


def test_the_reference_names_every_command_flag_and_default():
    from nanbisect.cli import click_command
    from nanbisect.cli.reference import render

    text = render()
    assert text.splitlines()[0].startswith("<!-- Generated") and "--write" in text[:200]
    group = click_command()
    assert list(group.commands) == ["run", "inspect", "triage", "pack", "unpack", "clean",
                                    "selftest"]
    for name, cmd in group.commands.items():
        section = text.split(f"## `nanbisect {name}`", 1)[1].split("\n## ", 1)[0]
        for p in cmd.params:
            if p.param_type_name == "option" and "--help" not in p.opts:
                assert all(f"`{o}`" in section for o in p.opts + p.secondary_opts), (name, p)
        assert "Exit: " in section, name
    for default in ("`nanbisect-triage`", "`loky`", "`1800.0`", "`600.0`", "`cpu`",
                    "`nanbisect-ticket.tar.gz`", "BUNDLE/nanbisect-report", "`--no-full`"):
        assert default in text, default


def test_check_answers_stale_or_current(tmp_path, monkeypatch, capsys):
    from nanbisect.cli import reference

    assert reference.main(["--check"]) == 0
    stale = tmp_path / "cli.md"
    stale.write_text("old\n")
    monkeypatch.setattr(reference, "DOC", stale)
    assert reference.main(["--check"]) == 1 and "--write" in capsys.readouterr().err
