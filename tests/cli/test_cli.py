"""The command line itself: help and version without torch, the bundle as a plain argument."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT, invoke, one_line_exit_2


def imported_modules(*args: str) -> set[str]:
    """Top-level modules a fresh ``python -m nanbisect ARGS`` imports (``-X importtime``)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "nanbisect", *args],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in p.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--version"], ["run", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    mods = imported_modules(*args)
    assert "nanbisect" in mods and "typer" in mods    # the probe sees imports at all
    assert "torch" not in mods


def test_version_and_short_help():
    from nanbisect import __version__

    assert invoke("--version").stdout.strip() == f"nanbisect {__version__}"
    short, long = invoke("-h"), invoke("--help")
    assert short.code == long.code == 0 and short.stdout == long.stdout
    assert "report.html" in invoke("run", "-h").stdout


@pytest.mark.slow
def test_public_names_load_lazily():
    code = ("import sys, nanbisect\nassert 'torch' not in sys.modules\n"
            "assert nanbisect.Guard.__name__ == 'Guard' and 'torch' in sys.modules\n"
            "assert set(nanbisect.__all__) <= set(dir(nanbisect))\n"
            "try:\n    nanbisect.nope\nexcept AttributeError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "has no attribute 'nope'" in p.stdout


def test_bundle_as_argument_or_flag(fixture_bundle, tmp_path):
    bundle = fixture_bundle("healthy")
    a, b = invoke("run", bundle, "--out", tmp_path / "a"), invoke("run", "--ckpt", bundle,
                                                                   "--out", tmp_path / "b")
    assert a.code == b.code == 0, a.stderr + b.stderr
    def report(d):    # the same report, but for where it was written and how long it took
        rep = json.loads((tmp_path / d / "report.json").read_text().replace(str(tmp_path / d), ""))
        assert set(rep.pop("timings")) >= {"read", "build", "module-pass"}
        return rep
    assert report("a") == report("b")
    same = invoke("run", bundle, "--ckpt", bundle, "--out", tmp_path / "c")
    assert same.code == 0


def test_help_says_what_runs_code_and_what_never_does():
    """`run` executes the entry's code, as the training script would; `inspect` never does."""
    run_help = " ".join(invoke("run", "--help").stdout.replace("`", "").split())
    assert "Runs the entry's code" in run_help and "inspect never runs" in run_help
    inspect_help = " ".join(invoke("inspect", "--help").stdout.split())
    assert "never runs" in inspect_help and "untrusted" in inspect_help
    clean_help = " ".join(invoke("clean", "--help").stdout.split())
    assert "never a bundle" in clean_help


def test_an_interrupt_exits_130(fixture_bundle, monkeypatch):
    from nanbisect.cli import commands

    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(commands, "_run", interrupted)
    res = invoke("run", fixture_bundle("healthy"))
    assert res.code == 130 and "Traceback" not in res.stderr, res.stderr


def test_mistyped_flags_and_commands_are_answered_with_the_nearest():
    """One line, exit 2, the nearest flag or command named (typer and click's suggestions)."""
    for argv, words in [(["run", "b", "--refrence", "cpu"], "did you mean --reference?"),
                        (["triage", "d", "--backnd", "dask"], "did you mean --backend?"),
                        (["rnu", "b"], "did you mean 'run'?"),
                        (["inpsect", "b"], "did you mean 'inspect'?")]:
        res = invoke(*argv)
        assert res.code == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert res.stderr.startswith("nanbisect: error: ") and words in res.stderr, res.stderr


def test_help_groups_runs_flags_in_panels():
    out = invoke("run", "--help").stdout
    for panel in ("Bundle and report", "Devices", "What to replay", "Remedies"):
        assert panel in out, out
    assert "--install-completion" in invoke("--help").stdout


def test_no_command_and_a_completion_request(monkeypatch):
    """No arguments: the help on stderr, exit 2; but a shell's completion request (no arguments,
    the words in the environment) is answered, exit 0."""
    res = invoke()
    assert res.code == 2 and "COMMAND" in res.stderr and "selftest" in res.stderr
    monkeypatch.setenv("_NANBISECT_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "nanbisect ru")
    monkeypatch.setenv("COMP_CWORD", "1")
    res = invoke()
    assert res.code == 0 and res.stdout.split() == ["run"], (res.stdout, res.stderr)


def test_an_option_without_its_value_points_to_its_commands_help():
    """click gives such an error no context: the line still names the command's --help."""
    for args, command in ((["run", "--target"], "run"), (["triage", "d", "--timeout"], "triage"),
                          (["pack", "x", "-o"], "pack")):
        res = invoke(*args)
        line = one_line_exit_2(res, "requires an argument")
        assert line.endswith(f"see 'nanbisect {command} --help'"), line
