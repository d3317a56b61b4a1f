"""The Python API: `run` and `triage`, what ``nanbisect run`` and ``nanbisect triage`` do up to
the point where they print, for notebooks and scripts (docs/guide/python-api.md), exported as
``nanbisect.run`` and ``nanbisect.triage`` (the night itself is the `nanbisect.nightly` package,
which this module imports and which never imports it):

    import nanbisect
    report = nanbisect.run("step000123", reference="cpu")   # a Report
    report.culprit.op, [r.sentence() for r in report.remedies], report.to_json()

Guarantees:
- The commands' own code path: the same checks of every option, made by the same functions
  (`run_options`, which parses a run's options once into a `nanbisect.options.RunOptions`, and
  `check_triage`: the command line's first stage calls them too), so a bad value is refused
  with the one-line message the command prints after ``nanbisect: error:``; the same
  defaults (the report in ``BUNDLE/nanbisect-report``, triage's files in ``nanbisect-triage``
  under the current directory); the same pipeline (`start` and `replay`, then
  `nanbisect.pipeline.run_bundle`; `nanbisect.nightly.triage`), so the report directory and
  ``report.json`` are the command's.
  Numbers are the one exception in wording: a keyword is named as given (``steps=0``, not
  ``--steps '0'``), with the same range (`nanbisect.util.numbers`).
- What the caller gives that cannot be used raises `nanbisect.BadInput` (or a subclass), one
  line naming the problem and the fix (a value of the wrong type included: ``reference=5``,
  ``entry=object()``; an empty or over-long path); never `SystemExit` (a ``sys.exit`` or an
  argparse exit in the entry's code becomes a `BadInput` too) and never an exception of the
  command line's.
  nanbisect prints nothing (the task's own code may): progress goes to ``progress`` only, and a
  torch older than the one nanbisect is checked on is a `TorchTooOld` warning.
- A Ctrl-C during a run interrupts it, but never in the middle of an import
  (`nanbisect.proc.imports_whole`): the next `run` in the same interpreter works. Runs called
  from several threads at once replay one at a time (a replay sets torch's global RNG state
  and hooks every module call); ``sys.argv`` is what it was once they are done.
- Importing this module, and so ``nanbisect.run`` and ``nanbisect.api.triage``, imports no torch;
  a call does.

Not guaranteed: an exception of `run` that is not a `BadInput` is a bug of nanbisect's (the
command's exit 4) and is raised as it is; `triage` turns one into a `BadInput`, as the command
does, with the original as its ``__cause__``.
"""
from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, Union

from nanbisect.bundle.where import check_bundle_dir
from nanbisect.errors import BadInput
from nanbisect.options import RunOptions, device_option
from nanbisect.nightly.backends import check_backend
from nanbisect.util.numbers import NUMBERS, check_environment
from nanbisect.util.spec import DeviceSpec
from nanbisect.util.user_paths import user_path

if TYPE_CHECKING:       # the types only: importing them loads torch
    from nanbisect.report.model import Report

PathLike = Union[str, "os.PathLike[str]"]
Progress = Callable[[str, str], None]       # run: (a key of `nanbisect.pipeline.STAGES`, text)
TriageProgress = Callable[[int, int], None]  # triage: (bundles done, bundles found)

TRIAGE_OUT = Path("nanbisect-triage")   # `triage`'s ``out`` when none is given
TRIAGE_TIMEOUT = 1800.0                 # `triage`'s ``timeout`` when none is given


class TorchTooOld(UserWarning):
    """The installed torch is older than the one nanbisect is checked on (`run` warns)."""


# -- the checks: the command line's first stage calls these --------------------------------------

def run_options(bundle: PathLike, *, target: str | DeviceSpec | None = None,
                reference: str | DeviceSpec | None = None, entry: str | None = None,
                inject: str | None = None, code: str | None = None,
                ranks: str | Iterable[int] | None = None, steps: int | None = None,
                remedies: int | bool | None = None, repro: bool = True,
                run_top_level: bool = False, out: PathLike | None = None) -> RunOptions:
    """The `RunOptions` of a run of ``bundle`` (`RunOptions.parse`: each keyword is `run`'s);
    `BadInput` for the first option that cannot be used, checked without importing torch or
    reading more of the bundle than its directory: the bundle's path, then the options' forms
    (`RunOptions.parse`), then ``out`` (what needs the bundle's contents, as a device this
    machine lacks, is checked by `nanbisect.pipeline.run_bundle`, before it writes anything).

    >>> run_options("fixtures/bundles/forward_nan_behind_mask", reference="cpu:float64").reference
    DeviceSpec(device='cpu', dtype='float64')
    >>> run_options("fixtures/bundles/forward_nan_behind_mask", reference="gpu9")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: device 'gpu9' is not a torch device string; use e.g. cpu, cuda, ...
    """
    check_bundle_dir(bundle)
    options = RunOptions.parse(target=target, reference=reference, entry=entry, inject=inject,
                               code=code, ranks=ranks, steps=steps, remedies=remedies,
                               repro=repro, run_top_level=run_top_level, out=out)
    if options.out is not None:  # the default, BUNDLE/nanbisect-report, is checked by the pipeline
        from nanbisect.report.out import check_out    # (hashlib, json: only when needed)

        check_out(options.out, Path(bundle))
    return options


