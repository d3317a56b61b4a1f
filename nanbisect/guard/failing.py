"""The Guard's failures (`Failures`): a failing step bundled from the live state
(`Failures.live`), or, for a failure born in an update that ran, from its pre-state rebuilt from
the snapshot and the steps since (`Failures.after_update`); under torch.distributed, with what
each collective of the failing step gave this rank (`nanbisect.guard.retape`); a rank that did
not meet one of the Guard's waits writes its part alone (`Failures.alone`). A collaborator
`nanbisect.guard.core.Guard` owns.

Guarantees: every path ends in `NonFiniteStep` with where the bundle went (or why it could not
be written anywhere); under torch.distributed every rank takes the same path.
"""
from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from nanbisect import devices
from nanbisect.bundle.state import RngState, decode, local
from nanbisect.errors import NonFiniteStep
from nanbisect.guard.coord import any_rank, broadcast_str, ranks_max
from nanbisect.guard.deadline import BoundedWaits, RankTimeout
from nanbisect.guard.guarded import Guarded, Progress
from nanbisect.guard.keep import SnapshotFailed, reset_scaler_stage
from nanbisect.guard.parts import held_ranks
from nanbisect.guard.reading import Reader
from nanbisect.guard.retape import record_step
from nanbisect.guard.screen import bad_names, listed_names, value_kind
from nanbisect.guard.snapshot import live_scale
from nanbisect.guard.freeze import free_path, scaler_state, write_or_rescue, write_step
from nanbisect.util import torch_internals as ti
from nanbisect.util.text import clip, exception_line


def _unavailable(why: str) -> dict:
    """``observed.rebuild`` of a step whose pre-state could not be rebuilt."""
    return {"from_step": None, "steps": 0, "fidelity": "unavailable", "max_rel_diff": None,
            "first_mismatch": None, "why": clip(why, 300)}


