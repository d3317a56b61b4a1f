"""What the pipeline's modules share (the package's interface between them, listed in
`nanbisect.pipeline`): the options of a run (`nanbisect.options.RunOptions`,
re-exported), the state one step's analysis shares between the
verdict (`step`) and a compiled capture's (`compiled`): `StepRun`, with the errors of the stages
after the verdict (`after_verdict`); the guard that turns a failure of the user's code into a
one-line `BadInput` (`guarded`); the context of every run on the target (`target_wrap`).
"""
from __future__ import annotations

import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

from nanbisect.bundle.manifest import Manifest
from nanbisect.chain import Chain
from nanbisect.errors import BadInput
from nanbisect.options import RunOptions  # noqa: F401 (re-exported: nanbisect.pipeline's)
from nanbisect.reference import kernels as registry
from nanbisect.reference.differential import ReferenceKernels
from nanbisect.records import RunFacts, StageError, after_verdict  # noqa: F401 (re-exported)
from nanbisect.replay.probe import ProbeTable
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.report.rerun import Interpreter
from nanbisect.task import load_inject
from nanbisect.util.frames import failing_side
from nanbisect.util.text import raised_at

Progress = Callable[[str, str], None]
# the `progress` key that tells the moment a one-process run knows its culprit (not a pass)
CULPRIT = "culprit"


def captured_type(manifest: dict) -> str:
    """The type of the device the bundle was captured on (``"cuda"`` for ``"cuda:1"``), as a
    string: a device type this machine's torch does not know (``npu`` without torch_npu) is
    compared, never built into a `torch.device`.

    >>> captured_type({"devices": {"captured_on": "npu:3"}}), captured_type({})
    ('npu', 'cpu')
    """
    return Manifest.of(manifest).captured_type


def recorded_failure(observed) -> bool:
    """Does the manifest record a failure (not a spike a Guard captured while training went on)?"""
    return bool(observed) and not (isinstance(observed, dict) and observed.get("first") == "spike")


def guarded(fn, what: str):
    """Run user code; turn its exceptions into a one-line BadInput naming where it broke. A
    failure whose innermost frame (past torch) is nanbisect's own work is not the user's code
    failing (`frames.failing_side`): it propagates as it is (the CLI's internal error, exit 4,
    the traceback in a log), never "fix the entry"."""
    try:
        return fn()
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported, not re-raised
        tb = traceback.extract_tb(e.__traceback__)
        if failing_side([(f.filename, f.lineno) for f in tb]) == "nanbisect":
            raise
        where = f" at {at}" if (at := raised_at(e)) else ""
        raise BadInput(f"{what} raised {type(e).__name__}: {str(e)[:200]}{where}; the entry's "
                       "code fails on this bundle, fix it or pass --entry") from None


def target_wrap(opts: RunOptions, manifest: dict, t_dev
                ) -> tuple[Callable[[], ContextManager], set[str]]:
    """The context of every run on the target: ``--inject``'s and, on a device type other than
    the one the bundle was captured on (an ``npu`` capture replayed on the CPU), `ReferenceKernels`:
    an op only the capture's device has a kernel for runs its registered reference
    implementation (``nanbisect.reference_impl``). The set collects the ops that did
    (`reference_kernels_note`)."""
    inject = load_inject(opts.inject) if opts.inject else nullcontext
    used: set[str] = set()
    if Manifest.of(manifest).captured_type == t_dev.type:
        return inject, used
    registry.load_plugins()

    def wrap():
        return stacked(inject(), ReferenceKernels(used, custom_only=True))
    return wrap, used


def reference_kernels_note(used: set[str], target: str) -> str | None:
    """The note of a target run on which device-only ops ran their reference implementations."""
    if not used:
        return None
    ops = sorted(used)
    return (f"{', '.join(ops)} {'has' if len(ops) == 1 else 'have'} no kernel on {target}: the "
            "target ran the registered reference implementation (nanbisect.reference_impl), not "
            "the capture device's kernel, so a fault in that kernel cannot reproduce here")


@dataclass
class StepRun:
    """What one step's analysis shares once pass 1 has run: its chain of passes (`Chain`:
    the replayer, the target's context, progress), the options, the facts of the report, pass
    1's probe table, the notes so far, the repro's interpreter started ahead, the repro runs
    started and the stages after the verdict that failed. In-process only."""

    chain: Chain
    opts: RunOptions
    facts: RunFacts
    table: ProbeTable              # pass 1's module statistics
    notes: list[str] = field(default_factory=list)
    interp: Interpreter | None = None   # started ahead for the repro's run (opts.run_repro)
    started: list = field(default_factory=list)   # the repro runs started (`rerun._Pending`):
                                                  # `analyse` closes them on every path
    errors: list[StageError] = field(default_factory=list)   # stages after the verdict that
                                                             # failed (`after_verdict`)

    @property
    def rep(self) -> Replayer:
        return self.chain.rep

    @property
    def wrap(self) -> Callable[[], ContextManager]:
        return self.chain.wrap

    @property
    def progress(self) -> Progress:
        return self.chain.progress