def check_triage(dirs: Sequence[PathLike], *, out: PathLike = TRIAGE_OUT,
                 known: PathLike | Iterable[str] | None = None, target: str | None = None,
                 backend: str = "loky", scheduler: str | None = None,
                 address: str | None = None, cache: PathLike | None = None) -> list[str]:
    """`BadInput` for the first option of a triage that cannot be used, checked without
    importing torch: the directories, ``out`` and ``cache``, ``known`` (a file that exists must
    be a regular one; the signatures given as values must be strings), the backend and its
    address, the target device. Returns the notes the night carries: a ``known`` file that
    does not exist yet (a first night: every signature is new).

    >>> check_triage(["fixtures/bundles"], out="nanbisect-triage", known="no/such.json")
    ["--known 'no/such.json' does not exist yet: every signature is new tonight"]
    """
    from nanbisect.nightly.find import check_outputs
    from nanbisect.nightly.known import check_known, given_known

    for d in map(Path, dirs):
        if not d.exists():
            raise BadInput(f"triage: '{d}' does not exist; pass directories holding bundles")
        if not d.is_dir():
            raise BadInput(f"triage: '{d}' is a file, not a directory; pass directories "
                           "holding bundles")
    check_outputs(Path(out), None if cache is None else Path(cache))
    known = given_known(known)
    note = check_known(known) if isinstance(known, Path) else None
    for value, name in ((backend, "backend"), (scheduler, "scheduler"), (address, "address"),
                        (target, "target")):
        if value is not None and not isinstance(value, str):
            raise BadInput(f"triage: {name}={value!r} is not a str; pass "
                           + ("loky, dask or ray" if name == "backend" else
                              "a device string such as cpu or cuda:1" if name == "target" else
                              "the cluster's address as a str, or None"))
    check_backend(backend, scheduler, address)
    if target is not None:
        device_option(target)
    return [note] if note else []


# -- run ---------------------------------------------------------------------------------------

def run(bundle: PathLike, *, target: str | DeviceSpec | None = None,
        reference: str | DeviceSpec | None = None, inject: str | None = None,
        entry: str | None = None, out: PathLike | None = None, steps: int | None = None,
        ranks: str | Iterable[int] | None = None, remedies: int | bool | None = None,
        repro: bool = True, code: str | None = None,
        run_top_level: bool = False, progress: Progress | None = None) -> "Report":
    """Replay ``bundle``, bisect its failure, write the report directory and return its
    `Report`: ``nanbisect run BUNDLE`` without the printing (each keyword is the flag of the same
    name; docs/reference/cli.md).

    ``target``, ``reference``: a device string (``"cuda:1"``, ``"cpu:float64"``; for the
    reference also ``"none"``) or a `nanbisect.util.spec.DeviceSpec`. ``out``: the report
    directory (default ``BUNDLE/nanbisect-report``; replaced only when it is new, empty or a
    report nanbisect wrote). ``ranks``: ``"0,2"`` or ``[0, 2]``. ``remedies``:
    None (or True) for the default budget of extra replays (``NANBISECT_REMEDY_BUDGET``, else
    4), a number for that budget, False or 0 for none (``--no-remedies``). ``repro``: run the
    standalone repro once (False: written, not run; quicker). ``code``: ``"local"`` or
    ``"bundle"`` (``--code``), ``run_top_level``: ``--run-top-level``. ``progress(key, text)``
    is told each pass as it starts (``key`` one of `nanbisect.pipeline.STAGES`).

    >>> import tempfile
    >>> report = run("fixtures/bundles/forward_nan_behind_mask", repro=False, remedies=False,
    ...              out=Path(tempfile.mkdtemp()) / "report")
    >>> report.culprit.op, report.culprit.phase, report.remedies
    ('aten.sqrt.default', 'forward', [])
    >>> report.to_json()["culprit"]["op"]
    'aten.sqrt.default'
    >>> run("fixtures/bundles/forward_nan_behind_mask", steps=0)
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: run: steps=0 is out of range: give an integer number of steps ...
    """
    path = _path(bundle, "bundle")
    out_dir = _path(out, "out") if out is not None else None
    if progress is not None and not callable(progress):
        raise BadInput(f"run: progress={progress!r} is not callable; pass a function of (key, "
                       "text), or None")
    # a bad NANBISECT_* number first (not one a given keyword overrides), as the command does
    given = remedies is not None and remedies is not True
    check_environment("run", {"--remedy-budget"} if given else set())
    options = run_options(path, target=target, reference=reference, entry=entry, inject=inject,
                          code=code, ranks=ranks, steps=steps, remedies=remedies, repro=repro,
                          run_top_level=run_top_level, out=out_dir)
    from nanbisect.proc import imports_whole

    start(path, options)
    # a Ctrl-C in the middle of `import torch` (the first run of a fresh interpreter) would
    # leave torch half-imported for every later run: held until that import is over
    with imports_whole(), _ONE_RUN:
        from nanbisect.util.torch_internals import check_torch_version

        if (too_old := check_torch_version()) is not None:
            warnings.warn(f"nanbisect.run: {too_old}", TorchTooOld, stacklevel=2)
        return replay(path, options, progress)


