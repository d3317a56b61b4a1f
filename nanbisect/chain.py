"""The one chain of passes every replay runs: the step's inputs checked (`Chain.bad_inputs`),
pass 1 (`Chain.first_pass`: the module probe, the random tape) -> the reference side
(`Chain.reference_side`, `Chain.reference`) -> the producing module call (from the first pass's
probe table) -> the op recording and provenance to the root op (pass 2) -> the root op's inputs
caught (pass 3, or folded into pass 2) -> the finisher (culprit, repro, op check) -> the
classification from one `Evidence` (`Chain.classify`) -> the remedies; for a finite step that
parts from its reference, the isolation of the first diverging op; for a failure that comes back
only compiled, torch's compiler bisection (`Chain.bisect_compiled`) and the culprit's module call
(`Chain.catch_call`). The single-process pipeline (`pipeline/analysis.py`, `pipeline/compiler_verdict.py`), a
rank in lockstep (`multirank/worker.py`) and a rank alone (`multirank/alone.py`) are thin
callers: they build a `Chain`, say how collectives are served, and turn what it found into their
record (who launches the replay, how its collectives are served and what is written is theirs).

How collectives are served (`Serving`) is the one thing that decides which passes may run:

- ``none``: one process. Every pass runs; pass 3 rides along pass 2 for a forward failure on
  the CPU (`AheadCatch`).
- ``served``: one rank alone, its collectives served from the capture's tape. It may replay its
  step as often as a pass likes (a forward recording scoped to the producing call, the
  cross-phase recording of a backward failure born in forward), but a remedy is judged only up
  to the end of its forward (the collectives after it carry the capture's failure).
- ``lockstep``: every rank replays together, so every rank must run the same passes the same
  number of times: no scoped recording, no cross-phase recording, no extra replay on one rank
  (no remedy), and the ranks agree (``agree``) on the culprit rank and its op between pass 2
  and pass 3.

Guarantees: the passes of every path are the methods below, so a pass added here reaches every
path (`tests/chain/test_chain.py` reads every module's AST and fails when a module other than
this one and the passes' own imports or calls a pass, or builds a `Chain` without a `Serving`
member). What runs after the verdict (repro, op check, remedies) is listed in ``errors`` when it
fails, never raised.

What crosses out of here: `Located` (frozen; in-process only: it carries the caught inputs'
tensors), the `ProbeTable` of pass 1 and its `CallStats` (frozen records of the replay stage,
in-process only), the `ReferenceSide` (a replayer: in-process only). A rank writes what it needs
of them into its `RankResult` (JSON) for the launcher.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.bundle import lookback
from nanbisect.bundle.lookback import BundleView
from nanbisect.bundle.manifest import Manifest
from nanbisect.compiler import bisect_compiled
from nanbisect.finish import Evidence, Finished, classify_culprit, finish
from nanbisect.locate.catch import AheadCatch, catch_inputs, catch_module_call
from nanbisect.locate.ops import record_ops
from nanbisect.locate.producers import backward_producer, first_bad_parameter, forward_producer
from nanbisect.locate.rows import RowTracer
from nanbisect.records import (BadValue, CallId, Caught, CompilerFinding, Culprit, ModuleCaught,
                               OpCheck, OpFinding, OpSite, Remedy, RowTrace, StageError,
                               StepOutcome)
from nanbisect.reference import kernels as registry
from nanbisect.reference.differential import (RandomTape, diverging_call, isolate_window,
                                              step_state)
from nanbisect.reference.side import ReferenceSide, model_dtype
from nanbisect.remedies import not_tried, try_remedies
from nanbisect.replay.probe import CallStats, ModuleProbe, ProbeTable, probing
from nanbisect.replay.replayer import Replayer, stacked

Progress = Callable[[str, str], None]
# what ``agree`` answers: (the site to catch, is it this process's culprit) once the processes
# agreed; None: nobody computed the failure, every rank received it through a collective
Agreed = "tuple[OpSite | None, bool] | None"


class Serving(str, Enum):
    """How the collectives of a replayed step are served."""

    NONE = "none"            # one process: no collectives
    LOCKSTEP = "lockstep"    # every rank replays together
    SERVED = "served"        # one rank alone, its collectives served from the tape

    @property
    def solo(self) -> bool:
        """May a pass replay this process's step on its own (another replay, a scoped one)?"""
        return self is not Serving.LOCKSTEP


def _plain(fn, what: str):
    return fn()


