"""Every number a user gives (flags and ``NANBISECT_*`` variables) goes through one parser,
`nanbisect.util.numbers`: fuzzed with hypothesis over every flag and variable and every hostile
value (derandomized, as tests/bundle/test_fuzz.py; ``NANBISECT_FUZZ_EXAMPLES=N`` for a longer random
campaign). A value the independent oracle below calls bad is one line on stderr naming the flag or
variable, exit 2, from the command itself (in-process: these are refused before torch is
imported); a good one parses to the number the text says.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shutil
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanbisect.cli import main
from nanbisect.errors import BadInput
from nanbisect.util.numbers import NUMBERS, Number, env

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "fixtures" / "bundles" / "nan_batch"
_N = int(os.environ.get("NANBISECT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_N or 150, derandomize=not _N, deadline=None,
                suppress_health_check=list(HealthCheck))

HOSTILE = ["nan", "NaN", "inf", "-inf", "+inf", "infinity", "1e300", "-1e300", "1e-300", "-1",
           "-0", "0", "0.0", "", " ", "1e", "e5", "0x10", "1,5", "5s", "10m", "1_000", "٣",
           "9" * 400, "9" * 5000, "-" + "9" * 5000, "1" + "0" * 30, "2.5", "1e3", "3.0", "\n7",
           "7\x00", "None", "true"]


def oracle(n: Number, raw: str):
    """The value ``raw`` gives ``n``, or None when it must be refused: written apart from the
    parser (decimal arithmetic, no float rounding at the range's ends)."""
    text = raw.strip()
    if not text or "\x00" in raw or re.search(r"(?<![0-9])_|_(?![0-9])", text):
        return None     # (Decimal takes "0_" and "1__0"; Python's numbers do not)
    try:
        d = Decimal(text)
    except (InvalidOperation, ValueError):
        return None
    if not d.is_finite():
        return None
    if n.kind is int and (not d == d.to_integral_value() or any(c in text.lower()
                                                                  for c in ".e")):
        return None
    v = d if n.kind is int else Decimal(float(d))    # a float flag: the range holds after rounding
    low, high = Decimal(repr(n.low)), Decimal(repr(n.high))
    if v < low or v > high or (n.low_open and v == low):
        return None
    return d


def _args(n: Number, tmp: Path) -> list[str]:
    """A command line that reads ``n``, everything else in it good."""
    command = n.commands[0]
    first = {"run": [str(BUNDLE)], "inspect": [str(BUNDLE)],
             "triage": [str(tmp)], "clean": [str(tmp)],
             "unpack": [str(tmp / "a.tar.gz"), str(tmp / "dest")]}[command]
    return [command, *first]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("numbers")
    (d / "a.tar.gz").write_bytes(b"not read: the number is refused first")
    return d


def _cli(argv: list[str], environ: dict[str, str]) -> tuple[int, str]:
    err = io.StringIO()
    old = dict(os.environ)
    os.environ.update(environ)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            with pytest.raises(SystemExit) as e:
                main(argv)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return e.value.code, err.getvalue()


def _refused_by_the_command(n: Number, raw: str, tmp: Path) -> None:
    if "\x00" in raw:
        return      # no environment or command line can hold it
    if n.is_env:
        if not n.commands:      # the Guard's: read when a Guard is made
            with pytest.raises(BadInput, match=n.name):
                with _env(n.name, raw):
                    env(n.name)
            return
        code, err = _cli(_args(n, tmp), {n.name: raw})
    else:
        code, err = _cli([*_args(n, tmp), f"{n.name}={raw}"], {})
    assert code == 2, (n.name, raw, err)
    assert err.count("\n") == 1 and err.startswith("nanbisect: error: "), err
    assert n.name in err and n.range_text() in err, err
    assert len(err) < 400, err
    assert "Traceback" not in err


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _judge(n: Number, raw: str, tmp: Path) -> None:
    want = oracle(n, raw)
    if want is None:
        with pytest.raises(BadInput) as e:
            n.parse(raw)
        assert n.name in str(e.value) and "\n" not in str(e.value)
        _refused_by_the_command(n, raw, tmp)
    else:
        got = n.parse(raw)
        assert isinstance(got, n.kind) and not isinstance(got, bool)
        assert math.isfinite(got) and n.low <= got <= n.high
        assert abs(Decimal(repr(got)) - want) <= abs(want) * Decimal("1e-15")


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_every_hostile_value_is_refused_by_name(name, tmp):
    n = NUMBERS[name]
    for raw in HOSTILE + [repr(n.high), repr(n.low), str(n.high * 2), str(n.low - 1)]:
        _judge(n, raw, tmp)


_texts = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(alphabet="0123456789+-.eE_ infa", max_size=12),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30).map(str),
    st.text(max_size=8))


@FUZZ
@given(name=st.sampled_from(sorted(NUMBERS)), raw=_texts)
def test_property_one_parser_for_every_number(name, raw, tmp):
    _judge(NUMBERS[name], raw, tmp)


@FUZZ
@given(name=st.sampled_from(sorted(n for n in NUMBERS if n.startswith("-"))),
       value=st.one_of(st.floats(), st.integers(min_value=-(10 ** 20), max_value=10 ** 20)))
def test_property_library_keywords_checked_alike(name, value):
    """A library call's keyword (``triage(timeout=...)``) is judged as the flag's text is."""
    n = NUMBERS[name]
    good = (math.isfinite(value) and n.low <= value <= n.high
            and not (n.low_open and value == n.low)
            and (n.kind is float or isinstance(value, int)))
    if good:
        assert n.check(value) == value
    else:
        with pytest.raises(BadInput, match=n.param):
            n.check(value)