def start(bundle: Path, options: RunOptions) -> None:
    """What a run of ``options`` starts ahead, before this process imports torch: the
    interpreter its repro will run in (`nanbisect.report.rerun.prestart`; none when
    ``options.run_repro`` is off). `run` and ``nanbisect run`` call it once, right after
    `run_options`."""
    if options.run_repro:
        from nanbisect.report.rerun import prestart

        # a repro's interpreter imports torch while this one does
        prestart(bundle, None if options.target is None else str(options.target))


def replay(bundle: Path, options: RunOptions, progress: Progress | None = None) -> "Report":
    """The run of ``options`` (`run_options`'s, trusted) on ``bundle``: what `run` and
    ``nanbisect run`` both end in (`nanbisect.pipeline.run_bundle`, the report written to
    ``options.out``, else ``BUNDLE/nanbisect-report``); a ``SystemExit`` of the entry's code
    becomes a `BadInput`."""
    from nanbisect.pipeline import run_bundle

    pid = os.getpid()
    try:
        return run_bundle(bundle, options, options.out, progress or _silent)
    except SystemExit as e:
        if os.getpid() != pid:      # a forked child unwinding: it is not this call's to answer
            raise
        raise BadInput(f"run: the entry's code exited (SystemExit({e.code!r})) during the "
                       "replay, as sys.exit() or a failed argparse parse_args() does; the "
                       "task's code (make_task, the model, loss_fn) must return, not exit"
                       ) from None


# one replay at a time in a process: a replay sets torch's global RNG state, hooks every module
# call and restores the state in place, so two on two threads would replay each other's
_ONE_RUN = threading.RLock()


def _silent(key: str, text: str) -> None:
    """The ``progress`` of a call that gave none."""


def _path(value: object, what: str) -> Path:
    return user_path(value, f"{what}=")


def _is_path(value: object) -> bool:
    return isinstance(value, (str, os.PathLike))


# -- triage ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Group:
    """The bundles of one culprit signature (a row of triage.md's table): ``remedies`` made a
    step of this kind finite, ``tried`` did not; ``example`` is the first bundle seen."""

    signature: str
    count: int
    known: bool
    classification: str | None
    bundles: tuple[str, ...]
    example: str
    first_seen: str | None
    new_since_last: bool | None
    remedies: tuple[str, ...]
    tried: tuple[str, ...]

    @staticmethod
    def from_json(g: dict) -> "Group":
        """A group of triage.json's ``signatures``."""
        return Group(g["signature"], g["count"], bool(g.get("known")), g.get("classification"),
                     tuple(g.get("bundles") or ()), g.get("example") or "",
                     g.get("first_seen"), g.get("new_since_last"),
                     tuple(g.get("remedies") or ()), tuple(g.get("tried") or ()))


@dataclass(frozen=True)
class TriageReport:
    """What `triage` found: the groups by signature (most bundles first), each bundle's
    `Report` (keyed by the bundle's path as ``data["bundles"]`` names it, read from the report
    directory triage kept under ``out/reports`` when first asked for; a bundle that became an
    error row has none), the error rows, the exit code ``nanbisect triage`` exits with, the
    ``out`` directory, and ``data``, triage.json's content (`to_json`)."""

    groups: tuple[Group, ...]
    reports: Mapping[str, "Report"] = field(repr=False)
    errors: tuple[dict, ...]
    exit_code: int
    out: Path
    data: dict = field(repr=False)

    def to_json(self) -> dict:
        """triage.json's content (``nanbisect triage --json`` prints it)."""
        return self.data


