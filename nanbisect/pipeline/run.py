"""`run_bundle`: read and check the bundle, pick the target, hand a multi-rank bundle to the
launcher, run one step (or a window of steps), time the passes and write the report.

Every run that reaches a verdict ends with a report: a stage after the verdict that raises
(the repro, the op check, the remedies, the module and surfaced repros, the classification,
the context tables, the history, the plots and pages) is listed in the report's ``errors``
(`nanbisect.records.after_verdict`), the rest is written, and the exit code stays the
verdict's.
"""
from __future__ import annotations

import warnings

import time
from dataclasses import replace
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle import lookback
from nanbisect.bundle.format import Bundle, read_bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.errors import BadInput, TopLevelOptIn
from nanbisect.pipeline.common import CULPRIT, Progress, RunOptions, after_verdict
from nanbisect.pipeline.analysis import analyse
from nanbisect.records import Finding
from nanbisect.remedies import budget as remedy_budget
from nanbisect.util.numbers import check_environment
from nanbisect.replay.replayer import Replayer, code_choice, resolve_entry, top_level_recorded
from nanbisect.report.model import Report
from nanbisect.report.write import DEFAULT_NAME, check_out, staged, write_report
from nanbisect.task import check_entry, kept_path, load_inject
from nanbisect.util.dynamo import defer_dynamo
from nanbisect.util.spec import DeviceSpec
from nanbisect.util.text import ranks_arg, ranks_text, show


# What `run_bundle` tells its ``progress(key, text)`` callback, in the order it can happen.
# Each key starts a pass, except `CULPRIT`: the moment the culprit is known (a one-process run,
# before its remedies and the report), its text the report's headline and source line.
STAGES = ("steps", "build", "module-pass", "compiled", "reference", "op-recording",
          "cross-phase", "isolate", "input-catch", "compiler-bisect", "repro", "module-repro",
          "op-check", CULPRIT, "remedies", "surfaced-repro", "report", "ranks")


def _default_target(bundle: Bundle) -> DeviceSpec:
    """The target without ``--target``: the capture's device when this machine has it, else
    the host."""
    return devices.present(Manifest.of(bundle).captured_on) or DeviceSpec(devices.HOST.type)