# what each path says when pass 1 and the reference's replay start (one process: to `progress`,
# with its target and reference; a rank: the stage its launcher names when it hangs)
_FIRST_PASS = {Serving.NONE: "pass 1/3: replaying the step on {on} with module statistics",
               Serving.LOCKSTEP: "replay pass 1/3: module statistics",
               Serving.SERVED: "replay pass 1/3: module statistics (collectives served as "
                               "recorded)"}
_REFERENCE_BUILD = {Serving.NONE: "replaying the step on the reference ({on})",
                    Serving.LOCKSTEP: "building the task on the reference",
                    Serving.SERVED: "building the task on the reference"}
_REFERENCE_RUN = {Serving.NONE: None, Serving.LOCKSTEP: "replay pass 1/3 on the reference",
                  Serving.SERVED: "replay pass 1/3 on the reference"}


@dataclass(frozen=True)
class Located:
    """What passes 2 and 3 found: the producing call and parameter, the root op (``finding``),
    its caught inputs and the batch rows its bad value depends on; ``through``: the failure came
    through a collective on every rank (nothing was caught)."""

    phase: str
    kind: str
    call: CallStats | None
    parameter: str | None
    finding: OpFinding | None
    caught: Caught | None = None
    traced: RowTrace | None = None
    micro_batch: int | None = None
    through: bool = False
    site: OpSite | None = None     # the op caught on this process (in lockstep: the culprit's)
    # NB: in-process only (``caught`` holds tensors): a rank writes its `RankResult` instead