class Failures:
    """A Guard's failing steps, bundled and raised, from what the Guard shares (`Guarded`,
    `Progress`); its `Reader` reads a rebuilt step's values."""

    def __init__(self, guarded: Guarded, progress: Progress, reader: Reader) -> None:
        self.g, self.p, self.reader = guarded, progress, reader
        self._unmet: RankTimeout | None = None   # the first of the Guard's waits not met

    def live(self, batch: Any, rng: RngState, observed: dict,
             scale: torch.Tensor | None, dev: torch.device) -> None:
        """Bundle the step from the live state (its update never ran) and raise."""
        self.restore(scale)
        self._raise(batch, rng, observed, dev)

    def _raise(self, batch: Any, rng: RngState, observed: dict, dev: torch.device) -> None:
        """Record the step's collectives (under torch.distributed), write its bundle and raise
        `NonFiniteStep`; a rank that does not meet a wait on the way (`RankTimeout`) makes this
        one write its part alone (`_write_alone`). The failure is then raised and done: `close`
        does not raise it again."""
        self.p.last_applied = None
        self._unmet = None
        distributed = self.g.rank.distributed
        try:
            tape = self._record_tape(batch, rng, dev) if distributed else None
            path, error = self._write_failure(batch, rng, observed, tape)
        except RankTimeout as e:
            path, error = self._write_alone(batch, rng, observed, self._unmet or e)
        raise NonFiniteStep(path, observed, error,
                            ranks=held_ranks(path) if distributed else None)

    def _write_alone(self, batch: Any, rng: RngState, observed: dict, e: RankTimeout
                     ) -> tuple[Path | None, str | None]:
        """Another rank did not meet one of the Guard's waits: no collective from here on. This
        rank writes its part of the step as a bundle of its own (``out/stepN-rankR``, its
        ``partial`` naming the ranks that did not meet) and says so in one line."""
        g = self.g
        observed["rank"] = g.rank.rank
        observed["rank_timeout"] = str(e)
        sources = g.sources_now()
        write = partial(write_step, g.task, batch, rng, entry=g.entry,
                        entry_file=g.entry_file, step=self.p.step_index, observed=observed,
                        sources=sources, scaler_state=scaler_state(g.task), unique=True,
                        history=g.history, alone=str(e))
        path, error = write_or_rescue(write, free_path(g.out, self.p.step_index,
                                                       f"-rank{g.rank.rank}"),
                                      g.out, distributed=False)
        return path, (str(e) if error is None else f"{e}; {error}")

    def alone(self, batch: Any, rng: RngState | None, e: RankTimeout) -> None:
        """A wait of the Guard's own (the step's agreement, a rebuild) that another rank did not
        meet: this rank's step, as it began where the update did not run, written alone, and
        `NonFiniteStep` raised with the line."""
        self.p.open = False
        keeper = self.g.keeper
        if batch is None and keeper is not None and keeper.records:   # `close`: the last step
            batch, rng = decode(keeper.records[-1].batch, keeper.records[-1].tensors), \
                keeper.records[-1].rng
        if rng is None:
            rng = RngState.get(self.g.accel)
        try:
            self.restore(live_scale(self.g.task.grad_scaler))
        except Exception:  # noqa: BLE001 - the state as it stands is written all the same
            pass
        observed = {"step": self.p.step_index, "first": "rank-timeout", "loss": "unknown",
                    "summary": {"ranks": "did not meet"}}
        self.p.last_applied = None
        path, error = self._write_alone(batch, rng, observed, e)
        raise NonFiniteStep(path, observed, error)

    def after_update(self, step: int, batch: Any = None, rng: RngState | None = None) -> None:
        """A failure whose update ran (step ``step``'s: its parameters are not finite): rebuild
        its pre-state from the snapshot and the steps since, bundle it, raise. When no snapshot
        reaches it (or the model or optimizer changed since), the step in progress is bundled
        as it began instead (``batch``, ``rng``; the non-finite parameters are then its input),
        saying why."""
        g, p = self.g, self.p
        task = g.task
        params = bad_names([(n, q.data) for n, q in task.model.named_parameters()])
        why = self._unrebuildable(step)
        if why is None:
            rec, rebuild, batch, rng = self._rebuilt(step, batch, rng)
        else:
            rec, rebuild = None, _unavailable(why)
            batch, rng = self._as_it_began(batch, rng)
        if g.history is not None:
            g.history.drop_from(p.step_index + 1)
        loss = rec.loss if rec is not None else None
        grads = rec.grad_norm if rec is not None else None
        loss_kind = value_kind(loss) if loss is not None else "unknown"
        grads_kind = value_kind(grads) if grads is not None else "unknown"
        params_kind = "nan" if params["nan"] else "inf" if params["inf"] else "finite"
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if grads_kind in ("nan", "inf") else
                 "param" if params_kind != "finite" else "other-rank")
        observed = {"step": p.step_index, "first": first,
                    "loss": loss if loss_kind not in ("nan", "inf") else loss_kind,
                    "summary": {"loss": loss_kind, "grads": grads_kind, "params": params_kind},
                    "nonfinite_grads": listed_names({"nan": [], "inf": []}),
                    "nonfinite_params": listed_names(params), "rebuild": rebuild}
        p.value = loss
        dev = local(next(task.model.parameters())).device if p.params else devices.HOST
        self._raise(batch, rng, observed, dev)

    def _unrebuildable(self, step: int) -> str | None:
        """Why step ``step``'s pre-state cannot be rebuilt (None: it can; under torch.distributed,
        on every rank, or on none)."""
        keeper = self.g.keeper
        if keeper is None:
            why = "the Guard keeps no snapshot"
        elif not keeper.can_rebuild(step):
            why = (f"no snapshot reaches step {step}" + (f" (the last could not be written: "
                                                          f"{keeper.failed})" if keeper.failed
                                                         else ""))
        else:
            try:     # the snapshot's file read back: it may be damaged, deleted or foreign
                why = keeper.unfit(self.g.task)
            except Exception as e:  # noqa: BLE001 - the step is bundled as it began instead
                why = (f"the snapshot could not be read back ({type(e).__name__}: "
                       f"{exception_line(e, limit=200)})")
        if self.g.rank.distributed:    # every rank rebuilds, or none
            if ranks_max(float(why is not None)) > 0 and why is None:
                why = "another rank could not rebuild"
        return why

    def _rebuilt(self, step: int, batch: Any, rng: RngState | None) -> tuple:
        """(the record of step ``step``, ``observed.rebuild``, its batch, its RNG): its pre-state
        rebuilt into the live model and optimizer; a rebuild that raises leaves the state where
        it stopped (no record; ``batch`` and ``rng`` as given)."""
        keeper, p = self.g.keeper, self.p
        p.busy = True
        try:
            with BoundedWaits():    # the kept steps' collectives end by the deadline
                rebuilt, rec = keeper.rebuild(self.g.task, step, self.reader.values)
            rebuild = rebuilt.to_json()
            batch, rng = decode(rec.batch, rec.tensors), rec.rng
            p.step_index = step
            keeper.drop_from(step)
        except RankTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - the failure is bundled all the same
            rec = None
            rebuild = _unavailable(f"the rebuild raised {exception_line(e)}: the state is "
                                   "where it stopped")
        finally:
            p.busy = False
        return rec, rebuild, batch, rng

    def _as_it_began(self, batch: Any, rng: RngState | None) -> tuple[Any, RngState]:
        """The step to bundle when no rebuild reaches it: the step in progress as it began
        (buffers and scale put back; its parameters the non-finite ones it was given), or at
        `close` the last kept step's batch and RNG."""
        keeper = self.g.keeper
        if self.p.open or batch is not None:
            # the step in progress, as it began: buffers and scale back (its forward and
            # backward ran), its parameters the non-finite ones it was given
            self.restore(live_scale(self.g.task.grad_scaler))
        else:      # `close`: no step in progress; the last step's batch stands in
            last = keeper.records[-1] if keeper is not None and keeper.records else None
            if last is not None:
                batch, rng = decode(last.batch, last.tensors), last.rng
        return batch, (rng if rng is not None else RngState.get(self.g.accel))

    def _record_tape(self, batch: Any, rng: RngState, dev: torch.device):
        """Under torch.distributed: every rank runs the failing step once more, from the same
        pre-step state and RNG, keeping what each collective gave it (a replay of a few ranks
        serves it to them); the state is put back after it (from the whole-state copy, or from
        a snapshot of it taken now, off the device). None, on every rank, when any rank could
        not record it."""
        g, p = self.g, self.p
        keeper, task = g.keeper, g.task
        copied = p.copying or keeper is None
        ok = True
        if not copied:     # the state to put back after the recording, off the device
            try:
                keeper.take(p.step_index, task.model, task.optimizer, scaler_state(task), {})
            except SnapshotFailed as e:
                ok, why = False, f"its state could not be kept aside: {e}"
        if ranks_max(float(not ok)) > 0:    # every rank records, or none
            warnings.warn("Guard: the failing step's collectives were not recorded ("
                          f"{why if not ok else 'another rank could not keep its state aside'}"
                          "); the bundle replays all ranks only (no --ranks)", RuntimeWarning,
                          stacklevel=4)
            return None
        scale = live_scale(task.grad_scaler)
        pre_scale = None if scale is None else scale.clone()
        rng.set()
        p.busy = True
        try:
            tape, why = record_step(task, batch)
        finally:
            p.busy = False
        if isinstance(why, RankTimeout):     # the first wait that did not meet: said first
            self._unmet = why
        if copied:
            self.restore(scale)
        else:
            keeper.restore(task)
            if pre_scale is not None:
                ti.set_scaler_scale(task.grad_scaler, pre_scale)
            reset_scaler_stage(task.grad_scaler)
        if self._unmet is not None:   # a rank did not meet: no more collectives, write alone
            raise self._unmet
        lost = any_rank(torch.tensor([float(tape is None)],
                                     device=devices.collective_device(g.rank.backend, dev)))
        if lost.item() > 0:   # every rank agrees: a bundle without a tape, never none
            if why:
                warnings.warn(f"Guard: the failing step's collectives could not be recorded "
                              f"({why}); the bundle replays all ranks only (no --ranks)",
                              RuntimeWarning, stacklevel=4)
            tape = None
        return tape

    def _write_failure(self, batch: Any, rng: RngState, observed: dict, tape
                       ) -> tuple[Path | None, str | None]:
        """Write the failing step's bundle (rescued elsewhere if ``out`` fails): (where it went,
        None), or (None, why) when it could not be written anywhere."""
        g = self.g
        path = free_path(g.out, self.p.step_index)
        if g.rank.distributed:
            path = Path(broadcast_str(str(path)))
            observed["rank"] = g.rank.rank
        # the hashes read when training started win: a file edited since is not what ran
        sources = g.sources_now()
        write = partial(write_step, g.task, batch, rng, entry=g.entry,
                        entry_file=g.entry_file, step=self.p.step_index, observed=observed,
                        sources=sources, scaler_state=scaler_state(g.task), unique=True,
                        tape=tape, history=g.history, lookback=g.lookback,
                        write_timeout=g.write_timeout)
        return write_or_rescue(write, path, g.out, distributed=g.rank.distributed)

    def restore(self, scale: torch.Tensor | None) -> None:
        """Back to the pre-step state (the scaler's too, on its first step): from the whole-state
        copy, or (the update never ran) the buffers' and the scaler's."""
        g = self.g
        if self.p.copying:
            g.snapshot.restore(g.task.optimizer)
        else:
            g.snapshot.restore_early(g.task.optimizer)
        scaler = g.task.grad_scaler
        reset_scaler_stage(scaler)
        if scale is not None and g.snapshot.scale is None:   # the scaler's first step
            ti.reset_scaler_to_first_step(scaler, scale)
