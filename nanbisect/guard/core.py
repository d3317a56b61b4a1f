"""`Guard`: run training steps, and freeze the first non-finite one into a bundle.

Guarantees: `Guard.step` runs the Task's whole step (`nanbisect.step.run_step`: micro-batches,
scaler, clipping), the same code every replay runs; a failing step's bundle holds the state before
it (written by `nanbisect.guard.write`). A step is read once, just before its update (after
unscaling and clipping; in `Guard.watch`, from a step pre-hook on the Task's optimizer): one norm
per parameter and per gradient from one pass over both, the loss, and one host synchronisation;
exact checks run only when that screen trips (`nanbisect.guard.screen`). A step that failed in
forward or backward never reaches its update (it is left out), so its bundle is written from the
live tensors: the only per-step copies are of what a forward pass or the scaler changes (buffers,
the scale), none of a parameter or an optimizer moment. A fault born in the update (finite
gradients, non-finite parameters after it: Adam with eps=0, a learning-rate blow-up) is seen in the
next step's reading; its pre-state is rebuilt from a snapshot kept off the device every K steps
and the steps since (`nanbisect.guard.keep`), and the bundle says how exact that rebuild was
(``observed.rebuild``). ``snapshot="every-step"`` keeps the former exact copy of the whole state
before every step (`nanbisect.guard.snapshot`); an optimizer that is not a torch optimizer (no
step hooks) falls back to it with a warning. Every bundle holds the last ``history`` steps' health
(`nanbisect.history`); with ``lookback`` it holds the steps since a snapshot up to 2K steps back
(`nanbisect.bundle.lookback`); with ``spike`` a loss far above its recent history writes a bundle
and training goes on. A step the declared GradScaler skips is normal; ``max_scaler_skips`` skips
in a row is a failure (the scaler has stalled), bundled as the last skipped step
(``observed.undeclared_scaler`` when the Task declares no scaler and the loop skipped: the report
names the fix). With ``clip_grad_norm``, the gradients' kind (NaN or inf) is the one the total
norm had before clipping turned it into NaN. Under torch.distributed all ranks agree on a failure
(one all-reduce of a three-element flag per step, before the update: every rank leaves the
update out together, rebuilds together, snapshots together) and every rank writes its part of
one bundle, with what each collective of the failing step gave it (`nanbisect.guard.tape`).
`close` reads the last step's update and drops the snapshot. Not guaranteed: custom loops
(`Guard.watch`) are replayed through the Task, not through the loop: what the loop does beyond
the Task's fields is not in the bundle.
"""
from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.state import (RngState, accelerator_types, hyper_parameters,
                                    local)
from nanbisect.errors import BadInput, NonFiniteStep  # noqa: F401 - (the doctest of Guard)
from nanbisect.guard.agree import write_timeout
from nanbisect.guard.coord import rank_info
from nanbisect.guard.deadline import RankTimeout, rank_timeout
from nanbisect.guard.entry import (SNAPSHOT_MODES, _check_modes, _check_out,  # noqa: F401
                                   resolve_entry_file, warn_top_level)
from nanbisect.guard.keep import RETRY_AFTER, Keeper, SnapshotFailed
from nanbisect.guard.screen import _any_nonfinite, _kind, _norms
from nanbisect.guard.snapshot import _Snapshot, model_tensors
from nanbisect.guard.write import _scaler_state
from nanbisect.guard.failing import _Failing, _unavailable  # noqa: F401
from nanbisect.guard.reading import (_agree_max, _declared_scaler, _loss_slot,  # noqa: F401
                                     _ranks_max, _Reading)
from nanbisect.guard.spikes import Spike, _lookback_and_spike, _Spikes
from nanbisect.step import found_inf, run_step
from nanbisect.task import Task, refuse_training_at_import
from nanbisect.util.torch_internals import check_torch_version


@dataclass
class StepWatch:
    """Handle yielded by `Guard.watch`; set ``loss`` so the guard can check and record it.
    ``batch`` is what the bundle stores as the step's batch (the one given to ``watch``; a loop
    that learns its micro-batches as it goes may set it before the block ends)."""

    loss: torch.Tensor | None = None
    value: float | None = None
    batch: Any = None


