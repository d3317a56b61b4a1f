"""`Guard(spike=...)`: a loss far above its recent history writes a bundle of the step and training
goes on (`Spike`, `_Spikes._check_spike`). A part of `nanbisect.guard.core.Guard`.

Guarantees: a spike never stops the training (a bundle that cannot be written is a warning); at
most ``max_bundles`` per run, and not again until the loss has come back below the threshold.
"""
from __future__ import annotations

import warnings
from typing import Any


from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.lookback import Lookback
from nanbisect.errors import BadInput
from nanbisect.bundle.state import RngState
from nanbisect.guard.write import _scaler_state, _write
from nanbisect.util.text import exception_line

from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    """`Guard(spike=...)`: write a bundle (and go on training) when a step's loss lies
    ``threshold`` robust standard deviations above the median of the ``window`` steps before it
    (`nanbisect.history.jump_score`; at least 8 of them), at most ``max_bundles`` per run and
    not again until the loss has come back below the threshold."""

    threshold: float = 6.0
    window: int = hist.JUMP_WINDOW
    max_bundles: int = 3


class _Spikes:
    """`Guard`'s spike checks (the attributes are the Guard's)."""

    def _check_spike_before(self, read: dict) -> None:
        """`_check_spike` from just before the update: the live parameters and optimizer state
        are the step's pre-state; its buffers are put as they began while the bundle is
        written."""
        if self.spike is None or not read.get("had_loss"):
            return
        batch = self._watching.batch if self._watching is not None else self._step_batch
        if self._lookback is not None:
            self._lookback.end(self.step_index, self._step_rng, batch)
        self._check_spike(batch, self._step_rng, read["loss"], live=True)

    def _check_spike(self, batch: Any, rng: RngState, loss: float | None,
                     live: bool = False) -> None:
        """A loss far above its recent history: write a bundle of the step, go on training
        (``live``: read before the update, the live state is the pre-state but for the buffers;
        else the whole-state copy is swapped in while it writes)."""
        if self.spike is None or loss is None or self._history is None:
            return
        before = self._history.losses_before(self.spike.window)
        score = hist.jump_score(loss, before)
        if score is None or score[0] < self.spike.threshold:
            self._in_spike = False
            return
        if self._in_spike or len(self.spikes) >= self.spike.max_bundles:
            return
        self._in_spike = True
        z, med, scale = score
        observed = {"step": self.step_index, "first": "spike", "loss": loss,
                    "summary": {"loss": "finite", "grads": "finite", "params": "finite"},
                    "spike": {"median": med, "scale": scale, "z": round(z, 2),
                              "threshold": self.spike.threshold, "window": len(before)}}
        sources = {**user_sources(self._entry_file), **self._sources}
        opt = self.task.optimizer
        swap = self._snapshot.swap_early if live else self._snapshot.swap
        swap(opt)     # the live tensors hold the pre-step state while it writes
        try:
            path = _write(self.task, batch, rng, self._free_path("-spike"), entry=self.entry,
                          entry_file=self._entry_file, step=self.step_index, observed=observed,
                          sources=sources, scaler_state=_scaler_state(self.task), unique=True,
                          history=self._history, lookback=self._lookback)
        except Exception as e:  # noqa: BLE001 - a spike must never stop the training
            warnings.warn(f"Guard: could not write the spike bundle of step {self.step_index} "
                          f"into '{self.out}' ({exception_line(e)}); training goes on",
                          RuntimeWarning, stacklevel=4)
            return
        finally:
            swap(opt)
        self.spikes.append(path)
        warnings.warn(f"Guard: loss spike at step {self.step_index} ({loss:.4g} against a median "
                      f"of {med:.4g}): wrote {path} (replay it with --reference); training goes "
                      "on", RuntimeWarning, stacklevel=4)


def _lookback_and_spike(lookback: int | None, lookback_on: str, spike: "float | Spike | None",
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