class _Clock:
    """The progress callback's wrapper that times the passes: each from its announcement to the
    next; "read" is what came before the first (reading and checking the bundle). `CULPRIT` is
    a moment, not a pass: passed on, not timed."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.marks: list[tuple[str, float]] = [("read", time.perf_counter())]

    def __call__(self, key: str, text: str) -> None:
        if key != CULPRIT:
            self.marks.append((key, time.perf_counter()))
        self.progress(key, text)

    def seconds(self) -> dict[str, float]:
        now, out = time.perf_counter(), {}
        for (key, t), nxt in zip(self.marks, [m[1] for m in self.marks[1:]] + [now]):
            out[key] = round(out.get(key, 0.0) + nxt - t, 4)
        return out


def run_bundle(path: str | Path, opts: RunOptions = RunOptions(), out: Path | None = None,
               progress: Progress = lambda key, text: None) -> Report:
    """Replay a bundle, bisect its failure down to an op, write the report directory.

    ``opts`` are trusted (`nanbisect.options.RunOptions.parse` checked their forms); what needs
    the bundle is checked here, once, before anything is written: the target (``opts.target``,
    else the capture's device, else the host) and the reference (``opts.reference``, else
    `nanbisect.devices.default_reference` of the target) are filled in and resolved to torch
    devices, and every stage after this one gets them as values.

    ``out`` (else ``opts.out``) defaults to ``BUNDLE/nanbisect-report``; it is replaced
    atomically, and only when it is absent, empty or an earlier report (anything else is refused
    before the replay starts: `nanbisect.report.write.check_out`).

    >>> import tempfile
    >>> report = run_bundle("fixtures/bundles/forward_nan_behind_mask",
    ...                     RunOptions(run_repro=False), Path(tempfile.mkdtemp()) / "r")
    >>> report.culprit.op, report.culprit.module, report.culprit.module_call
    ('aten.sqrt.default', 'blocks.1.mlp.act', 2)
    """
    # the entry's directory and a stored copy's roots stay first on sys.path while the replays
    # run (the task may import at step time), and go when the run ends, also on error
    with kept_path():
        return _run_bundle_at(path, opts, out, progress)


def _run_bundle_at(path: str | Path, opts: RunOptions, out: Path | None,
                   progress: Progress) -> Report:
    """`run_bundle` inside its `kept_path`."""
    clock = _Clock(progress)
    # a bad NANBISECT_* number, before anything (not one a given option overrides)
    check_environment("run", {"--remedy-budget"} if opts.remedies is not None else set())
    opts = replace(opts, remedies=remedy_budget(opts.remedies))   # a bad budget: before anything
    # --ranks: verify only the parts replayed (a 1,000-rank bundle is not hashed whole for one)
    bundle = read_bundle(path, verify=opts.ranks is None)
    out = out if out is not None else opts.out
    out = check_out(out if out is not None else bundle.path / DEFAULT_NAME, bundle.path)
    # the devices: filled in and resolved here, once (a bad one fails before any replay)
    target = opts.target if opts.target is not None else _default_target(bundle)
    t_dev, t_dtype = devices.resolve(target)
    reference = opts.reference if opts.reference is not None else \
        devices.default_reference(t_dev)
    ref = None if reference.none else devices.resolve(reference)
    opts = replace(opts, target=target, reference=reference)
    source = _source(bundle)
    opts, code_note = _which_code(bundle, source, opts)
    _check_top_level(bundle, source, opts)     # before anything is replayed or written
    if not bundle.multi_rank:          # (a multi-rank part's says so from its rank)
        Replayer.check_batch(bundle)   # a batch the capture could not store: before the import
    if opts.ranks is not None and not bundle.multi_rank:
        raise BadInput(f"--ranks {ranks_arg(opts.ranks)}: bundle '{bundle.path}' has one rank; "
                       "drop --ranks")
    if opts.steps is not None and bundle.multi_rank:
        raise BadInput(f"--steps {opts.steps}: bundle '{bundle.path}' is multi-rank; replaying "
                       "several steps is for single-process bundles yet: drop --steps")
    if bundle.multi_rank:
        # NB: imported here, as `run_steps` below: a one-rank run does not load them
        from nanbisect.multirank.alone import check_tape
        from nanbisect.multirank.launcher import run_multirank, within_world

        subset = within_world(opts.ranks, bundle.world_size) if opts.ranks is not None else None
        _check_partial(bundle, subset)
        if subset is not None:
            check_tape(bundle, subset)     # verifies each replayed part, and what it references
        if opts.inject:
            load_inject(opts.inject)  # a bad --inject fails here, before any rank starts
        progress("ranks", (f"replaying {bundle.world_size} ranks" if subset is None else
                           f"replaying rank(s) {subset} of {bundle.world_size} alone")
                 + f" on {target}" + (f" and on {reference}" if not reference.none else ""))
        return run_multirank(bundle, opts, out, (t_dev, t_dtype), ranks=subset)
    threads = torch.get_num_threads()
    try:
        # an eager replay does not import torch._dynamo for torch's own disable-wrappers (the
        # task's optimizer, the passes' dispatch modes): `nanbisect.util.dynamo`
        with defer_dynamo():
            return _run_bundle(bundle, opts, out, clock, t_dev, t_dtype, ref, code_note)
    finally:
        torch.set_num_threads(threads)     # the capture's count was this run's only


def _check_partial(bundle: Bundle, subset: list[int] | None) -> None:
    """A partial bundle (ranks that could not write their parts at capture) replays only with
    ``--ranks`` naming ranks it holds: `BadInput` otherwise, naming the missing ranks and why."""
    missing = bundle.missing_ranks
    if not missing or (subset is not None and not set(subset) & set(missing)):
        return
    manifest = Manifest.of(bundle)
    present = ranks_arg(manifest.ranks)
    reasons = (manifest.partial or {}).get("reasons") or {}
    first = next((f"rank {r}: {show(reasons[str(r)], 200)}" for r in missing
                  if str(r) in reasons), None)
    why = f" ({first})" if first else ""
    named = missing if subset is None else sorted(set(subset) & set(missing))
    parts = "its part" if len(named) == 1 else "their parts"
    if subset is None:
        raise BadInput(f"bundle '{bundle.path}' is partial: {ranks_text(missing)} could not "
                       f"write {parts} when it was captured{why}; replay the ranks it holds "
                       f"alone with --ranks {present}")
    raise BadInput(f"bundle '{bundle.path}' is partial: --ranks names {ranks_text(named)}, "
                   f"which could not write {parts} when it was captured{why}; pass only ranks "
                   f"it holds (--ranks {present})")


def _source(bundle: Bundle) -> Bundle:
    """What the entry and the code are read from, once per run: the bundle, or a multi-rank
    bundle's lowest rank's part (read unverified: ``--ranks`` may leave it out; what of it is
    imported is verified where it is chosen, `_which_code`)."""
    if not bundle.multi_rank:
        return bundle
    return bundle.part(min(Manifest.of(bundle).ranks), verify=False)


def _check_top_level(bundle: Bundle, source: Bundle, opts: RunOptions) -> None:
    """`BadInput` (`nanbisect.task.gate`) when the entry the replays import (``source``'s: the
    bundle, or a multi-rank bundle's first part) does more than define at its top level and
    neither ``--run-top-level`` nor the captured Task allows it."""
    if opts.run_top_level:
        return
    if top_level_recorded(source.manifest):    # an opt-in that travels: said before it runs
        warnings.warn(TopLevelOptIn(
            f"bundle '{bundle.path}' opts in to running its entry's top level at import "
            f"(Task(run_top_level=True) in its manifest): {opts.entry or resolve_entry(source)} "
            "runs every module-level statement, as python would; read it first, or replay "
            "with --entry naming a file you trust"), stacklevel=3)
        return
    check_entry(opts.entry or resolve_entry(source), [source.path])


def _which_code(bundle: Bundle, source: Bundle, opts: RunOptions
                ) -> tuple[RunOptions, str | None]:
    """``opts`` with the entry every replay of this run imports (`code_choice`: the local files
    or the bundle's stored copies, ``--code``), and the note saying which and why; ``opts``
    as given for ``--entry`` and for a bundle that carries no copy of its code (unless
    ``--code`` asks). A multi-rank bundle's choice is made on its first part's code
    (``source``)."""
    if opts.entry is not None:
        if opts.code == "bundle":
            raise BadInput(f"--code bundle replays the bundle's own entry from its stored copy; "
                           f"drop --entry {opts.entry}, or drop --code bundle")
        return opts, None
    entry, note = code_choice(source, opts.code)
    if note is None:
        return opts, None
    from nanbisect.bundle import codestore    # NB: here, to leave this file's imports alone
    stored = source.path.resolve() / codestore.CODE_DIR
    if stored in Path(entry.rpartition(":")[0]).resolve().parents:
        # the stored copy is imported: verified, also where the bundle (``--ranks``) or the
        # part was read without verifying
        codestore.check(source.path, source.manifest, verify=True)
    return replace(opts, entry=entry), note


def _run_bundle(bundle: Bundle, opts: RunOptions, out: Path, progress: _Clock,
                t_dev: torch.device, t_dtype: torch.dtype | None,
                ref: tuple[torch.device, torch.dtype | None] | None,
                code_note: str | None = None) -> Report:
    """One process's bundle replayed: ``opts`` with its devices filled in, ``t_dev``/``t_dtype``
    the target's resolved, ``ref`` the reference's (None: no reference)."""
    target = str(opts.target)
    where = f"bundle '{bundle.path}'"
    history = hist.parse(Manifest.of(bundle).history, bundle.tensors(hist.ROLE), where)
    window = None
    if opts.steps is not None:
        window = lookback.parse(bundle, where)
        if window is None:
            raise BadInput(f"--steps {opts.steps}: {where} records only its failing step; capture "
                           "with Guard(..., lookback=K) to replay the steps before it, or drop "
                           "--steps")
    with staged(out, bundle.path) as tmp:
        if window is not None:
            from nanbisect.pipeline.steps import run_steps

            report, rep = run_steps(bundle, window, history, opts, progress, target, t_dev,
                                    t_dtype, ref, tmp)
        else:
            report, rep = analyse(bundle, opts, progress, target, t_dev, t_dtype, tmp, ref)
            if report.verdict == "input-nonfinite":
                from nanbisect.pipeline.steps import trace_back

                report, rep = trace_back(bundle, report, rep, opts, progress, target, t_dev,
                                         t_dtype, ref, tmp)
        if history is not None:
            def findings() -> list[Finding]:
                model = opt = None
                if rep is not None and rep.bundle is bundle:   # the failing step's pre-state
                    rep.restore()
                    model, opt = rep.task.model, rep.task.optimizer
                return [Finding(**f) for f in hist.findings(history, model, opt)]
            errors = list(report.errors)
            records = after_verdict(errors, "history", history.records, None)
            found = after_verdict(errors, "history", findings, []) if records is not None \
                else []
            report = replace(report, history=records, history_findings=found, errors=errors)
        if code_note is not None:
            report = replace(report, notes=[*report.notes, code_note])
        report = replace(report, timings=progress.seconds())
        progress("report", "writing the report")
        report = write_report(report, tmp)    # with the renderings that failed in `errors`
    return report


def warm_fork_server() -> None:
    """A fork server's warm-up (``warm=`` of `nanbisect.proc.ForkServer`) for the `nanbisect run`
    processes it will fork: this module (`nanbisect run`'s path) is imported, and the report
    page's template compiled: 0.5 s of CPU each forked replay would otherwise pay. Runs no
    torch op and starts no thread."""
    import nanbisect.report.page as page

    page.page_template()
