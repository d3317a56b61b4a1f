"""What a Guard's collaborators share: `Guarded`, what the Guard guards and keeps (set when it
is made), and `Progress`, where the guarded run stands (the step index, the skips in a row, the
step in progress). `nanbisect.guard.core.Guard` makes one of each and hands them to its reader
(`nanbisect.guard.reading.Reader`), its failures (`nanbisect.guard.failing.Failures`) and its
spikes (`nanbisect.guard.spikes.Spikes`); each of those keeps what only it needs itself.

Guarantees: plain records, nothing here runs a step or a collective; one object of each per
Guard, shared (never copied), so a change one collaborator makes is what the others read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.lookback import Lookback
from nanbisect.guard.coord import RankInfo
from nanbisect.guard.keep import Keeper
from nanbisect.guard.snapshot import Snapshot
from nanbisect.task import Task


@dataclass
class Guarded:
    """What a Guard guards, where it writes, and what it keeps between steps."""

    task: Task
    entry: str                      # the entry as a replay imports it
    entry_file: str | None          # ... resolved to its file (None: a module)
    out: Path                       # where bundles go
    sources: dict[str, str]         # the user sources' hashes as training started
    rank: RankInfo
    accel: Any                      # the accelerator types whose RNG a step's state holds
    write_timeout: float | None     # a rank's write of its part (under torch.distributed)
    max_scaler_skips: int           # skipped steps in a row that are a failure
    history: hist.HealthLog | None
    lookback: Lookback | None
    snapshot: Snapshot              # the pre-step copies (`nanbisect.guard.snapshot`)
    keeper: Keeper | None = None    # the rebuild mode's K-step snapshot (None: every-step)

    def sources_now(self) -> dict[str, str]:
        """The user sources' hashes for a bundle: those read when training started win (a file
        edited since is not what ran), with any imported since."""
        return {**user_sources(self.entry_file), **self.sources}


@dataclass
class Progress:
    """Where the guarded run stands: between steps, and of the step in progress."""

    step_index: int                     # the step in progress, or the next
    scaler_skips: int = 0               # steps in a row the scaler skipped
    last_applied: int | None = None     # the last step whose update ran
    value: float | None = None          # the last step's loss, as `Guard.step` returns it
    # the step in progress
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the model's, as it began
    buffers: list[torch.Tensor] = field(default_factory=list)
    lr: Any = None                      # the learning rate it uses
    open: bool = False                  # between its begin and its end
    busy: bool = False                  # the Guard runs the step itself (tape, rebuild)
    copying: bool = False               # it keeps an exact copy of the whole state
