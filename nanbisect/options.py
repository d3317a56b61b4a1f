"""The options of a run, parsed once: `RunOptions`, a frozen record of typed values (devices as
`DeviceSpec`, ranks as a tuple of ints, counts as ints, ``out`` as a `Path`), and
`RunOptions.parse`, the one place where what a user gave (``nanbisect.run``'s keywords, the
command line's flags) becomes one.

    >>> o = RunOptions.parse(reference="cuda:1:float64", ranks="3, 1", steps=2)
    >>> o.reference, o.ranks, o.steps, o.target
    (DeviceSpec(device='cuda:1', dtype='float64'), (1, 3), 2, None)

Guarantees: `RunOptions.parse` refuses the first value that cannot be used with the one-line
`BadInput` the command prints after ``nanbisect: error:`` (the option's form: a device string,
an entry, ``--inject``, ``--code``, ``--ranks``; a count within its range, named as the library
keyword: ``steps=0``); imports no torch (the command line calls it before torch is imported);
a device string is parsed here (or by `device_option`, for a command's own device flag) and
nowhere after: the stages downstream take `DeviceSpec` values.
Not checked here: what needs the bundle or torch (the bundle's directory and ``--out`` are the
API's, `nanbisect.api.run_options`; a device this machine lacks, ``--ranks`` beyond the world
size, ``--steps`` beyond the lookback: `nanbisect.pipeline.run_bundle`, once the bundle is read).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from nanbisect.errors import BadInput
from nanbisect.util.numbers import NUMBERS
from nanbisect.util.spec import NONE, DeviceSpec, check_ranks, split_entry
from nanbisect.util.user_paths import user_path

CODE_CHOICES = ("local", "bundle")   # ``code``: the files on disk, or the bundle's copies


@dataclass(frozen=True)
class RunOptions:
    """What a run was asked for, typed. Built by `parse` from user input; the pipeline trusts it
    (`nanbisect.pipeline.run_bundle` fills in the devices left to it: the target, the capture's
    device else the host; the reference, `nanbisect.devices.default_reference` of the target).

    A ``str`` given for ``target``/``reference`` (or ``ranks``) to the constructor itself is
    parsed as `parse` would (in-process callers and tests that spell a device as text)."""

    # the device to replay on (None: the capture's device, else the host)
    target: DeviceSpec | None = None
    # the reference side (None: `nanbisect.devices.default_reference`; ``DeviceSpec(None)``,
    # spelled ``none``: no reference)
    reference: DeviceSpec | None = None
    inject: str | None = None       # "FILE.py:FUNC": its context manager wraps the target's runs
    entry: str | None = None        # "pkg.mod:fn" or "path/file.py:fn": overrides the bundle's
    run_repro: bool = True
    ranks: tuple[int, ...] | None = None   # (multi-rank) replay only these, each alone; sorted
    steps: int | None = None      # --steps K: replay the last K recorded steps (lookback)
    # extra replays of the step the remedies may use (None: NANBISECT_REMEDY_BUDGET, else
    # nanbisect.remedies.DEFAULT_BUDGET; 0: --no-remedies)
    remedies: int | None = None
    # which copy of the user's code a replay imports: "local" (the files on disk), "bundle" (the
    # copies the bundle carries), None: the local ones when present and unchanged, else the
    # bundle's (`--code`)
    code: str | None = None
    # the entry file's module-level statements may run on import (`--run-top-level`; else an
    # entry whose top level acts at import is refused before it is imported)
    run_top_level: bool = False
    out: Path | None = None       # the report directory (None: BUNDLE/nanbisect-report)

    def __post_init__(self) -> None:
        for name in ("target", "reference"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, _spec(value, none_ok=name == "reference"))
        if isinstance(self.ranks, str):
            object.__setattr__(self, "ranks", tuple(check_ranks(self.ranks)))
        elif self.ranks is not None:      # built directly: the same sorted set of ranks
            object.__setattr__(self, "ranks", tuple(check_ranks(_ranks_text(self.ranks))))
        if self.steps is not None:        # built directly (the self-test, a script): in range
            NUMBERS["--steps"].check(self.steps, "run")

    @classmethod
    def parse(cls, *, target: str | DeviceSpec | None = None,
              reference: str | DeviceSpec | None = None, entry: str | None = None,
              inject: str | None = None, code: str | None = None,
              ranks: str | Iterable[int] | None = None, steps: int | None = None,
              remedies: int | bool | None = None, repro: bool = True,
              run_top_level: bool = False,
              out: str | os.PathLike[str] | None = None) -> "RunOptions":
        """The options of what a user gave (each keyword is ``nanbisect.run``'s, and the flag
        of the same name); `BadInput` for the first that cannot be used, in this order:
        ``steps``, ``remedies``, the devices, ``entry``, ``inject``, ``code``, ``ranks``.

        >>> RunOptions.parse(reference="none").reference.none
        True
        >>> RunOptions.parse(code="git")
        Traceback (most recent call last):
        ...
        nanbisect.errors.BadInput: --code 'git' is neither local nor bundle; pass local ...
        """
        for name, value, kinds in (("target", target, (str, DeviceSpec)),
                                   ("reference", reference, (str, DeviceSpec)),
                                   ("entry", entry, (str,)), ("inject", inject, (str,)),
                                   ("code", code, (str,))):
            if value is not None and not isinstance(value, kinds):
                what = "a device string (e.g. 'cpu', 'cuda:1') or a DeviceSpec" \
                    if DeviceSpec in kinds else "a str"
                raise BadInput(f"run: {name}={value!r} is not {what}; pass {what}, or None")
        if steps is not None:
            steps = NUMBERS["--steps"].check(steps, "run")
        budget = _budget(remedies)
        if ranks is not None and not isinstance(ranks, str):
            ranks = _ranks_text(ranks)
        t = target if target is None or isinstance(target, DeviceSpec) else _spec(target)
        r = reference if reference is None or isinstance(reference, DeviceSpec) else \
            _spec(reference, none_ok=True)
        if entry is not None:
            user_path(split_entry(entry)[0], "--entry's file")
        if inject is not None:
            where, sep, func = inject.rpartition(":")
            if not sep or not where or not func.isidentifier():
                raise BadInput(f"--inject '{inject}' is not of the form FILE.py:FUNC; name a "
                               "function that returns a context manager")
            user_path(where, "--inject's file")
        if code is not None and code not in CODE_CHOICES:
            raise BadInput(f"--code '{code}' is neither {' nor '.join(CODE_CHOICES)}; pass "
                           "local (the files on disk) or bundle (the bundle's copies), or "
                           "leave it out")
        rs = tuple(check_ranks(ranks)) if ranks is not None else None
        return cls(target=t, reference=r, inject=inject, entry=entry, run_repro=bool(repro),
                   ranks=rs, steps=steps, remedies=budget, code=code,
                   run_top_level=bool(run_top_level),
                   out=user_path(out, "--out") if out is not None else None)


def device_option(text: str) -> DeviceSpec:
    """A command's own device flag (``selftest --device``, ``triage --target``) as a value: its
    form checked without torch (`BadInput` as `RunOptions.parse` says it); ``none`` is not a
    device here.

    >>> device_option("cuda:1")
    DeviceSpec(device='cuda:1', dtype=None)
    """
    return _spec(text)


def _spec(text: str, none_ok: bool = False) -> DeviceSpec:
    """``text`` as a `DeviceSpec`. ``none`` means no device only where ``none_ok`` (the
    reference); elsewhere it is a device's name like any other word of the grammar, refused
    when resolved (`nanbisect.devices.resolve`: no torch device is called that)."""
    if text == NONE and not none_ok:
        return DeviceSpec(text)
    return DeviceSpec.parse(text)


def _budget(remedies: int | bool | None) -> int | None:
    """``remedies`` as `RunOptions.remedies`: None for the default budget, else a checked count
    (False: 0, as ``--no-remedies``)."""
    if remedies is None or remedies is True:
        return None
    if remedies is False:
        return 0
    return NUMBERS["--remedy-budget"].check(remedies, "run")


def _ranks_text(ranks: Iterable[int]) -> str:
    """``ranks`` given as a list, as ``--ranks`` spells it (``"0,2"``), checked as that is."""
    try:
        return ",".join(str(r) for r in ranks)
    except TypeError:
        raise BadInput(f"run: ranks={ranks!r} is not a list of ranks; pass e.g. [0, 2] or "
                       "\"0,2\"") from None
