"""`Guard(spike=...)`: a loss far above its recent history writes a bundle of the step and training
goes on (`Spike`, `Spikes.check`); `lookback_and_spike`, the Guard's `Lookback` and `Spike` from
its options. `Spikes` is a collaborator `nanbisect.guard.core.Guard` owns.

Guarantees: a spike never stops the training (a bundle that cannot be written is a warning); at
most ``max_bundles`` per run, and not again until the loss has come back below the threshold.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from nanbisect import history as hist
from nanbisect.bundle.lookback import Lookback
from nanbisect.bundle.state import RngState
from nanbisect.errors import BadInput
from nanbisect.guard.guarded import Guarded, Progress
from nanbisect.guard.freeze import free_path, scaler_state, write_step
from nanbisect.util.text import exception_line


@dataclass(frozen=True)
class Spike:
    """`Guard(spike=...)`: write a bundle (and go on training) when a step's loss lies
    ``threshold`` robust standard deviations above the median of the ``window`` steps before it
    (`nanbisect.history.jump_score`; at least 8 of them), at most ``max_bundles`` per run and
    not again until the loss has come back below the threshold."""

    threshold: float = 6.0
    window: int = hist.JUMP_WINDOW
    max_bundles: int = 3


class Spikes:
    """A Guard's spike checks and the spike bundles it wrote (``written``, oldest first), from
    what the Guard shares (`Guarded`, `Progress`)."""

    def __init__(self, guarded: Guarded, progress: Progress, spike: Spike | None) -> None:
        self.g, self.p, self.spike = guarded, progress, spike
        self.written: list = []         # the spike bundles' paths, oldest first
        self._in_spike = False

    def check_before(self, read: dict, batch: Any, rng: RngState) -> None:
        """`check` from just before the update (``batch`` and ``rng``: the step's): the live
        parameters and optimizer state are the step's pre-state; its buffers are put as they
        began while the bundle is written."""
        if self.spike is None or not read.get("had_loss"):
            return
        if self.g.lookback is not None:
            self.g.lookback.end(self.p.step_index, rng, batch)
        self.check(batch, rng, read["loss"], live=True)

    def check(self, batch: Any, rng: RngState, loss: float | None, live: bool = False) -> None:
        """A loss far above its recent history: write a bundle of the step, go on training
        (``live``: read before the update, the live state is the pre-state but for the buffers;
        else the whole-state copy is swapped in while it writes)."""
        g, step = self.g, self.p.step_index
        if self.spike is None or loss is None or g.history is None:
            return
        before = g.history.losses_before(self.spike.window)
        score = hist.jump_score(loss, before)
        if score is None or score[0] < self.spike.threshold:
            self._in_spike = False
            return
        if self._in_spike or len(self.written) >= self.spike.max_bundles:
            return
        self._in_spike = True
        z, med, scale = score
        observed = {"step": step, "first": "spike", "loss": loss,
                    "summary": {"loss": "finite", "grads": "finite", "params": "finite"},
                    "spike": {"median": med, "scale": scale, "z": round(z, 2),
                              "threshold": self.spike.threshold, "window": len(before)}}
        sources = g.sources_now()
        opt = g.task.optimizer
        swap = g.snapshot.swap_early if live else g.snapshot.swap
        swap(opt)     # the live tensors hold the pre-step state while it writes
        try:
            path = write_step(g.task, batch, rng, free_path(g.out, step, "-spike"),
                              entry=g.entry, entry_file=g.entry_file, step=step,
                              observed=observed, sources=sources,
                              scaler_state=scaler_state(g.task), unique=True,
                              history=g.history, lookback=g.lookback)
        except Exception as e:  # noqa: BLE001 - a spike must never stop the training
            warnings.warn(f"Guard: could not write the spike bundle of step {step} "
                          f"into '{g.out}' ({exception_line(e)}); training goes on",
                          RuntimeWarning, stacklevel=4)
            return
        finally:
            swap(opt)
        self.written.append(path)
        warnings.warn(f"Guard: loss spike at step {step} ({loss:.4g} against a median "
                      f"of {med:.4g}): wrote {path} (replay it with --reference); training goes "
                      "on", RuntimeWarning, stacklevel=4)


def lookback_and_spike(lookback: int | None, lookback_on: str, spike: "float | Spike | None",
                        distributed: bool, has_history: bool
                        ) -> tuple[Lookback | None, Spike | None]:
    """The Guard's `Lookback` and `Spike` from its options; `BadInput` for one out of range,
    for either under torch.distributed, and for a spike without the history it compares with."""
    if distributed and (lookback or spike):
        raise BadInput(f"Guard({'lookback' if lookback else 'spike'}=...) is not supported "
                       "under torch.distributed yet; drop it for a multi-rank job")
    kept = Lookback(lookback, lookback_on) if lookback else None
    if spike is not None and not isinstance(spike, Spike):
        if isinstance(spike, bool) or not isinstance(spike, (int, float)) or spike <= 0:
            raise BadInput(f"Guard(spike={spike!r}): give a threshold > 0 (robust standard "
                           "deviations above the recent median) or nanbisect.Spike(...)")
        spike = Spike(threshold=float(spike))
    if spike is not None and not has_history:
        raise BadInput("Guard(spike=...) needs the history it compares with; keep history "
                       "on (history=N)")
    return kept, spike
