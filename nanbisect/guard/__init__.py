"""Stage 3, capture: freeze a training step into a bundle (`Guard` on failure, `capture` on
demand), on one process or on every rank of a torchrun job.

`core` (`Guard`, `StepWatch`; its step's reading in `reading`, its failures in `failing`, its
spikes and `Spike` in `spikes`), `entry` (the checks before training starts), `snapshot` (the
pre-step copies), `keep` and `stores` (the snapshot kept off the device and the rebuild),
`screen` (the per-step screen and the exact check), `write` (the bundle's manifest and tensors,
`capture`, the rescue), `coord` (rank coordination and the multi-rank bundle) and `tape` (the
failing step's collectives). Guarantees: importing this package imports
those modules (and torch); the names below are the stage's public API.
"""
from __future__ import annotations

from nanbisect.guard.core import Guard, Spike, StepWatch
from nanbisect.guard.entry import resolve_entry_file
from nanbisect.guard.screen import _screen as _screen              # scripts/bench_*.py
from nanbisect.guard.snapshot import _Snapshot as _Snapshot        # scripts/bench_guard.py
from nanbisect.guard.write import capture

__all__ = ["Guard", "Spike", "StepWatch", "capture", "resolve_entry_file"]