def _pre_hook(guard: "Guard"):
    """The step pre-hook on the Task's optimizer: reads a `Guard.watch` step just before its
    update, and leaves the update out (no gradients: a torch optimizer skips such parameters)
    when the step failed."""
    ref = weakref.ref(guard)

    def hook(opt, args, kwargs):
        g = ref()
        if g is not None and g._watching is not None and not g._external and \
                not g._before_update():
            drop_grads(opt)
        return None
    return hook


def drop_grads(opt) -> None:
    """Leave an optimizer's next update out: without gradients a torch optimizer skips every
    parameter (state, step counts and weight decay untouched)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


class Guard(_Reading, _Failing, _Spikes):
    """Run training steps and freeze the first non-finite one into a bundle.

    ``entry`` names the function that returns the Task, as a replay imports it (a file or a
    module; never ``__main__``: refused, with the fix, docs/guide/guard.md). ``start_step`` is
    the index of the first step run (a resumed run's global step): steps are counted from it
    and bundles are named by it (``out/step{N:06d}``).

    >>> import tempfile
    >>> from nanbisect.task import import_target
    >>> adam_eps0 = import_target("fixtures/tasks/optimizer_adam_eps0.py")
    >>> guard = Guard(adam_eps0.task(), entry="fixtures/tasks/optimizer_adam_eps0.py:task",
    ...               out=tempfile.mkdtemp())
    >>> try:
    ...     for batch in adam_eps0.batches():
    ...         loss = guard.step(batch)
    ... except NonFiniteStep as e:
    ...     print(e.bundle.name, e.observed["first"], e.observed["rebuild"]["fidelity"])
    step000000 param bit-exact
    """

    def __init__(self, task: Task, *, entry: str, out: str | Path, start_step: int = 0,
                 max_scaler_skips: int = 10, history: int | None = hist.DEFAULT_N,
                 lookback: int | None = None, lookback_on: str = "device",
                 spike: "float | Spike | None" = None, snapshot: str = "rebuild",
                 snapshot_every: int | None = None, snapshot_stream: bool = True) -> None:
        refuse_training_at_import("Guard(...)")   # before `out` is made: nothing written
        if (too_old := check_torch_version()) is not None:
            warnings.warn(f"Guard: {too_old}", stacklevel=2)
        if not isinstance(task, Task):
            raise BadInput(f"Guard: got a {type(task).__name__}, not a nanbisect.Task; pass "
                           "Task(model=..., optimizer=..., loss_fn=...)")
        self._entry_file = resolve_entry_file(entry)
        warn_top_level(self._entry_file, task, "Guard")
        self.task, self.entry, self.out = task, entry, Path(out)
        _check_out(self.out)
        _check_modes(max_scaler_skips, snapshot, snapshot_every, snapshot_stream)
        self.max_scaler_skips = max_scaler_skips
        self.step_index = start_step
        self.scaler_skips = 0               # steps in a row the scaler skipped
        self._accel = accelerator_types()
        self._snapshot = _Snapshot(side_stream=snapshot_stream)
        self._rank = rank_info()
        # read now: a bad NANBISECT_WRITE_TIMEOUT fails here, not when the bundle is written
        self._write_timeout = write_timeout() if self._rank.distributed else None
        if self._rank.distributed:
            rank_timeout()      # a bad NANBISECT_RANK_TIMEOUT fails here, not at the NaN
        self._sources = user_sources(self._entry_file)   # the code as training started
        if history is not None and (type(history) is not int or history < 0):
            raise BadInput(f"Guard(history={history!r}): give a number of steps (0 or None: "
                           "no history)")
        names = [n for n, _ in task.model.named_parameters()]
        self._history = hist.HealthLog(history, names) if history else None
        self._lookback, self.spike = _lookback_and_spike(lookback, lookback_on, spike,
                                                         self._rank.distributed,
                                                         self._history is not None)
        self._init_state()
        opt = task.optimizer
        if snapshot == "rebuild" and opt is not None and \
                not isinstance(opt, torch.optim.Optimizer):
            warnings.warn(f"Guard: the Task's optimizer ({type(opt).__name__}) is not a "
                          "torch.optim.Optimizer: it has no step hook to read the step before "
                          "its update, so the whole state is copied before every step "
                          "(snapshot='every-step')", RuntimeWarning, stacklevel=2)
            snapshot = "every-step"
        self.snapshot = snapshot
        self._keeper = self._make_keeper(snapshot_every) if snapshot == "rebuild" else None
        self._hook = (opt.register_step_pre_hook(_pre_hook(self))
                      if self._keeper is not None and opt is not None else None)

    def _make_keeper(self, every: int | None) -> Keeper:
        """The rebuild mode's keeper: its snapshot in a file when the model lives in host memory,
        else in (pinned) host memory; under torch.distributed, K and failures agreed."""
        p = next(self.task.model.parameters(), None)
        on_host = p is None or devices.on_host(local(p).device)
        distributed = self._rank.distributed
        return Keeper(every=every, on_host=on_host, distributed=distributed,
                      agree=_agree_max if distributed else None,
                      agree_failed=(lambda bad: _ranks_max(float(bad)) > 0)
                      if distributed else None)

    def _init_state(self) -> None:
        """What the Guard knows between steps and of the step in progress, as nothing ran yet."""
        self.spikes: list[Path] = []        # the spike bundles written, oldest first
        self._in_spike = False
        self._lr: Any = None
        self._params: list[torch.nn.Parameter] = []   # the model's, read as each step begins
        self._buffers: list[torch.Tensor] = []
        self._warned_undeclared = False
        self._warned_snapshot = False
        # the step in progress (rebuild mode)
        self._open = False          # between a step's begin and its end
        self._watching: StepWatch | None = None
        self._external = False      # an integration reads the step itself (`_before_update`)
        self._busy = False          # the Guard runs the step itself (tape, rebuild): no reads
        self._read: dict | None = None     # the step's reading, once read
        self._trip: dict | None = None     # a failure seen before the update
        self._copying = False       # this step keeps an exact copy (`Guard.watch`, until the
        self._hook_seen = False     # ... Task's optimizer step is seen inside a watched step)
        self._hook_lost = False     # a watched loop stepped without the Task's optimizer (said)
        self._last_applied: int | None = None    # the last step whose update ran
        self._prev_row: tuple[int, torch.Tensor] | None = None   # (step, its history row)
        self._unmet: RankTimeout | None = None   # the first of the Guard's waits not met

    def step(self, batch: Any) -> float:
        """Run the Task's step (micro-batches, scaler, clipping, optimizer); return its loss
        (unscaled: the mean over micro-batches)."""
        task = self.task
        rng = None
        try:
            rng = self._begin(batch, watched=False)
            if task.optimizer is not None:
                task.optimizer.zero_grad(set_to_none=True)
            last = None
            before = self._before_update if self._keeper is not None else None
            try:
                for last in run_step(task, batch, before_update=before):
                    pass
            except RankTimeout:
                raise
            except BaseException:
                self._open, self._step_batch = False, None
                raise
            self._end(batch, rng, last.total if last is not None else None,
                      grad_norm=last.grad_norm, skipped=last.skipped)
        except RankTimeout as e:     # a rank did not meet the Guard's wait: never a hang
            self._fail_alone(batch, rng, e)
        return self._value

    @contextmanager
    def watch(self, batch: Any) -> Iterator[StepWatch]:
        """Guard a step that your own loop runs (forward, backward, optimizer step inside).

        The step is read just before the Task's optimizer updates the parameters (a step
        pre-hook): set ``loss`` before calling ``optimizer.step()``. The bundle replays through
        the Task (its loss_fn, scaler, clipping and accumulation), not through your loop: a loop
        that does more than the Task describes replays as ``replay-mismatch``.

        >>> import tempfile
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = Guard(Task(model, opt, lambda m, b: m(b).sum()),
        ...               entry="fixtures/tasks/healthy.py:task", out=tempfile.mkdtemp())
        >>> with guard.watch(torch.ones(3, 2)) as w:
        ...     opt.zero_grad(); w.loss = model(torch.ones(3, 2)).sum(); w.loss.backward()
        ...     opt.step()
        >>> isinstance(w.value, float)
        True
        """
        rng = self._begin(batch, watched=True)
        w = StepWatch(batch=batch)
        self._watching = w
        try:
            yield w
        except RankTimeout as e:     # the step pre-hook's agreement: a rank did not meet
            self._fail_alone(w.batch, rng, e)
        except BaseException:
            self._open, self._watching = False, None
            raise
        self._value = None
        try:
            self._end(w.batch, rng, w.loss, watched=True)
        except RankTimeout as e:
            self._fail_alone(w.batch, rng, e)
        finally:
            w.value = self._value

    def close(self) -> None:
        """End guarding: read the last step's update (a fault born there is otherwise seen by
        the next step's reading, which never comes: raises `NonFiniteStep` for it, once: a
        failure already raised is not raised again), then drop the snapshot (its file too).
        Idempotent: a second call does nothing; it raises nothing but `NonFiniteStep`. The
        Guard can be used again afterwards."""
        keeper = self._keeper
        try:
            if keeper is not None and self._last_applied is not None and \
                    self._last_applied == self.step_index - 1:
                params = list(self.task.model.parameters())
                dev = local(params[0]).device if params else devices.HOST
                screen = torch.linalg.vector_norm(_norms(params, dev)).item()
                bad = float(_kind(screen) != "finite" and _any_nonfinite(params))
                try:
                    bad = _ranks_max(bad) if self._rank.distributed else bad
                except RankTimeout as e:    # the ranks cannot agree: this rank's own reading
                    if bad > 0:
                        self._fail_alone(None, None, e)
                    warnings.warn(f"Guard.close: {e}", RuntimeWarning, stacklevel=2)
                    bad = 0.0
                if bad > 0:
                    try:
                        self._fail_after_update(self._last_applied)
                    except RankTimeout as e:   # the rebuild's agreement or its steps
                        self._fail_alone(None, None, e)
        finally:
            self._last_applied = None
            if keeper is not None:
                try:
                    keeper.close()
                except Exception as e:  # noqa: BLE001 - a snapshot's leftovers harm nobody
                    warnings.warn(f"Guard.close: the snapshot could not be dropped ({e})",
                                  RuntimeWarning, stacklevel=2)

    # -- the step's two halves -----------------------------------------------------------
    def _begin(self, batch: Any, watched: bool) -> RngState:
        rng = RngState.get(self._accel)
        self._step_batch, self._step_rng = batch, rng
        task = self.task
        self._params, self._buffers = model_tensors(task.model)   # one walk of the tree
        self._read, self._trip, self._watching = None, None, None
        self._copying = self._keeper is None or (watched and not self._hook_seen)
        if self._copying:
            self._snapshot.take(task.model, task.optimizer, task.grad_scaler, self._params,
                                self._buffers)
        else:
            self._snapshot.take_early(task.optimizer, task.grad_scaler, self._buffers)
            self._keeper.tick()
        if self._lookback is not None:
            self._lookback.begin(self.step_index, task.model, task.optimizer, task.grad_scaler)
        # the learning rate this step uses (a scheduler changes it after the step)
        self._lr = task.optimizer.param_groups[0].get("lr") if task.optimizer is not None and \
            task.optimizer.param_groups else None
        # (a tensor learning rate cloned: a scheduler may change it in place later in the step)
        self._groups = ([{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                          for k, v in g.items()} for g in hyper_parameters(task.optimizer)]
                        if self._keeper is not None and task.optimizer is not None else None)
        self._open = True
        return rng

    def _before_update(self, total: torch.Tensor | None = None,
                       grad_norm: torch.Tensor | None = None,
                       skipped: torch.Tensor | None = None) -> bool:
        """The step's one reading, just before its update: False leaves the update out (a
        failure, bundled at the step's end from the live tensors). Called by `run_step`, by
        the step pre-hook of `Guard.watch`, or by an integration that knows the point itself
        (`_external`). A second call in a step reads nothing. A rank that does not meet the
        reading's agreement leaves the update out too, and the step's end writes this rank's
        part alone (never an exception through the caller's optimizer or trainer)."""
        if not self._open or self._busy or self._keeper is None:
            return True
        if self._trip is not None and "unmet" in self._trip:
            return False
        try:
            return self._read_before_update(total, grad_norm, skipped)
        except RankTimeout as e:
            self._trip = {"unmet": e}
            return False

    def _read_before_update(self, total: torch.Tensor | None, grad_norm: torch.Tensor | None,
                            skipped: torch.Tensor | None) -> bool:
        if self._read is not None:     # read already: a second update waits on the first's fate
            return self._trip is None
        if self._watching is not None:
            total = self._watching.loss
            if skipped is None and _declared_scaler(self.task) and \
                    self.task.optimizer is not None:
                skipped = found_inf(self.task.grad_scaler, self.task.optimizer)
        dev, scale, read, flag = self._read_screen(total, grad_norm, skipped, before=True)
        read["had_loss"] = total is not None
        self._read = read
        if self._watching is not None:
            self._hook_seen = True
        loss_v, param_v, grads_v = read["loss"], read["screen"], read["grads"]
        skip = read.get("skipped", 0) > 0
        stalled = skip and self.scaler_skips + 1 >= self.max_scaler_skips
        if self._rank.distributed:
            tripped, rebuild = flag[0] > 0, flag[1] > 0
        else:
            rebuild = _kind(param_v) != "finite" and self._last_applied is not None
            tripped = (_kind(loss_v) != "finite" or _kind(param_v) != "finite" or stalled or
                       (_kind(grads_v) != "finite" and not skip))
        if rebuild:     # exactly: the screen's sum of squares overflows on large finite values
            bad = float(_any_nonfinite(self._params))
            rebuild = (_ranks_max(bad) if self._rank.distributed else bad) > 0
        self._add_history(read, skip)
        if not tripped:
            self._keep(skip)
            self._check_spike_before(read)
            return True
        if rebuild:
            self._trip = {"rebuild": True}
            return False
        # gradients the update would apply: checked exactly (the sum of squares can overflow)
        applied = _kind(grads_v) != "finite" and not skip and \
            _any_nonfinite(p.grad for p in self._params)
        if stalled:
            self.scaler_skips += 1      # this skip counts in what is observed
        observed = self._confirm(loss_v if total is not None else None, loss_v,
                                 read.get("grad_norm"), stalled, dev, applied)
        if stalled:
            self.scaler_skips -= 1
        if observed is None:    # the screen overflowed on finite values
            self._keep(skip)
            return True
        self._trip = {"observed": observed, "scale": scale, "dev": dev}
        return False

    def _keep(self, skip: bool) -> None:
        """A clean reading before the update: the snapshot, when one is due, from the live
        state (the update has not run) and the buffers as the step began."""
        keeper = self._keeper
        if keeper is None or not keeper.due(self.step_index, self.task.optimizer,
                                            over=self._read.get("over")):
            return
        task = self.task
        try:
            keeper.take(self.step_index, task.model, task.optimizer, _scaler_state(task),
                        self._snapshot.early_copies(self._buffers))
        except SnapshotFailed as e:
            if not self._warned_snapshot:
                self._warned_snapshot = True
                warnings.warn(f"Guard: could not write the snapshot of step {self.step_index} "
                              f"({e}); training goes on, tried again every {RETRY_AFTER} steps "
                              "(a NaN born in an update is rebuilt from the last snapshot that "
                              "was written, or bundled as the state after it)",
                              RuntimeWarning, stacklevel=5)

    def _end(self, batch: Any, rng: RngState, loss: torch.Tensor | None,
             grad_norm: torch.Tensor | None = None, skipped: torch.Tensor | None = None,
             watched: bool = False) -> None:
        """The step's end: its reading (when nothing read it before the update), its history,
        and a failure bundled and raised (``watched``: the step of a `watch` block)."""
        self._open, self._watching = False, None
        self._step_batch = self._step_rng = None     # not held past the step
        if self._trip is not None and "unmet" in self._trip:   # the reading's agreement
            self._fail_alone(batch, rng, self._trip["unmet"])
        if self._read is not None:
            self._end_read(batch, rng, loss)
            return
        dev, scale, read, flag = self._read_screen(loss, grad_norm, skipped)
        loss_v, param_v, grads_v = read["loss"], read["screen"], read["grads"]
        norm_v, skip_v = read.get("grad_norm"), read.get("skipped")
        self._value = loss_v if loss is not None else None
        skip, applied = skip_v is not None and skip_v > 0, False
        if _kind(grads_v) != "finite" and _kind(param_v) == "finite" and \
                _kind(loss_v) == "finite":
            skip, applied = self._nonfinite_grads(skip, watched)
        elif self._keeper is not None and watched and self.task.optimizer is not None and \
                not skip and _kind(grads_v) == "finite" and \
                any(p.grad is not None for p in self._params):
            self._lost_hook()
        read["had_loss"] = loss is not None
        self._add_history(read, skip)
        if self._lookback is not None:
            self._lookback.end(self.step_index, rng, batch)
        self.scaler_skips = self.scaler_skips + 1 if skip else 0
        stalled = self.scaler_skips >= self.max_scaler_skips
        tripped = (flag[0] > 0 if self._rank.distributed else
                   _kind(param_v) != "finite" or _kind(loss_v) != "finite" or stalled or applied)
        if tripped:
            if self._keeper is not None and not self._copying and watched and \
                    not self._rank.distributed and _kind(param_v) != "finite":
                # the loop may have changed the parameters itself: its pre-state is rebuilt
                self._last_applied = self.step_index
                self._record(batch, rng, read)
                self._fail_after_update(self.step_index, batch, rng)
            observed = self._confirm(loss_v if loss is not None else None, loss_v, norm_v,
                                     stalled, dev, applied)
            if observed is not None:
                self._fail_live(batch, rng, observed, scale, dev)
        if self._keeper is None:
            self._check_spike(batch, rng, loss_v if loss is not None else None)
        self._finish(batch, rng, read, skip)

    def _end_read(self, batch: Any, rng: RngState, loss: torch.Tensor | None) -> None:
        """The end of a step read before its update (`_before_update`)."""
        read, trip = self._read, self._trip
        self._value = read["loss"] if read["had_loss"] else None
        skip = read.get("skipped", 0) > 0
        if trip is not None and trip.get("rebuild"):
            self._fail_after_update(self._last_applied, batch, rng)
        if self._lookback is not None:
            self._lookback.end(self.step_index, rng, batch)
        if trip is not None:
            self._fail_live(batch, rng, trip["observed"], trip["scale"], trip["dev"])
        if not read["had_loss"] and loss is not None:
            # the loop set the loss after its update: read it now (one more synchronisation)
            with torch.no_grad():
                v = _loss_slot(loss, loss.device).item()
                bad = float(_kind(v) != "finite")
                bad = (_ranks_max(bad) if self._rank.distributed else bad) > 0
            self._value, read["loss"], read["had_loss"] = v, v, True
            self._add_history(read, skip)
            if bad:
                if not skip:
                    self._last_applied = self.step_index
                self._record(batch, rng, read)
                self._fail_after_update(self.step_index, batch, rng)
        self.scaler_skips = self.scaler_skips + 1 if skip else 0
        self._finish(batch, rng, read, skip)

    def _finish(self, batch: Any, rng: RngState, read: dict, skip: bool) -> None:
        """A step that did not fail: what the next ones need to know of it."""
        if not skip and self.task.optimizer is not None:
            self._last_applied = self.step_index
        self._record(batch, rng, read)
        if self._copying and self._keeper is not None and self._hook_seen:
            self._snapshot.release()     # the Task's optimizer step is seen: no copies now
        self.step_index += 1

    def _record(self, batch: Any, rng: RngState, read: dict) -> None:
        if self._keeper is not None:
            task = self.task
            # Lightning reads before it clips; a rebuild reads after the Task's clipping: only
            # the loss compares there
            grads = None if self._external and task.clip_grad_norm is not None else read["grads"]
            self._keeper.record(self.step_index, rng, task.optimizer, self._groups, batch,
                                read["loss"] if read.get("had_loss") else None, grads,
                                task.accumulate, task.loss_normalized)

    def _lost_hook(self) -> None:
        """A watched step whose gradients were finite and not skipped, and whose Task optimizer
        did not step: the loop left the update out, or updates some other way, unread. Said
        once; a NaN such an update makes is seen by the next reading and rebuilt."""
        if self._hook_lost:
            return
        self._hook_lost = True
        warnings.warn("Guard.watch: the loop did not call the Task's optimizer.step() in a "
                      f"guarded step (step {self.step_index}); an update made another way is not "
                      "read before it runs (a NaN it makes is seen by the next reading and "
                      "its step rebuilt through the Task)", RuntimeWarning, stacklevel=5)

    def _add_history(self, read: dict, skip: bool) -> None:
        if self._history is None:
            return
        lr = read.get("lr", self._lr)
        norm_v = read.get("grad_norm")
        self._history.add({
            "step": self.step_index, "loss": read["loss"] if read.get("had_loss") else None,
            "grad_norm": norm_v if norm_v is not None else read["grads"],
            "skipped": skip, "lr": float(lr) if isinstance(lr, (int, float)) else None})


