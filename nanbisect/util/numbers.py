"""Every number a user gives nanbisect, flags and ``NANBISECT_*`` variables alike, and the one
parser they all go through.

Guarantees: a value is accepted only when it is finite, of its kind (an integer where one is
counted), and within the range `NUMBERS` documents for it (docs/reference/environment.md's table
is made from it);
anything else (``nan``, ``inf``, ``1e300``, ``-1``, ``''``, ``1e``, a 5,000-digit integer) is one
line naming the flag or the variable the user set, the value, the unit and the range: a
`BadInput` (exit 2) from `Number.parse`, `Number.check` and `env`.
Nothing is cached: a variable is read as it is at the call. Standard library only (the command
line's first stage imports it).
"""
from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass

from nanbisect.errors import BadInput

DAY = 86_400
_DIGITS = re.compile(r"[+-]?[0-9]+(_[0-9]+)*")
WEEK = 7 * DAY


def _text(raw: str, limit: int = 40) -> str:
    r = repr(raw)
    return r if len(r) <= limit else r[:limit - 4] + "...'"


def _num(x: float) -> str:
    """``x`` without a needless ``.0`` or exponent: 600, 0.5, 1099511627776."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Number:
    """One number a user may give: ``name`` (``--flag`` or ``NANBISECT_VARIABLE``), counted in
    ``unit``, an ``int`` or a ``float`` from ``low`` (excluded with ``low_open``) to ``high``."""

    name: str
    unit: str
    kind: type
    low: float
    high: float
    low_open: bool = False
    default: float | None = None
    commands: tuple[str, ...] = ()      # the commands that read it (a variable: checked first)
    about: str = ""                     # what it sets (docs/reference/environment.md's table)
    param: str = ""                     # the library's keyword for it, where one exists
    flag: str = ""                      # a variable's flag: given, the variable is not read

    @property
    def is_env(self) -> bool:
        return not self.name.startswith("-")

    def range_text(self) -> str:
        """``from 0 to 1000`` or ``more than 0, at most 604800 (7 days)``.

        >>> NUMBERS["--min-age"].range_text(), NUMBERS["--timeout"].range_text()
        ('from 0 to 315360000 (3650 days)', 'more than 0, at most 604800 (7 days)')
        """
        top = _num(self.high)
        if self.unit == "seconds" and self.high >= DAY:
            days = self.high / DAY
            top += f" ({_num(days)} day{'s' if days != 1 else ''})"
        elif self.unit == "bytes" and self.high >= 1 << 30:
            tib = self.high >= 1 << 40
            top += f" ({_num(self.high / (1 << (40 if tib else 30)))} {'TiB' if tib else 'GiB'})"
        if self.low_open:
            return f"more than {_num(self.low)}, at most {top}"
        return f"from {_num(self.low)} to {top}"

    def wanted(self) -> str:
        kind = "an integer number" if self.kind is int else "a number"
        return f"{kind} of {self.unit} {self.range_text()}"

    def _why(self, raw: str) -> str | None:
        """None when ``raw`` is a good value, else what is wrong with it."""
        text = raw.strip()
        if not text:
            return "is empty"
        digits = _DIGITS.fullmatch(text) is not None        # a plain integer, written out
        try:
            value = self._value(raw)
        except ValueError:
            if digits:
                return "is out of range"        # int() refuses integers of over 4,300 digits
            if self.kind is not int:
                return "is not a number"
            try:        # "1e3", "2.5"
                value = float(raw)
            except ValueError:
                return "is not a number"
            if not math.isfinite(value):
                return self._why_value(value)
            return "is not written as an integer"
        if isinstance(value, float) and math.isinf(value) and \
                text.lstrip("+-").lower() not in ("inf", "infinity"):
            return "is out of range"            # 1e400, or 400 digits: finite, just huge
        return self._why_value(value)

    def _why_value(self, value) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real)):
            return "is not a number"
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):
            return "is not a finite number"
        if self.kind is int and not isinstance(value, numbers.Integral):
            return "is not an integer"      # 3.0 or 2.5 given where a count is expected
        if value < self.low or (self.low_open and value == self.low) or value > self.high:
            return "is out of range"
        return None

    def _value(self, raw: str):
        return self.kind(raw) if self.kind is int else float(raw)

    def parse(self, raw: str):
        """``raw`` (the text the user gave) as this number; `BadInput` naming it otherwise.

        >>> NUMBERS["NANBISECT_RANK_TIMEOUT"].parse("1e10")
        Traceback (most recent call last):
        ...
        nanbisect.errors.BadInput: NANBISECT_RANK_TIMEOUT='1e10' is out of range: give a number \
