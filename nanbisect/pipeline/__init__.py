"""`run_bundle`: bundle -> replay(target) [+ replay(reference)] -> phase -> module -> op -> report.

Passes over the step, each from the bundle's pre-step state:
  1. module statistics over the whole step (cheap: one small reduction per module call);
     decides reproduction and phase, and gives the module backtrace;
  2. op recording over the failing phase only; provenance from the failed value to its root op
     (a backward failure that points to forward: forward and backward once more, together, and
     the root is where the value was born, ``culprit.surfaced`` where it showed);
  3. a narrow replay that clones the root op's inputs (and takes the only Python stack; for a
     forward culprit on the CPU pass 2 has already caught them on its way: no replay), for the
     standalone repro, which then runs once where nanbisect cannot be imported by it: on the CPU
     in a fork of this process (torch loaded), elsewhere in a fresh interpreter started when the
     run began (its ``import torch`` overlapped the passes; `nanbisect.report.rerun`), while this
     process re-runs the culprit op on the reference.
A failure recorded in the manifest that the replay does not show is reported as
``not-reproduced``, never given an invented culprit. Each pass is announced to ``progress`` with
a stable key from `STAGES` and a text for people, so callers can show or time the passes.

The modules, and what they share (the package's interface between its modules; everything else
with an underscore stays in its module):
- `run` (`run_bundle`, `STAGES`): read, target, a multi-rank bundle handed to its launcher, one
  step or a ``--steps`` window, the report written;
- `steps` (`steps.run_steps`, called by `run`): ``--steps K``;
- `analysis` (`analysis.analyse`, called by `run` and `steps`): one step through the chain of
  passes (`nanbisect.chain`, `Serving.NONE`) and its verdict, the culprit's or the divergence's
  report;
- `compiler_verdict`: a compiled capture's replay and verdict (called by `analysis`);
- `common`: `RunOptions`; `StepRun`, the state `analysis` and `compiler_verdict` share once
  pass 1 has run (its chain, options, facts, probe table, notes, errors after the verdict);
  `guarded`, user code failing as a one-line `BadInput` (the chain's guard, and `steps`');
  `target_wrap` and `reference_kernels_note`, the target's context; `captured_type`,
  `recorded_failure`.
"""
from __future__ import annotations

from nanbisect.pipeline.common import Progress, RunOptions, recorded_failure
from nanbisect.pipeline.run import STAGES, run_bundle

__all__ = ["STAGES", "Progress", "RunOptions", "recorded_failure", "run_bundle"]
