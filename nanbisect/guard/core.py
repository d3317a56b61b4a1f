"""`Guard`: run training steps, and freeze the first non-finite one into a bundle.

Guarantees: `Guard.step` runs the Task's whole step (`nanbisect.step.run_step`: micro-batches,
scaler, clipping), the same code every replay runs; a failing step's bundle holds the state before
it (written by `nanbisect.guard.freeze`). A step is read once, just before its update (after
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
one bundle, with what each collective of the failing step gave it (`nanbisect.guard.retape`).
`close` reads the last step's update and drops the snapshot. Not guaranteed: custom loops
(`Guard.watch`) are replayed through the Task, not through the loop: what the loop does beyond
the Task's fields is not in the bundle.

The Guard runs the step's two halves itself and owns three collaborators, each holding its own
state: its `Reader` (`nanbisect.guard.reading`), its `Failures` (`nanbisect.guard.failing`) and
its `Spikes` (`nanbisect.guard.spikes`); what they share is one `Guarded` and one `Progress`
(`nanbisect.guard.guarded`).
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
from nanbisect.guard.coord import rank_info, ranks_max
from nanbisect.guard.deadline import RankTimeout, rank_timeout
from nanbisect.guard.entry import (check_modes, check_out, resolve_entry_file, warn_foreign_parts,
                                    warn_top_level)
from nanbisect.guard.failing import Failures
from nanbisect.guard.guarded import Guarded, Progress
from nanbisect.guard.keep import RETRY_AFTER, Keeper, SnapshotFailed
from nanbisect.guard.reading import Reader, declared_scaler
from nanbisect.guard.screen import any_nonfinite, tensor_norms, value_kind
from nanbisect.guard.snapshot import Snapshot, model_tensors
from nanbisect.guard.spikes import Spike, Spikes, lookback_and_spike
from nanbisect.guard.freeze import scaler_state
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
    parameter (state, step counts and weight decay untouched). An optimizer that gives its
    parameters their gradients inside its own step (an engine's, e.g.
    `nanbisect.integrations.deepspeed.EngineOptimizer`) says so with a ``drop_update()``
    method, called too."""
    later = getattr(opt, "drop_update", None)
    if callable(later):
        later()
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