@pytest.mark.parametrize("name,value,words", [
    # issue 39's rows: each crashed, hung or blamed the wrong thing before
    ("NANBISECT_COMPILER_TIMEOUT", "inf", "is not a finite number"),    # OverflowError, exit 1
    ("NANBISECT_RANK_TIMEOUT", "1e10", "is out of range"),     # every rank died in faulthandler
    ("NANBISECT_CONNECT_TIMEOUT", "inf", "is not a finite number"),     # timestamp out of range
    ("NANBISECT_REMEDY_BUDGET", "-1", "is out of range"),               # did not name it
])
def test_variables_are_refused_before_the_replay_starts(name, value, words, tmp_path):
    """`run` refuses a bad variable before anything is replayed or written."""
    n = NUMBERS[name]
    argv = _args(n, tmp_path) + (["--out", str(tmp_path / "r")] if n.commands[0] == "run" else [])
    code, err = _cli(argv, {name: value})
    assert code == 2 and f"{name}='{value}' {words}" in err, err
    assert not (tmp_path / "r").exists()


def test_library_entry_points_read_variables_through_the_parser(monkeypatch, tmp_path):
    """What a notebook calls gets the same refusal as the command line."""
    from nanbisect.compiler import bisect_timeout
    from nanbisect.guard.agree import write_timeout
    from nanbisect.multirank.launcher import rank_timeout
    from nanbisect.pipeline import RunOptions, run_bundle
    from nanbisect.nightly import triage

    for name, read in [("NANBISECT_COMPILER_TIMEOUT", bisect_timeout),
                       ("NANBISECT_RANK_TIMEOUT", rank_timeout),
                       ("NANBISECT_WRITE_TIMEOUT", write_timeout)]:
        monkeypatch.setenv(name, "1e300")
        with pytest.raises(BadInput, match=f"{name}='1e300' is out of range"):
            read()
        monkeypatch.setenv(name, "30")
        assert read() == 30.0
    monkeypatch.setenv("NANBISECT_COMPILER_TIMEOUT", "nan")
    b = tmp_path / "b"
    shutil.copytree(BUNDLE, b, ignore=shutil.ignore_patterns("nanbisect-report"))
    with pytest.raises(BadInput, match="NANBISECT_COMPILER_TIMEOUT='nan' is not a finite"):
        run_bundle(b, RunOptions(remedies=0), tmp_path / "r")
    assert not (tmp_path / "r").exists()
    monkeypatch.delenv("NANBISECT_COMPILER_TIMEOUT")
    with pytest.raises(BadInput, match="triage: timeout=inf is not a finite number"):
        triage([tmp_path], timeout=float("inf"))
    with pytest.raises(BadInput, match="triage: jobs=0 is out of range"):
        triage([tmp_path], jobs=0)
    monkeypatch.setenv("NANBISECT_CONNECT_TIMEOUT", "inf")
    with pytest.raises(BadInput, match="NANBISECT_CONNECT_TIMEOUT='inf'"):
        triage([tmp_path], out=tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("value", ["1e300", "nan", "-1", "", "1.5", "9" * 5000, "1048576",
                                   "0x1", "٣"])
def test_ranks_are_numbers_too(value, tmp_path):
    """``--ranks``: rank numbers within the largest world a bundle may have, the value quoted
    short (a 5,000-digit rank was a 5 KB line)."""
    from nanbisect.bundle.bounded import MAX_WORLD_SIZE
    from nanbisect.util.spec import MAX_RANK

    assert MAX_RANK == MAX_WORLD_SIZE - 1
    code, err = _cli(["run", str(BUNDLE), f"--ranks={value}", "--out", str(tmp_path / "r")], {})
    assert code == 2 and err.count("\n") == 1 and "--ranks" in err and len(err) < 300, err
    assert not (tmp_path / "r").exists()


def test_a_variable_its_flag_overrides_is_not_read(tmp_path):
    """``--max-bytes`` given: NANBISECT_UNPACK_MAX_BYTES is not read, so a bad one is not the
    error (review of issue 39: it was refused though the flag overrode it); the same for
    ``--remedy-budget`` and ``--no-remedies`` (`check_environment`'s ``given``)."""
    from nanbisect.util.numbers import check_environment

    code, err = _cli(["unpack", str(tmp_path / "none.tar.gz"), str(tmp_path / "d"),
                      "--max-bytes", "100"], {"NANBISECT_UNPACK_MAX_BYTES": "junk"})
    assert code == 2 and "is not a file" in err and "NANBISECT_" not in err, err
    with _env("NANBISECT_REMEDY_BUDGET", "lots"):
        check_environment("run", {"--remedy-budget"})
        with pytest.raises(BadInput, match="NANBISECT_REMEDY_BUDGET='lots'"):
            check_environment("run")


def test_numpy_numbers_are_numbers():
    """A library keyword given as a numpy number is judged by its value (review of issue 39:
    "jobs=np.int64(4) is not a number")."""
    import numpy as np

    assert NUMBERS["--jobs"].check(np.int64(4)) == 4
    assert type(NUMBERS["--min-age"].check(np.float32(1.5))) is float
    with pytest.raises(BadInput, match="is not an integer"):
        NUMBERS["--jobs"].check(np.float64(2.0))