def triage(dirs: PathLike | Sequence[PathLike], *, out: PathLike = TRIAGE_OUT,
           jobs: int | None = None, known: PathLike | Iterable[str] | None = None,
           target: str | None = None, timeout: float = TRIAGE_TIMEOUT, backend: str = "loky",
           scheduler: str | None = None, address: str | None = None,
           progress: TriageProgress | None = None,
           cache: PathLike | None = None) -> TriageReport:
    """Replay every bundle under ``dirs`` (one directory or several) in parallel, group the
    failures by culprit signature, write triage.json, triage.md, index.html and each bundle's
    report under ``out``: ``nanbisect triage DIRS`` without the printing (each keyword is the
    flag of the same name). ``known``: a previous triage.json or a file of signatures, one a
    line (as ``--known``; one that does not exist yet is none, with a note in
    ``data["notes"]``), or the signatures themselves (a list or set of strings). ``cache``:
    where the analyses are cached (default ``out/cache``; one directory that several ``out``
    share, as dated folders do). ``progress(done, total)`` is told the bundles finished of
    those found, after each.

    >>> import shutil, tempfile
    >>> night = Path(tempfile.mkdtemp())
    >>> _ = shutil.copytree("fixtures/bundles/forward_nan_behind_mask", night / "job1" / "step3",
    ...                     ignore=shutil.ignore_patterns("nanbisect-report"))
    >>> found = triage(night, out=night / "triage", jobs=1)
    >>> [(g.count, g.known) for g in found.groups], found.exit_code
    ([(1, False)], 3)
    >>> [r.culprit.op for r in found.reports.values()]
    ['aten.sqrt.default']
    >>> triage(123)
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: triage: dirs=123 is neither a directory nor a list of them; ...
    """
    if _is_path(dirs):
        roots = [_path(dirs, "dirs")]
    elif isinstance(dirs, (bytes, Mapping)) or not isinstance(dirs, Iterable):
        raise BadInput(f"triage: dirs={repr(dirs)[:80]} is neither a directory nor a list of "
                       "them; pass a path (str or pathlib.Path) or a list of paths")
    else:
        roots = [_path(d, "dirs") for d in dirs]
    out = _path(out, "out")
    cache = None if cache is None else _path(cache, "cache")
    timeout = NUMBERS["--timeout"].check(timeout, "triage")
    if jobs is not None:
        jobs = NUMBERS["--jobs"].check(jobs, "triage")
    if progress is not None and not callable(progress):
        raise BadInput(f"triage: progress={progress!r} is not callable; pass a function of "
                       "(done, total), or None")
    check_environment("triage")
    notes = check_triage(roots, out=out, known=known, target=target, backend=backend,
                         scheduler=scheduler, address=address, cache=cache)
    from nanbisect.nightly import load_known
    from nanbisect.nightly import triage as run_triage
    from nanbisect.nightly.known import given_known

    kw = {"progress": progress} if progress is not None else {}
    known = given_known(known)
    try:
        known_set = load_known(known) if isinstance(known, Path) else set(known or ())
        res = run_triage(roots, out=out, jobs=jobs, known=known_set, timeout=timeout,
                         backend=backend, scheduler=scheduler, address=address,
                         options={"target": target} if target else None, cache=cache,
                         notes=notes, **kw)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - as the command: one line (the cause kept here)
        raise BadInput(f"triage failed: {type(e).__name__}: {str(e)[:200]}; "
                       f"{out}/triage.json holds the bundles finished so far") from e
    return _triage_report(res.data, res.exit_code, out)


def _triage_report(data: dict, exit_code: int, out: Path) -> TriageReport:
    """The `TriageReport` of a night's summary (its reports read when first asked for)."""
    kept = {row["bundle"]: out / row["report_dir"] / "report.json"
            for row in data.get("bundles") or [] if row.get("report_dir")}
    return TriageReport(tuple(Group.from_json(g) for g in data.get("signatures") or []),
                        _Reports(kept), tuple(data.get("errors") or ()), exit_code, out, data)


class _Reports(Mapping):
    """Each bundle's `Report`, read from its kept report.json when first asked for (a night of
    thousands of bundles pays nothing for the reports nobody reads); one that can no longer be
    read is a `BadInput` naming it."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files, self._read = files, {}

    def __getitem__(self, bundle: str) -> "Report":
        if bundle not in self._read:
            import json

            from nanbisect.report.model import Report

            path = self._files[bundle]
            try:
                self._read[bundle] = Report.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise BadInput(f"triage: the report of '{bundle}' cannot be read from {path} "
                               f"({type(e).__name__}: {str(e)[:200]}); run triage again"
                               ) from None
        return self._read[bundle]

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __repr__(self) -> str:
        return f"<reports of {len(self)} bundle(s)>"