class Guard:
    """Run training steps and freeze the first non-finite one into a bundle.

    ``entry`` names the function that returns the Task, as a replay imports it (a file or a
    module; never ``__main__``: refused, with the fix, docs/guide/guard.md). ``start_step`` is
    the index of the first step run (a resumed run's global step): steps are counted from it
    and bundles are named by it (``out/step{N:06d}``).

    What an integration (`nanbisect.integrations`) uses besides `step`, `watch` and `close`:
    `integrate` (once, before the first step) and `before_update` (the step's reading at the
    framework's own point, just before its optimizer updates).

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
        entry_file = resolve_entry_file(entry)
        warn_top_level(entry_file, task, "Guard")
        warn_foreign_parts(entry, task, "Guard")
        out = Path(out)
        check_out(out)
        check_modes(max_scaler_skips, snapshot, snapshot_every, snapshot_stream)
        accel = accelerator_types()
        snap = Snapshot(side_stream=snapshot_stream)
        rank = rank_info()
        # read now: a bad NANBISECT_WRITE_TIMEOUT fails here, not when the bundle is written
        timeout = write_timeout() if rank.distributed else None
        if rank.distributed:
            rank_timeout()      # a bad NANBISECT_RANK_TIMEOUT fails here, not at the NaN
        sources = user_sources(entry_file)   # the code as training started
        if history is not None and (type(history) is not int or history < 0):
            raise BadInput(f"Guard(history={history!r}): give a number of steps (0 or None: "
                           "no history)")
        names = [n for n, _ in task.model.named_parameters()]
        health = hist.HealthLog(history, names) if history else None
        kept, spike = lookback_and_spike(lookback, lookback_on, spike, rank.distributed,
                                         health is not None)
        self._guarded = Guarded(task=task, entry=entry, entry_file=entry_file, out=out,
                                sources=sources, rank=rank, accel=accel, write_timeout=timeout,
                                max_scaler_skips=max_scaler_skips, history=health,
                                lookback=kept, snapshot=snap)
        self._progress = Progress(step_index=start_step)
        self._reader = Reader(self._guarded, self._progress)
        self._failures = Failures(self._guarded, self._progress, self._reader)
        self._spikes = Spikes(self._guarded, self._progress, spike)
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
        self._guarded.keeper = self._make_keeper(snapshot_every) if snapshot == "rebuild" \
            else None
        self._hook = (opt.register_step_pre_hook(_pre_hook(self))
                      if self._keeper is not None and opt is not None else None)

    # -- what the Guard was given, and where its run stands ------------------------------
    @property
    def task(self) -> Task:
        return self._guarded.task

    @property
    def entry(self) -> str:
        return self._guarded.entry

    @property
    def out(self) -> Path:
        return self._guarded.out

    @property
    def max_scaler_skips(self) -> int:
        return self._guarded.max_scaler_skips

    @max_scaler_skips.setter
    def max_scaler_skips(self, value: int) -> None:     # settable, as before the collaborators
        self._guarded.max_scaler_skips = value

    @property
    def spike(self) -> Spike | None:
        return self._spikes.spike

    @spike.setter
    def spike(self, value: Spike | None) -> None:
        self._spikes.spike = value

    @property
    def spikes(self) -> list[Path]:
        """The spike bundles written, oldest first."""
        return self._spikes.written

    @property
    def step_index(self) -> int:
        """The index of the step in progress, or of the next one."""
        return self._progress.step_index

    @step_index.setter
    def step_index(self, value: int) -> None:
        self._progress.step_index = value

    @property
    def scaler_skips(self) -> int:
        """Steps in a row the scaler skipped."""
        return self._progress.scaler_skips

    @scaler_skips.setter
    def scaler_skips(self, value: int) -> None:
        self._progress.scaler_skips = value

    # (the tests and scripts/bench_guard.py look at these)
    @property
    def _keeper(self) -> Keeper | None:
        return self._guarded.keeper

    @property
    def _history(self) -> hist.HealthLog | None:
        return self._guarded.history

    @property
    def _snapshot(self) -> Snapshot:
        return self._guarded.snapshot

    def _make_keeper(self, every: int | None) -> Keeper:
        """The rebuild mode's keeper: its snapshot in a file when the model lives in host memory,
        else in (pinned) host memory; under torch.distributed, K and failures agreed."""
        p = next(self.task.model.parameters(), None)
        on_host = p is None or devices.on_host(local(p).device)
        distributed = self._guarded.rank.distributed
        return Keeper(every=every, on_host=on_host, distributed=distributed,
                      agree=(lambda k: int(ranks_max(k))) if distributed else None,
                      agree_failed=(lambda bad: ranks_max(float(bad)) > 0)
                      if distributed else None)

    def _init_state(self) -> None:
        """What the Guard itself knows of the step in progress, as nothing ran yet."""
        self._warned_snapshot = False
        self._watching: StepWatch | None = None
        self._external = False      # an integration reads the step itself (`before_update`)
        self._read: dict | None = None     # the step's reading, once read
        self._trip: dict | None = None     # a failure seen before the update
        self._hook_seen = False     # the Task's optimizer step was seen inside a watched step
        self._hook_lost = False     # a watched loop stepped without the Task's optimizer (said)
        self._groups: list[dict] | None = None
        self._step_batch: Any = None
        self._step_rng: RngState | None = None

    def integrate(self, *, reads_update: bool = False) -> None:
        """For an integration, once, before its first step: its framework steps the Task's
        optimizer every step (a watched step needs no whole-state copy, not even the first);
        ``reads_update``: it calls `before_update` itself, at its own point (the optimizer's
        step pre-hook then reads nothing)."""
        self._hook_seen = True
        if reads_update:
            self._external = True

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
                self._progress.open, self._step_batch = False, None
                raise
            self._end(batch, rng, last.total if last is not None else None,
                      grad_norm=last.grad_norm, skipped=last.skipped)
        except RankTimeout as e:     # a rank did not meet the Guard's wait: never a hang
            self._watching = None
            self._failures.alone(batch, rng, e)
        return self._progress.value

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
            self._watching = None
            self._failures.alone(w.batch, rng, e)
        except BaseException:
            self._progress.open, self._watching = False, None
            raise
        self._progress.value = None
        try:
            self._end(w.batch, rng, w.loss, watched=True)
        except RankTimeout as e:
            self._watching = None
            self._failures.alone(w.batch, rng, e)
        finally:
            w.value = self._progress.value

    def before_update(self, total: torch.Tensor | None = None,
                      grad_norm: torch.Tensor | None = None,
                      skipped: torch.Tensor | None = None) -> bool:
        """For an integration that knows the point itself (`integrate` with ``reads_update``):
        read the step of the open `watch` block just before its optimizer updates; False: the
        step failed, leave the update out (`drop_grads`; it is bundled when the block ends). It
        never raises through the framework (a rank that does not meet the reading's agreement
        is written alone at the block's end); a second call in a step reads nothing."""
        return self._before_update(total, grad_norm, skipped)

    def close(self) -> None:
        """End guarding: read the last step's update (a fault born there is otherwise seen by
        the next step's reading, which never comes: raises `NonFiniteStep` for it, once: a
        failure already raised is not raised again), then drop the snapshot (its file too).
        Idempotent: a second call does nothing; it raises nothing but `NonFiniteStep`. The
        Guard can be used again afterwards."""
        g, p = self._guarded, self._progress
        keeper = g.keeper
        try:
            if keeper is not None and p.last_applied is not None and \
                    p.last_applied == p.step_index - 1:
                params = list(self.task.model.parameters())
                dev = local(params[0]).device if params else devices.HOST
                screen = torch.linalg.vector_norm(tensor_norms(params, dev)).item()
                bad = float(value_kind(screen) != "finite" and any_nonfinite(params))
                try:
                    bad = ranks_max(bad) if g.rank.distributed else bad
                except RankTimeout as e:    # the ranks cannot agree: this rank's own reading
                    if bad > 0:
                        self._watching = None
                        self._failures.alone(None, None, e)
                    warnings.warn(f"Guard.close: {e}", RuntimeWarning, stacklevel=2)
                    bad = 0.0
                if bad > 0:
                    try:
                        self._failures.after_update(p.last_applied)
                    except RankTimeout as e:   # the rebuild's agreement or its steps
                        self._watching = None
                        self._failures.alone(None, None, e)
        finally:
            p.last_applied = None
            if keeper is not None:
                try:
                    keeper.close()
                except Exception as e:  # noqa: BLE001 - a snapshot's leftovers harm nobody
                    warnings.warn(f"Guard.close: the snapshot could not be dropped ({e})",
                                  RuntimeWarning, stacklevel=2)

    # -- the step's two halves -----------------------------------------------------------
    def _begin(self, batch: Any, watched: bool) -> RngState:
        g, p = self._guarded, self._progress
        rng = RngState.get(g.accel)
        self._step_batch, self._step_rng = batch, rng
        task = self.task
        p.params, p.buffers = model_tensors(task.model)   # one walk of the tree
        self._read, self._trip, self._watching = None, None, None
        p.copying = g.keeper is None or (watched and not self._hook_seen)
        if p.copying:
            g.snapshot.take(task.model, task.optimizer, task.grad_scaler, p.params, p.buffers)
        else:
            g.snapshot.take_early(task.optimizer, task.grad_scaler, p.buffers)
            g.keeper.tick()
        if g.lookback is not None:
            g.lookback.begin(p.step_index, task.model, task.optimizer, task.grad_scaler)
        # the learning rate this step uses (a scheduler changes it after the step)
        p.lr = task.optimizer.param_groups[0].get("lr") if task.optimizer is not None and \
            task.optimizer.param_groups else None
        # (a tensor learning rate cloned: a scheduler may change it in place later in the step)
        self._groups = ([{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                          for k, v in grp.items()} for grp in hyper_parameters(task.optimizer)]
                        if g.keeper is not None and task.optimizer is not None else None)
        p.open = True
        return rng

    def _before_update(self, total: torch.Tensor | None = None,
                       grad_norm: torch.Tensor | None = None,
                       skipped: torch.Tensor | None = None) -> bool:
        """The step's one reading, just before its update: False leaves the update out (a
        failure, bundled at the step's end from the live tensors). Called by `run_step`, by
        the step pre-hook of `Guard.watch`, or by an integration that knows the point itself
        (`before_update`). A second call in a step reads nothing. A rank that does not meet the
        reading's agreement leaves the update out too, and the step's end writes this rank's
        part alone (never an exception through the caller's optimizer or trainer)."""
        p = self._progress
        if not p.open or p.busy or self._keeper is None:
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
        g, p = self._guarded, self._progress
        if self._read is not None:     # read already: a second update waits on the first's fate
            return self._trip is None
        if self._watching is not None:
            total = self._watching.loss
            if skipped is None and declared_scaler(self.task) and \
                    self.task.optimizer is not None:
                skipped = found_inf(self.task.grad_scaler, self.task.optimizer)
        dev, scale, read, flag = self._reader.read_screen(total, grad_norm, skipped, before=True)
        read["had_loss"] = total is not None
        self._read = read
        if self._watching is not None:
            self._hook_seen = True
        loss_v, param_v, grads_v = read["loss"], read["screen"], read["grads"]
        skip = read.get("skipped", 0) > 0
        stalled = skip and p.scaler_skips + 1 >= g.max_scaler_skips
        if g.rank.distributed:
            tripped, rebuild = flag[0] > 0, flag[1] > 0
        else:
            rebuild = value_kind(param_v) != "finite" and p.last_applied is not None
            tripped = (value_kind(loss_v) != "finite" or value_kind(param_v) != "finite" or
                       stalled or (value_kind(grads_v) != "finite" and not skip) or
                       value_kind(read.get("buffers", 0.0)) != "finite")
        if rebuild:     # exactly: the screen's sum of squares overflows on large finite values
            bad = float(any_nonfinite(p.params))
            rebuild = (ranks_max(bad) if g.rank.distributed else bad) > 0
        self._add_history(read, skip)
        if not tripped:
            self._keep(skip)
            batch = self._watching.batch if self._watching is not None else self._step_batch
            self._spikes.check_before(read, batch, self._step_rng)
            return True
        if rebuild:
            self._trip = {"rebuild": True}
            return False
        # gradients the update would apply: checked exactly (the sum of squares can overflow)
        applied = value_kind(grads_v) != "finite" and not skip and \
            any_nonfinite(q.grad for q in p.params)
        if stalled:
            p.scaler_skips += 1      # this skip counts in what is observed
        observed = self._reader.confirm(loss_v if total is not None else None, loss_v,
                                        read.get("grad_norm"), stalled, dev, applied)
        if stalled:
            p.scaler_skips -= 1
        if observed is None:    # the screen overflowed on finite values
            self._keep(skip)
            return True
        self._trip = {"observed": observed, "scale": scale, "dev": dev}
        return False

    def _keep(self, skip: bool) -> None:
        """A clean reading before the update: the snapshot, when one is due, from the live
        state (the update has not run) and the buffers as the step began."""
        g, p = self._guarded, self._progress
        keeper = g.keeper
        if keeper is None or not keeper.due(p.step_index, self.task.optimizer,
                                            over=self._read.get("over")):
            return
        task = self.task
        try:
            keeper.take(p.step_index, task.model, task.optimizer, scaler_state(task),
                        g.snapshot.early_copies(p.buffers))
        except SnapshotFailed as e:
            if not self._warned_snapshot:
                self._warned_snapshot = True
                warnings.warn(f"Guard: could not write the snapshot of step {p.step_index} "
                              f"({e}); training goes on, tried again every {RETRY_AFTER} steps "
                              "(a NaN born in an update is rebuilt from the last snapshot that "
                              "was written, or bundled as the state after it)",
                              RuntimeWarning, stacklevel=5)

    def _end(self, batch: Any, rng: RngState, loss: torch.Tensor | None,
             grad_norm: torch.Tensor | None = None, skipped: torch.Tensor | None = None,
             watched: bool = False) -> None:
        """The step's end: its reading (when nothing read it before the update), its history,
        and a failure bundled and raised (``watched``: the step of a `watch` block)."""
        g, p = self._guarded, self._progress
        p.open, self._watching = False, None
        self._step_batch = self._step_rng = None     # not held past the step
        if self._trip is not None and "unmet" in self._trip:   # the reading's agreement
            self._failures.alone(batch, rng, self._trip["unmet"])
        if self._read is not None:
            self._end_read(batch, rng, loss)
            return
        dev, scale, read, flag = self._reader.read_screen(loss, grad_norm, skipped)
        loss_v, param_v, grads_v = read["loss"], read["screen"], read["grads"]
        norm_v, skip_v = read.get("grad_norm"), read.get("skipped")
        p.value = loss_v if loss is not None else None
        skip, applied = skip_v is not None and skip_v > 0, False
        if value_kind(grads_v) != "finite" and value_kind(param_v) == "finite" and \
                value_kind(loss_v) == "finite":
            skip, applied = self._reader.nonfinite_grads(skip, watched)
        elif g.keeper is not None and watched and self.task.optimizer is not None and \
                not skip and value_kind(grads_v) == "finite" and \
                any(q.grad is not None for q in p.params):
            self._lost_hook()
        read["had_loss"] = loss is not None
        self._add_history(read, skip)
        if g.lookback is not None:
            g.lookback.end(p.step_index, rng, batch)
        p.scaler_skips = p.scaler_skips + 1 if skip else 0
        stalled = p.scaler_skips >= g.max_scaler_skips
        tripped = (flag[0] > 0 if g.rank.distributed else
                   value_kind(param_v) != "finite" or value_kind(loss_v) != "finite" or
                   stalled or applied or value_kind(read.get("buffers", 0.0)) != "finite")
        if tripped:
            if g.keeper is not None and not p.copying and watched and \
                    not g.rank.distributed and value_kind(param_v) != "finite":
                # the loop may have changed the parameters itself: its pre-state is rebuilt
                p.last_applied = p.step_index
                self._record(batch, rng, read)
                self._failures.after_update(p.step_index, batch, rng)
            observed = self._reader.confirm(loss_v if loss is not None else None, loss_v,
                                            norm_v, stalled, dev, applied)
            if observed is not None:
                self._failures.live(batch, rng, observed, scale, dev)
        if g.keeper is None:
            self._spikes.check(batch, rng, loss_v if loss is not None else None)
        self._finish(batch, rng, read, skip)

    def _end_read(self, batch: Any, rng: RngState, loss: torch.Tensor | None) -> None:
        """The end of a step read before its update (`_before_update`)."""
        g, p = self._guarded, self._progress
        read, trip = self._read, self._trip
        p.value = read["loss"] if read["had_loss"] else None
        skip = read.get("skipped", 0) > 0
        if trip is not None and trip.get("rebuild"):
            self._failures.after_update(p.last_applied, batch, rng)
        if g.lookback is not None:
            g.lookback.end(p.step_index, rng, batch)
        if trip is not None:
            self._failures.live(batch, rng, trip["observed"], trip["scale"], trip["dev"])
        if not read["had_loss"] and loss is not None:
            # the loop set the loss after its update: read it now (one more synchronisation)
            v = self._reader.late_loss(loss)
            bad = float(value_kind(v) != "finite")
            bad = (ranks_max(bad) if g.rank.distributed else bad) > 0
            p.value, read["loss"], read["had_loss"] = v, v, True
            self._add_history(read, skip)
            if bad:
                if not skip:
                    p.last_applied = p.step_index
                self._record(batch, rng, read)
                self._failures.after_update(p.step_index, batch, rng)
        p.scaler_skips = p.scaler_skips + 1 if skip else 0
        self._finish(batch, rng, read, skip)

    def _finish(self, batch: Any, rng: RngState, read: dict, skip: bool) -> None:
        """A step that did not fail: what the next ones need to know of it."""
        g, p = self._guarded, self._progress
        if not skip and self.task.optimizer is not None:
            p.last_applied = p.step_index
        self._record(batch, rng, read)
        if p.copying and g.keeper is not None and self._hook_seen:
            g.snapshot.release()     # the Task's optimizer step is seen: no copies now
        p.step_index += 1

    def _record(self, batch: Any, rng: RngState, read: dict) -> None:
        keeper = self._guarded.keeper
        if keeper is not None:
            task = self.task
            # Lightning reads before it clips; a rebuild reads after the Task's clipping: only
            # the loss compares there
            grads = None if self._external and task.clip_grad_norm is not None else read["grads"]
            keeper.record(self._progress.step_index, rng, task.optimizer, self._groups, batch,
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
        history = self._guarded.history
        if history is None:
            return
        lr = read.get("lr", self._progress.lr)
        norm_v = read.get("grad_norm")
        history.add({
            "step": self._progress.step_index,
            "loss": read["loss"] if read.get("had_loss") else None,
            "grad_norm": norm_v if norm_v is not None else read["grads"],
            "skipped": skip, "lr": float(lr) if isinstance(lr, (int, float)) else None})