@dataclass
class Chain:
    """The passes over one replayer's step. ``wrap``: what wraps every replay of the step (the
    injected kernel, served collectives); ``op_wrap``: what wraps a single op re-run alone (the
    op check: the injection only; default ``wrap``); ``guard(fn, what)``: how user code is run
    (the pipeline turns its failure into a one-line `BadInput`); ``errors``: what failed after
    the verdict; ``start_repro``: how the repro's one run is started (None: not run here).
    ``probe``: pass 1's module probe (a rank's ledger of collectives follows its tracker)."""

    rep: Replayer
    serving: Serving
    wrap: Callable[[], ContextManager] = nullcontext
    op_wrap: Callable[[], ContextManager] | None = None
    progress: Progress = lambda key, text: None
    guard: Callable = _plain
    errors: list[StageError] | None = None
    start_repro: Callable | None = None
    probe: ModuleProbe = field(init=False, repr=False)
    tape: RandomTape | None = field(init=False, default=None, repr=False)
    # the target's step as pass 1 left it, taken before the reference's task was built
    # (`reference_side` given pass 1's outcome); None: `reference` takes it
    target_state: Any = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.probe = ModuleProbe(self.rep.task.model)

    # -- before the step: its inputs, pass 1, the reference side ------------------------------

    def bad_inputs(self) -> list[BadValue]:
        """The step's non-finite inputs (batch, parameters, buffers, optimizer state) in its
        restored pre-step state, before any of it runs: a rank asks before the first
        collective, so that every rank can stop together (one process learns them from pass 1,
        whose outcome's phase is then ``input``)."""
        return self.rep.input_faults(self.rep.restore())

    def first_pass(self, on: str = "", reference: bool = False, watch=None
                   ) -> tuple[StepOutcome, ProbeTable]:
        """Pass 1: the step replayed from its pre-step state with the module probe (one small
        reduction per module call), inside ``wrap``; for a ``reference`` side its random tape
        keeps what its random ops drew (the reference's draw the same: `reference`);
        ``watch`` (a rank in lockstep: its ledger of collectives, a mode with a
        ``phase(name)`` context) wraps the step and each phase. ``on``: the target, as
        announced. (its outcome, the probe table)."""
        self.progress("module-pass", _FIRST_PASS[self.serving].format(on=on))
        self.tape = tape = RandomTape() if reference else None
        self.target_state = None
        probed = probing(self.probe)
        phase = probed if watch is None else (
            lambda name: stacked(probed(name), watch.phase(name)))
        # the injected context first: the tape (and the ledger), inside it, see what it returns
        modes = [m for m in (tape, watch) if m is not None]
        first = self.guard(lambda: self.rep.run(phase=phase, wrap=lambda: stacked(
            self.wrap(), *modes)), "replaying the step on the target")
        return first, self.probe.read()

    def reference_side(self, build: Callable[[], Replayer], on: str = "", served: tuple = (),
                       around: Callable[[], ContextManager] = nullcontext,
                       first: StepOutcome | None = None) -> ReferenceSide:
        """The reference side on the replayer ``build()`` makes (the reference kernels'
        plug-ins loaded first; a rank builds it before its first pass, as its task build may
        run collectives); ``served``/``around``: how its collectives are served
        (`ReferenceSide`). ``on``: the reference, as announced. Given pass 1's outcome
        (``first``), the target's step state is taken before ``build`` runs: a task factory
        that hands out shared objects cannot move it."""
        if first is not None:
            self.target_state = step_state(self.rep, first)
        registry.load_plugins()
        self.progress("reference", _REFERENCE_BUILD[self.serving].format(on=on))
        return ReferenceSide(self.guard(build, "building the task on the reference"),
                             served, around)

    def reference(self, side: ReferenceSide, first: StepOutcome) -> StepOutcome:
        """The reference's replay of the step pass 1 replayed (``first``, with ``reference``):
        its random ops draw what the target's drew; it is compared with the target's step as
        it stands now (taken before any later pass moves the parameters)."""
        tape = self.tape
        target_state = self.target_state if self.target_state is not None \
            else step_state(self.rep, first)
        said = _REFERENCE_RUN[self.serving]
        if said is not None:
            self.progress("reference", said)
        return self.guard(lambda: side.run(tape, target_state, model_dtype(self.rep)),
                          "replaying the step on the reference")

    # -- pass 2 and 3 ------------------------------------------------------------------------

    def producer(self, table: ProbeTable, first: StepOutcome, phase: str, kind: str
                 ) -> tuple[CallStats | None, str | None]:
        """The module call that produced ``phase``'s failure of ``kind`` from clean inputs
        (forward, backward) and the parameter it concerns (backward, optimizer), from the first
        pass's probe table and outcome. In lockstep ``phase`` is the culprit rank's: this rank's
        own step may have stayed finite (nothing to name then)."""
        if phase == "forward":
            return forward_producer(table, kind), None
        if phase == "backward":
            return backward_producer(table, kind)
        if phase == "optimizer" and first.bad:
            return None, first_bad_parameter(self.rep.task.model, [b.name for b in first.bad])
        return None, None

    def ahead(self, phase: str, kind: str) -> AheadCatch | None:
        """Pass 3 folded into pass 2 where it can be: a forward or backward failure replayed on
        a device whose flags the host reads for free (the CPU), in one process (a forward
        catch there ends its replay at the culprit: in lockstep or under torch.distributed it
        would not, and elsewhere the flags stay on the device), not pipelined (a stage's
        backward runs inside its step, where the catch's phases are not the recorder's)."""
        rep = self.rep
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if (phase not in ("forward", "backward") or self.serving is not Serving.NONE
                or distributed or not devices.entry(rep.device).host_reads_free
                or (phase == "backward" and rep.task.pipelined)):
            return None
        return AheadCatch(rep, RowTracer(None, kind) if rep.task.accumulate == 1 else None,
                          backward=phase == "backward")

    def record(self, phase: str, kind: str, call: CallStats | None,
               ahead: AheadCatch | None = None) -> OpFinding | None:
        """Pass 2: the failing phase's ops recorded and traced to the root op; scoped to the
        producing forward call and followed across phases only where this process may replay
        alone (`Serving.solo`)."""
        solo = self.serving.solo
        scope = call.call if phase == "forward" and call is not None and solo else None
        self.progress("op-recording", f"pass 2/3: recording the {phase} phase's ops")
        return self.guard(lambda: record_ops(self.rep, phase, kind, self.wrap, scope,
                                             cross_phase=solo, progress=self.progress,
                                             ahead=ahead),
                          "recording the step's ops")

    def catch(self, site: OpSite | None, finding: OpFinding | None, kind: str, mine: bool = True,
              ahead: AheadCatch | None = None) -> tuple[Caught | None, RowTrace | None]:
        """Pass 3: ``site``'s inputs and (this process's culprit, one-batch steps) the batch rows
        its bad value depends on; from ``ahead`` when pass 2 caught them on its way."""
        if site is None:
            return None, None
        if ahead is not None and finding is not None:
            got = ahead.caught(finding.site.op, finding.op_index)
            if got is not None:
                return got
        self.progress("input-catch", "pass 3/3: catching the culprit's inputs")
        tracer = (RowTracer(site, finding.born or kind) if mine and finding is not None
                  and self.rep.task.accumulate == 1
                  and not self.rep.task.pipelined else None)
        caught = self.guard(lambda: catch_inputs(self.rep, site, self.wrap, rows=tracer),
                            "catching the op's inputs")
        return caught, tracer.result() if tracer is not None else None

    def locate(self, first: StepOutcome, table: ProbeTable,
               agree: Callable[[OpFinding | None], Agreed] | None = None, *,
               failed: tuple[str, str] | None = None) -> Located:
        """Passes 2 and 3 for ``first``'s failure (``failed``: the phase and kind the ranks
        agreed on, in lockstep the culprit rank's). ``agree(finding)``: between them, what the
        processes of the job settled on (lockstep: the culprit rank's op, caught on every rank;
        a rank alone: None when its root is a collective it was served)."""
        phase, kind = failed or (first.phase, first.kind or "nan")
        call, parameter = self.producer(table, first, phase, kind)
        ahead = self.ahead(phase, kind)
        finding = self.record(phase, kind, call, ahead)
        if finding is not None and finding.module_call is not None:
            call = table.get(CallId(finding.module, finding.module_call)) or call
        site, mine = (finding.site if finding is not None else None), True
        if agree is not None:
            agreed = agree(finding)
            if agreed is None:
                return Located(phase, kind, call, parameter, finding, through=True,
                               micro_batch=first.micro_batch)
            site, mine = agreed
        caught, traced = self.catch(site, finding, kind, mine, ahead)
        return Located(phase, kind, call, parameter, finding, caught, traced,
                       first.micro_batch, site=site)

    # -- after the verdict -------------------------------------------------------------------

    def finish(self, loc: Located, repro_dir: Path, target: str, *, rank: int = 0,
               check_on: torch.device | None = None) -> tuple[Finished, Culprit]:
        """The finisher on what `locate` found; the culprit with its batch rows."""
        done = finish(self.rep, loc.phase, loc.kind, finding=loc.finding, caught=loc.caught,
                      call=loc.call, parameter=loc.parameter, micro_batch=loc.micro_batch,
                      rank=rank, check_on=check_on, wrap=self.op_wrap or self.wrap,
                      repro_dir=repro_dir, target=target, start_repro=self.start_repro,
                      progress=self.progress, errors=self.errors)
        return done, replace(done.culprit,
                             samples=loc.traced.samples if loc.traced is not None else None)

    def remedies(self, culprit: Culprit, finding: OpFinding | None, traced: RowTrace | None,
                 budget: int, failed: str | None = None, kernel_on: tuple | None = None
                 ) -> list[Remedy]:
        """The remedies tried on the culprit's step within ``budget`` replays. In lockstep none
        is tried (the other ranks' collectives would wait): each is listed as skipped. A rank
        alone is judged on its forward (the collectives after it are served with the capture's
        failure), so only the remedies of a step that failed in forward (``failed``: the
        failing phase; a culprit born in forward may have failed in backward) are tried. One
        process: the bundle's lookback gives the state remedy its earlier batch (a step of
        ``--steps`` has none). ``kernel_on``: the reference (device, dtype) when the culprit op
        is wrong on the target given the same inputs (`try_remedies`)."""
        if budget <= 0:
            return []
        if self.serving is Serving.LOCKSTEP:
            return not_tried(culprit, "a rank replayed in lockstep cannot replay its step again "
                                      "without every other rank; replay this rank alone "
                                      f"(--ranks {culprit.rank}) to try them")
        if self.serving is Serving.SERVED:
            if (failed or culprit.phase) != "forward" or culprit.surfaced is not None:
                return not_tried(culprit, "on a rank replayed alone the collectives after its "
                                          "forward are served as the capture recorded them (the "
                                          "failure included), so only a forward culprit's step "
                                          "can be judged")
            judged = {"judged_on": "this rank's forward; its collectives served as recorded"}
            return [replace(r, detail={**r.detail, **judged}) if r.outcome != "skipped" else r
                    for r in try_remedies(self.rep, culprit, finding, budget=budget,
                                          trace=traced, wrap=self.wrap, judge="forward",
                                          progress=self.progress, kernel_on=kernel_on)]
        bundle, window = self.rep.bundle, None
        if Manifest.of(bundle).lookback is not None and not isinstance(bundle, BundleView):
            window = lookback.parse(bundle, f"bundle '{bundle.path}'")
        return try_remedies(self.rep, culprit, finding, budget=budget, trace=traced,
                            window=window, wrap=self.wrap, progress=self.progress,
                            kernel_on=kernel_on)

    def classify(self, side: ReferenceSide | None, op_check: OpCheck | None,
                 replay_mismatch: bool = False) -> tuple[str, list[str]]:
        """(classification, notes) of a culprit from the one `Evidence` every path builds:
        what the reference's own step showed (none; failed or finite; ``served`` for a rank
        alone, whose reference was served the capture's collectives, non-finite ones
        included), its dtype, the target's, the op check and whether the replay computes the
        captured step (`classify_culprit`)."""
        if side is None:
            return classify_culprit(Evidence("none", None, torch.float32, op_check,
                                             replay_mismatch))
        said = ("served" if self.serving is Serving.SERVED else
                "failed" if side.failed else "finite")
        return classify_culprit(Evidence(said, side.dtype, model_dtype(self.rep), op_check,
                                         replay_mismatch))

    def catch_module_call(self, culprit: Culprit) -> ModuleCaught | None:
        """The culprit's whole module call caught with the module's state (the module repro,
        when the op alone does not reproduce): one more replay of this process alone."""
        return self.catch_call(CallId(culprit.module, culprit.module_call),
                               backward=culprit.phase == "backward")

    def catch_call(self, call: CallId, backward: bool = False) -> ModuleCaught | None:
        """Module call ``call`` caught with the module's state (with ``backward``, the
        gradients arriving at its outputs too); None in lockstep (one more replay of this
        process alone)."""
        if not self.serving.solo:
            return None
        return self.guard(lambda: catch_module_call(self.rep, call, self.wrap,
                                                    backward=backward),
                          "catching the culprit's module call")

    # -- a failure that comes back only compiled ----------------------------------------------

    def bisect_compiled(self, target: str, entry: str | None, *, compiled: str,
                        phase: str | None, backend: str) -> CompilerFinding:
        """torch's compiler bisection of this step (eager finite, ``compiled`` not) in a child
        of its own (`nanbisect.compiler.bisect_compiled`), its progress shown."""
        self.progress("compiler-bisect",
                      "bisecting the compiled step with torch's CompilerBisector")
        return bisect_compiled(self.rep.bundle.path, entry, target, eager="finite",
                               compiled=compiled, phase=phase, backend=backend,
                               progress=self.progress, run_top_level=self.rep.run_top_level)

    def catch_surfaced(self, finding: OpFinding) -> Caught | None:
        """The op where a failure born earlier surfaced, caught (its own repro)."""
        if finding.surfaced_site is None or not self.serving.solo:
            return None
        self.progress("surfaced-repro", "catching the op where the failure surfaced")
        return self.guard(lambda: catch_inputs(self.rep, finding.surfaced_site, self.wrap),
                          "catching the op where the failure surfaced")

    # -- a finite step that parts from its reference ------------------------------------------

    def isolate(self, phase: str, table: ProbeTable, reference_table: ProbeTable,
                reference_device: torch.device, target_dtype: torch.dtype):
        """The first diverging module call (forward, backward) and its ops isolated on the
        reference: (call, finding, op check, how many ops were checked, the uncomparable)."""
        call = None
        if phase in ("forward", "backward"):
            call = diverging_call(table, reference_table, phase, target_dtype)
        finding, check, checked, uncomparable = self.guard(
            lambda: isolate_window(self.rep, phase, call.call if call is not None else None,
                                   reference_device, self.wrap),
            "isolating the target's ops on the reference")
        return call, finding, check, checked, uncomparable

    def catch_diverging(self, site: OpSite | None) -> Caught | None:
        """Pass 3 of a divergence: the diverging op's inputs."""
        if site is None:
            return None
        self.progress("input-catch", "catching the diverging op's inputs")
        return self.guard(lambda: catch_inputs(self.rep, site, self.wrap),
                          "catching the op's inputs")

    def finish_divergence(self, phase: str, finding: OpFinding | None, caught: Caught | None,
                          call: CallStats | None, check: OpCheck | None, repro_dir: Path,
                          target: str, rank: int = 0) -> Finished:
        return finish(self.rep, phase, "mismatch", finding=finding, caught=caught, call=call,
                      rank=rank, op_check=check, repro_dir=repro_dir, target=target,
                      start_repro=self.start_repro, progress=self.progress, errors=self.errors)
