"""A compiled capture (manifest ``task.compiled``): the step replayed compiled, and the verdict
when the failure comes back compiled and not eagerly (classification ``compiler``).

The compiled replay runs once per run of such a bundle, from the same state, batch and RNG as
the eager one; its loss is the one compared with the captured loss (the capture ran compiled).
Eager and compiled failing alike is an ordinary culprit (found eagerly); eager failing and
compiled not is said in a note (the eager culprit stands); compiled failing alone is
`compiler_report`: torch's compiler bisection in a child (`nanbisect.compiler`, started through
the run's chain: `Chain.bisect_compiled`), the op it names attributed to a module call, and a repro
that compiles that call (its module call caught through the chain: `Chain.catch_call`).
"""
from __future__ import annotations

from pathlib import Path

from nanbisect.bundle.manifest import Manifest
from nanbisect.compiler import repro_compile_args, run_repro_forked
from nanbisect.pipeline.common import StepRun, after_verdict
from nanbisect.records import CallId, CompilerFinding, Culprit, ModuleRepro, StepOutcome
from nanbisect.replay.replayer import Replayer
from nanbisect.report.model import Report
from nanbisect.report.repro import device_of, write_module_repro
from nanbisect.util.compiled import debug_output
from nanbisect.util.text import show


def kind_of(outcome: StepOutcome) -> str:
    """"finite", "nan" or "inf": what a replay of the step gave."""
    if outcome.phase is None:
        return "finite"
    return "nan" if any(b.nan for b in outcome.bad) else "inf"


def backend_of(rep: Replayer) -> str:
    return (rep.compiled_spec or {}).get("backend") or "inductor"


def dropped_note(rep: Replayer) -> list[str]:
    """A note naming the options the capture compiled with and the bundle did not record (not
    ones nanbisect replays: manifest ``task.compiled_dropped``), at most 5 of them shown."""
    names = Manifest.of(rep.bundle).task.get("compiled_dropped") or []
    if not names:
        return []
    shown = ", ".join(show(n, 60) for n in names[:5])
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return [f"the capture compiled with inductor options nanbisect does not replay ({shown}"
            f"{more}): the compiled replay runs without them (docs/guide/compiled.md lists "
            "those it replays)"]


def replay_compiled(rep: Replayer, wrap, notes: list[str]) -> StepOutcome | None:
    """The step once compiled as captured, then eager again for the passes that follow; None
    (and a note) when it cannot be compiled here (the eager step ran, so the compiler failed:
    no C++ compiler for inductor, a backend this torch lacks). torch's compile debug output
    goes to a private directory, removed after (`debug_output`)."""
    notes += dropped_note(rep)
    try:
        with debug_output():
            rep.compile()
            return rep.run(wrap=wrap)
    except Exception as e:  # noqa: BLE001 - the compiler's failure is a finding, not a crash
        first = (str(e).strip().splitlines() or [""])[0][:200]
        notes.append(f"the step could not be replayed compiled ({backend_of(rep)}): "
                     f"{type(e).__name__}: {first}; the verdict is the eager replay's (the "
                     "CPU inductor backend needs a C++ compiler: scripts/setup.sh installs g++)")
        return None
    finally:
        rep.eager()


def opposite_note(backend: str) -> str:
    return (f"the step compiled ({backend}) from the same state, batch and RNG stays finite: "
            "eager makes this failure and the compiled model does not (a kernel or rounding "
            "the compiler replaces); the eager culprit below stands")


def compiler_report(run: StepRun, compiled: StepOutcome, tmp: Path) -> Report:
    """The report of a failure that comes back compiled and not eagerly."""
    rep = run.rep
    backend = backend_of(rep)
    kind = kind_of(compiled)
    f = run.chain.bisect_compiled(run.facts.target, run.opts.entry, compiled=kind,
                                  phase=compiled.phase, backend=backend)
    notes = [f"the failure comes back with the model compiled ({backend}) and not eagerly, "
             "from the same state, batch and RNG: the compiler's transformation made it, "
             "not the hardware", *_finding_notes(f), *run.notes]
    culprit = Culprit.of_call(compiled.phase or "forward", CallId(f.module or "", f.module_call),
                              op=f.op, micro_batch=compiled.micro_batch)
    module_repro = None
    if f.module is not None:
        culprit, module_repro = after_verdict(
            run.errors, "module-repro",
            lambda: _compiled_repro(run, f, culprit, kind, tmp), (culprit, None))
    return Report("culprit", "compiler", compiled.phase, kind, culprit, run.facts,
                  notes=notes, repro=module_repro.script if module_repro else None,
                  repro_result=module_repro.result if module_repro else None,
                  module_repro=module_repro, compiler=f)


def _compiled_repro(run: StepRun, f: CompilerFinding, culprit: Culprit, kind: str, tmp: Path
                    ) -> tuple[Culprit, ModuleRepro | None]:
    """The repro of a compiled culprit: its module call, compiled, from its caught inputs
    (and the culprit with those inputs' dtypes and shapes)."""
    rep = run.rep
    run.progress("module-repro", "writing the repro: the culprit's module call compiled")
    mc = run.chain.catch_call(CallId(f.module, f.module_call))
    if mc is None:
        return culprit, None
    tensors = [t for t in mc.args if hasattr(t, "dtype")]
    culprit = Culprit.of_tensors(culprit.phase, CallId(culprit.module, culprit.module_call),
                                 tensors, op=f.op, micro_batch=culprit.micro_batch)
    script = write_module_repro(
        tmp / "repro", mc, culprit=culprit.in_phase("forward"),
        kind=kind, target=run.facts.target, entry=rep.entry,
        compile=repro_compile_args(rep.compiled_spec, f.backend))
    result = None
    if run.opts.run_repro:
        run.progress("repro", "running the repro once")
        result = run_repro_forked(script, device_of(run.facts.target))
    return culprit, ModuleRepro("repro/module_repro.py", result)


def _finding_notes(f: CompilerFinding) -> list[str]:
    """What the bisection said, in words."""
    if not f.finished:
        return [f"torch's compiler bisection did not name the part: {f.detail}"]
    if f.subsystem is None:
        return [f"torch's compiler bisection: the first backend that fails is {f.backend}"
                + ("" if f.detail is None else f" ({f.detail})")]
    what = (f"the config change {f.config_change} fixes it" if f.config_change else
            f"subsystem {f.subsystem}, application {f.bisect_number}: {f.detail}")
    where = (f"; {f.op} runs in module '{f.module}' (call {f.module_call}), whose call fails "
             "compiled alone" if f.module is not None else
             f"; {f.op} could not be placed in a module call" if f.op else "")
    took = f" ({f.seconds:.0f} s)" if f.seconds is not None else ""
    return [f"torch's compiler bisection{took}: backend {f.backend}, {what}{where}"]