of seconds more than 0, at most 604800 (7 days), or unset it (default 600)
        """
        why = self._why(raw)
        if why is not None:
            raise BadInput(self.message(raw, why))
        return self._value(raw)

    def message(self, raw: str, why: str) -> str:
        if self.is_env:
            unset = "or unset it" + (f" (default {_num(self.default)})"
                                     if self.default is not None else "")
            return f"{self.name}={_text(raw)} {why}: give {self.wanted()}, {unset}"
        return f"{self.name} {_text(raw)} {why}: give {self.wanted()}"

    def check(self, value, who: str = ""):
        """``value`` given in Python (a library call's keyword): returned when good, else
        `BadInput` naming ``who`` (default: the keyword, ``param=``).

        >>> NUMBERS["--timeout"].check(float("inf"), "triage")
        Traceback (most recent call last):
        ...
        nanbisect.errors.BadInput: triage: timeout=inf is not a finite number: give a number \
of seconds more than 0, at most 604800 (7 days)
        """
        why = self._why_value(value)
        if why is None:
            return self.kind(value)     # a numpy number too, as a plain int or float
        head = f"{who}: " if who else ""
        raise BadInput(f"{head}{self.param or self.name}={_text(repr(value))[1:-1]} {why}: "
                       f"give {self.wanted()}")

    def help(self, text: str) -> str:
        """A flag's ``--help`` line with its range."""
        return f"{text}; {self.unit} {self.range_text()}"


_ALL = (
    Number("--steps", "steps", int, 1, 1_000_000, commands=("run",), param="steps",
           about="the last K recorded steps to replay (bundles of `Guard(lookback=...)`)"),
    Number("--remedy-budget", "replays", int, 0, 1000, commands=("run",), param="remedies",
           about="extra replays the remedies may use (0: none)"),
    Number("NANBISECT_REMEDY_BUDGET", "replays", int, 0, 1000, default=4,
           flag="--remedy-budget", commands=("run", "triage"),
           about="`--remedy-budget` when it is not given"),
    Number("--jobs", "replays", int, 1, 4096, commands=("triage",), param="jobs",
           about="parallel replays"),
    Number("--timeout", "seconds", float, 0, WEEK, low_open=True, default=1800,
           commands=("triage",), param="timeout",
           about="one bundle's replay, before it is killed and becomes an error row"),
    Number("--max-bytes", "bytes", int, 1, 1 << 40, commands=("unpack",), param="max_bytes",
           about="most uncompressed bytes `unpack` accepts"),
    Number("NANBISECT_UNPACK_MAX_BYTES", "bytes", int, 1, 1 << 40, commands=("unpack",),
           flag="--max-bytes",
           about="`--max-bytes` when it is not given (default: 50x the archive, 64 MiB to "
                 "4 GiB)"),
    Number("--min-age", "seconds", float, 0, 3650 * DAY, default=600, commands=("clean",),
           param="min_age", about="`clean` removes only leftovers untouched this long"),
    Number("NANBISECT_RANK_TIMEOUT", "seconds", float, 0, WEEK, low_open=True, default=600,
           commands=("run", "triage", "the Guard"),
           about="a multi-rank replay, all ranks together; each wait of the Guard on other "
                 "ranks (its per-step agreement, the failing step's re-run, the write's "
                 "exchanges), whose default is the job's own process-group timeout"),
    Number("NANBISECT_COMPILER_TIMEOUT", "seconds", float, 0, WEEK, low_open=True,
           default=600, commands=("run", "triage"),
           about="the compiler bisection of a compiled step"),
    Number("NANBISECT_WRITE_TIMEOUT", "seconds", float, 0, DAY, low_open=True, default=300,
           about="a rank writing its part of a multi-rank bundle (its rescue as long again)"),
    Number("NANBISECT_CONNECT_TIMEOUT", "seconds", float, 0, 3600, low_open=True, default=15,
           commands=("triage",), about="reaching a Dask scheduler (twice that for a Ray cluster)"),
    Number("NANBISECT_MAX_MANIFEST_BYTES", "bytes", int, 1, 1 << 34, default=64 << 20,
           commands=("run", "inspect", "triage"),
           about="the largest manifest or safetensors header read"),
    Number("NANBISECT_MAX_JSON_ITEMS", "items", int, 1, 1 << 32, default=4_000_000,
           commands=("run", "inspect", "triage"),
           about="JSON values in one manifest or header"),
)
NUMBERS: dict[str, Number] = {n.name: n for n in _ALL}


def omp_threads() -> int | None:
    """The intra-op threads this process was given: ``OMP_NUM_THREADS`` when it is a count
    (torchrun's, a spawner's, a triage worker's share of the cores, which joblib sets); None
    when it is unset or not a count.

    >>> os.environ["OMP_NUM_THREADS"] = "3"; omp_threads()
    3
    >>> del os.environ["OMP_NUM_THREADS"]; omp_threads() is None
    True
    """
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def env(name: str, default=None):
    """``NUMBERS[name]``'s value in the environment as it is now, else ``default`` (else the
    registry's default) when it is unset; `BadInput` naming the variable when it is not good.

    >>> env("NANBISECT_CONNECT_TIMEOUT", 15.0)
    15.0
    """
    raw = os.environ.get(name)
    if raw is None:
        return NUMBERS[name].default if default is None else default
    return NUMBERS[name].parse(raw)


def check_environment(command: str, given: frozenset[str] | set[str] = frozenset()) -> None:
    """Every variable ``command`` reads, parsed now: a bad one is refused before the command
    starts, not an hour in (a multi-rank replay, the compiler bisection). A variable whose flag
    is in ``given`` is not read, so it is not checked either."""
    for n in _ALL:
        if n.is_env and command in n.commands and n.name in os.environ and n.flag not in given:
            n.parse(os.environ[n.name])


def table() -> str:
    """The table of every number (markdown, one row each): docs/reference/environment.md's."""
    rows = ["| flag or variable | read by | what it sets | unit | range | default |",
            "|---|---|---|---|---|---|"]
    for n in _ALL:
        where = ", ".join(n.commands) or "the Guard"
        default = "-" if n.default is None else _num(n.default)
        unit = n.unit + (" (an integer)" if n.kind is int else "")
        rows.append(f"| `{n.name}` | {where} | {n.about} | {unit} | {n.range_text()} | "
                    f"{default} |")
    return "\n".join(rows)
