"""Stage 3, capture: freeze a training step into a bundle (`Guard` on failure, `capture` on
demand), on one process or on every rank of a torchrun job.

`core` (`Guard`, `StepWatch`), whose collaborators are its `Reader` (`reading`: the step's one
reading and its exact checks), its `Failures` (`failing`: a failing step bundled and raised) and
its `Spikes` (`spikes`: `Spike`), sharing one `Guarded` and one `Progress` (`guarded`); `entry`
(the checks before training starts), `snapshot` (the pre-step copies), `keep` and `stores` (the
snapshot kept off the device and the rebuild), `spill` (the kept steps' copies written to a file
by a thread of their own), `screen` (the per-step screen and the exact check), `freeze` (the
bundle's manifest and tensors, `capture`, the rescue), `coord` (rank coordination and what the
ranks write once), `parts` (the multi-rank bundle on disk), `agree` (the ranks' agreement through
the store), `deadline` (bounded waits) and `retape` (the failing step run again to record its
collectives). Guarantees: importing this package imports those
modules (and torch); the names in ``__all__`` are the stage's public API.

What the package's modules share (their named interface inside the stage; nothing outside
`guard/` needs them but where said):

- `guarded`: `Guarded`, `Progress` (what the Guard's collaborators share);
- `reading`: `Reader`, `declared_scaler` (the Task declares an enabled GradScaler);
- `failing`: `Failures`; `spikes`: `Spikes`, `lookback_and_spike` (the Guard's `Lookback` and
  `Spike` from its options);
- `entry`: `check_out`, `check_modes` (the Guard's options, checked before training starts);
- `screen`: `tensor_norms`, `step_norms`, `step_and_buffer_norms`, `screen_sum` (the screen,
  device ops only), `any_nonfinite`, `bad_names`, `listed_names` (the exact check and what
  ``observed`` lists), `value_kind` (``"nan"``/``"inf"``/``"finite"`` of a number),
  `PLAIN_TENSORS` and `local_each` (a tensor's local shard, no call for a plain one; the
  snapshot's too); `screen_sum` is also scripts/bench_history.py's;
- `snapshot`: `Snapshot` (the pre-step copies; also scripts/bench_guard.py's), `live_scale`
  (the scaler's live scale tensor), `model_tensors`;
- `freeze`: `write_step` (a step's bundle, every rank its part), `scaler_state` (the scaler's
  state as a bundle stores it), `free_path` (where a Guard's bundle goes), `write_or_rescue`;
- `coord`: `ranks_max` (the largest value of all ranks), `merged_groups` (one process-group
  layout from every rank's view) and `measured_or_not` (an out-of-sync tensor's largest
  difference, read back from the parts written), with `any_rank`, `broadcast_str`, `rank_info`
  and the replica plan;
- `stores`: `Scratch` (the Guard's private directory), `FileStore`, `HostStore`, `LazyFile`
  (where `keep.Keeper` keeps a snapshot), `LazyTensors` (a mapping read one tensor at a time);
- `spill`: `Spill`, `Spilled` (where `keep.Keeper` keeps the steps' copies that pass their
  share of memory);
- `retape`: `record_step`, `Tape`, `TapeRecorder`.
"""
from __future__ import annotations

from nanbisect.guard.core import Guard, Spike, StepWatch
from nanbisect.guard.entry import resolve_entry_file
from nanbisect.guard.freeze import capture

__all__ = ["Guard", "Spike", "StepWatch", "capture", "resolve_entry_file"]
