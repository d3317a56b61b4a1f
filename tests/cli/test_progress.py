"""Progress on stderr (`nanbisect.cli.progress`): drawn by the real CLI when its stderr is a
pseudo-terminal (the stage, the replays done; triage's bundles done of the total, the time and
ETA), never when stderr is piped (no progress words, no control character) or with --quiet; the
summary on stdout is the same either way."""
from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import threading

import pytest

from helpers import ROOT, cli
from helpers.paths import FIXTURES

ESC, CR = "\x1b", "\r"
RUN_STAGES = ("module bisection", "op bisection", "replay done", "replays done")


def _terminal_env() -> dict[str, str]:
    """The environment of a child on a terminal: a real TERM, none of rich's overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANBISECT_TEST")
           and k not in ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR",
                         "COLUMNS", "LINES")}
    return {**env, "TERM": "xterm-256color"}


def on_pty(*args: str, timeout: float = 240) -> tuple[int, str, str]:
    """``python -m nanbisect ARGS`` with a pseudo-terminal (200 columns) as its stderr and
    stdout piped: (exit code, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    try:
        p = subprocess.Popen([sys.executable, "-m", "nanbisect", *map(str, args)], cwd=ROOT,
                             env=_terminal_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=slave)
    finally:
        os.close(slave)
    got: list[bytes] = []

    def read() -> None:         # drained as it comes: a full terminal would block the child
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:     # EIO: every writer has closed the terminal
                return
            if not chunk:
                return
            got.append(chunk)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        reader.join(10)
        os.close(master)
    return p.returncode, out.decode(errors="replace"), b"".join(got).decode(errors="replace")


def _night(tmp_path):
    """Two bundles with different culprits, without their shipped reports."""
    night = tmp_path / "night"
    for name in ("nan_batch", "forward_nan_behind_mask"):
        shutil.copytree(FIXTURES / name, night / name,
                        ignore=shutil.ignore_patterns("nanbisect-report"))
    return night


def test_every_stage_has_words():
    """A stage the pipeline announces (`nanbisect.pipeline.run.STAGES`) is shown in words, and
    only the passes that replay the step count as replays."""
    from nanbisect.cli.progress import REPLAYS, STAGE_WORDS
    from nanbisect.pipeline.run import STAGES

    assert set(STAGE_WORDS) == set(STAGES) and REPLAYS < set(STAGES)


def test_not_drawn_when_piped_or_quiet(tmp_path):
    from nanbisect.cli.progress import run_progress, shown, triage_progress

    with open(tmp_path / "err", "w") as f:
        assert not shown(False, f)          # a file, as a nightly job's stderr is
    assert not shown(True, type("Tty", (), {"isatty": lambda self: True})())     # --quiet
    with run_progress() as tell, triage_progress() as count:   # pytest's stderr: no terminal
        tell("build", "building the task")
        count(1, 2)


@pytest.mark.slow
def test_run_shows_progress_on_a_terminal_only(fixture_bundle, tmp_path):
    bundle = fixture_bundle("forward_nan_behind_mask")
    code, out, term = on_pty("run", bundle, "--out", tmp_path / "tty")
    assert code == 1, out + term
    assert out.startswith("nanbisect: culprit - nan born in aten.sqrt.default"), out
    assert all(w in term for w in RUN_STAGES), term[-3000:]     # the stages, drawn
    assert "remedies: remedy replay 1/" in term, term[-3000:]
    assert CR in term and ESC + "[" in term, term[-3000:]       # redrawn in place
    # the summary is stdout's, the same as piped; the culprit is said on stderr once, as soon
    # as the run knows it (before the remedies)
    found = "nanbisect: culprit found: nan born in aten.sqrt.default in forward"
    assert term.count(found) == 1 and term.index(found) < term.index("remedy replay 1/"), term

    piped = cli("run", bundle, "--out", tmp_path / "piped", env={"FORCE_COLOR": "1"})
    assert piped.code == 1 and piped.stdout == out.replace(str(tmp_path / "tty"),
                                                           str(tmp_path / "piped"))
    assert ESC not in piped.stderr and CR not in piped.stderr, repr(piped.stderr)
    assert not any(w in piped.stderr for w in RUN_STAGES), piped.stderr
    assert piped.stderr.startswith(found) and "; remedies and the report follow" in piped.stderr

    code, quiet_out, quiet_term = on_pty("run", bundle, "--out", tmp_path / "quiet", "-q",
                                         "--no-remedies")
    assert code == 1 and quiet_out.startswith("nanbisect: culprit"), quiet_out + quiet_term
    assert quiet_term == "", repr(quiet_term)


@pytest.mark.slow
def test_run_errors_still_print_under_quiet(tmp_path):
    missing = tmp_path / "nope"
    code, out, term = on_pty("run", missing, "--quiet")
    assert code == 2 and out == ""
    assert term.startswith("nanbisect: error: ") and "does not exist" in term, term
    assert ESC not in term, repr(term)


@pytest.mark.slow
def test_triage_shows_bundles_done_and_eta_on_a_terminal_only(tmp_path):
    night, out = _night(tmp_path), tmp_path / "out"
    code, summary, term = on_pty("triage", night, "--out", out, "--jobs", "2")
    assert code == 3, summary + term
    assert summary.startswith("# nanbisect triage") and "2 bundle(s): 2 replayed" in summary
    assert "0/2" in term and "2/2" in term and "bundles" in term and "ETA" in term, term[-3000:]
    assert CR in term and ESC + "[" in term, term[-3000:]

    piped = cli("triage", night, "--out", out, "--jobs", "2", env={"FORCE_COLOR": "1"})
    assert piped.code == 3 and piped.stdout.startswith("# nanbisect triage"), piped.stderr
    assert ESC not in piped.stderr and CR not in piped.stderr, repr(piped.stderr)
    assert "ETA" not in piped.stderr and "/2" not in piped.stderr, piped.stderr

    code, summary, term = on_pty("triage", night, "--out", out, "--jobs", "2", "--quiet")
    assert code == 3 and summary.startswith("# nanbisect triage"), summary + term
    assert term == "", repr(term)
