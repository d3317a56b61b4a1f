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
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.lookback import Lookback
from nanbisect.bundle.state import (RngState, accelerator_types, decode, hyper_parameters,
                                    local)
from nanbisect.errors import BadInput, NonFiniteStep
from nanbisect.guard.agree import write_timeout
from nanbisect.guard.coord import any_rank, broadcast_str, rank_info
from nanbisect.guard.entry import _check_out, resolve_entry_file
from nanbisect.guard.parts import held_ranks
from nanbisect.guard.keep import RETRY_AFTER, Keeper, SnapshotFailed, reset_scaler_stage
from nanbisect.guard.screen import (_any_nonfinite, _bad_names, _kind, _listed, _norms,
                                    _step_norms)
from nanbisect.guard.snapshot import _live_scale, _Snapshot, model_tensors
from nanbisect.guard.tape import record_step
from nanbisect.guard.write import _scaler_state, _write, write_or_rescue
from nanbisect.step import found_inf, run_step
from nanbisect.task import Task, refuse_training_at_import
from nanbisect.util.text import clip, exception_line


@dataclass
class StepWatch:
    """Handle yielded by `Guard.watch`; set ``loss`` so the guard can check and record it.
    ``batch`` is what the bundle stores as the step's batch (the one given to ``watch``; a loop
    that learns its micro-batches as it goes may set it before the block ends)."""

    loss: torch.Tensor | None = None
    value: float | None = None
    batch: Any = None


@dataclass(frozen=True)
class Spike:
    """`Guard(spike=...)`: write a bundle (and go on training) when a step's loss lies
    ``threshold`` robust standard deviations above the median of the ``window`` steps before it
    (`nanbisect.history.jump_score`; at least 8 of them), at most ``max_bundles`` per run and
    not again until the loss has come back below the threshold."""

    threshold: float = 6.0
    window: int = hist.JUMP_WINDOW
    max_bundles: int = 3



def _declared_scaler(task: Task) -> bool:
    return task.grad_scaler is not None and task.grad_scaler.is_enabled()


def _loss_slot(loss: torch.Tensor | None, dev: torch.device) -> torch.Tensor:
    """[1]: the loss as the screen reads it (float32, summed when it is not one element), with
    no kernel when it already is one float32 element on ``dev``."""
    if loss is None:
        return torch.zeros(1, device=dev)
    t = local(loss)      # NB: called under no_grad: no detach needed
    if t.numel() != 1:
        t = t.float().sum()
    t = t.reshape(1)
    return t if t.dtype == torch.float32 and t.device == dev else \
        t.to(device=dev, dtype=torch.float32)


SNAPSHOT_MODES = ("rebuild", "every-step")


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


def _unavailable(why: str) -> dict:
    """``observed.rebuild`` of a step whose pre-state could not be rebuilt."""
    return {"from_step": None, "steps": 0, "fidelity": "unavailable", "max_rel_diff": None,
            "first_mismatch": None, "why": clip(why, 300)}


def drop_grads(opt) -> None:
    """Leave an optimizer's next update out: without gradients a torch optimizer skips every
    parameter (state, step counts and weight decay untouched)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def _ranks_max(v: float) -> float:
    """Under torch.distributed: the largest ``v`` of all ranks (one all-reduce, on the CPU for
    gloo, else on the accelerator the backend runs on)."""
    backend = rank_info().backend
    dev = "cpu" if backend == "gloo" or not torch.cuda.is_available() else "cuda"
    return any_rank(torch.tensor([float(v)], device=dev)).item()


def _agree_max(k: int) -> int:
    return int(_ranks_max(k))


class Guard:
    """Run training steps and freeze the first non-finite one into a bundle.

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
        if not isinstance(task, Task):
            raise BadInput(f"Guard: got a {type(task).__name__}, not a nanbisect.Task; pass "
                           "Task(model=..., optimizer=..., loss_fn=...)")
        self._entry_file = resolve_entry_file(entry)
        self.task, self.entry, self.out = task, entry, Path(out)
        _check_out(self.out)
        if max_scaler_skips < 1:
            raise BadInput(f"Guard(max_scaler_skips={max_scaler_skips}): give a count >= 1")
        if snapshot not in SNAPSHOT_MODES:
            raise BadInput(f"Guard(snapshot={snapshot!r}): give 'rebuild' (the default: no copy "
                           "of the state) or 'every-step' (an exact copy before every step)")
        if snapshot_every is not None and (type(snapshot_every) is not int or
                                           snapshot_every < 1):
            raise BadInput(f"Guard(snapshot_every={snapshot_every!r}): give a number of steps "
                           ">= 1 (None: chosen from the snapshot's cost)")
        self.max_scaler_skips = max_scaler_skips
        self.step_index = start_step
        self.scaler_skips = 0               # steps in a row the scaler skipped
        self._accel = accelerator_types()
        if not isinstance(snapshot_stream, bool):
            raise BadInput(f"Guard(snapshot_stream={snapshot_stream!r}): give True or False")
        self._snapshot = _Snapshot(side_stream=snapshot_stream)
        self._rank = rank_info()
        # read now: a bad NANBISECT_WRITE_TIMEOUT fails here, not when the bundle is written
        self._write_timeout = write_timeout() if self._rank.distributed else None
        self._sources = user_sources(self._entry_file)   # the code as training started
        if history is not None and (type(history) is not int or history < 0):
            raise BadInput(f"Guard(history={history!r}): give a number of steps (0 or None: "
                           "no history)")
        names = [n for n, _ in task.model.named_parameters()]
        self._history = hist.HealthLog(history, names) if history else None
        if self._rank.distributed and (lookback or spike):
            raise BadInput(f"Guard({'lookback' if lookback else 'spike'}=...) is not supported "
                           "under torch.distributed yet; drop it for a multi-rank job")
        self._lookback = Lookback(lookback, lookback_on) if lookback else None
        if spike is not None and not isinstance(spike, Spike):
            if isinstance(spike, bool) or not isinstance(spike, (int, float)) or spike <= 0:
                raise BadInput(f"Guard(spike={spike!r}): give a threshold > 0 (robust standard "
                               "deviations above the recent median) or nanbisect.Spike(...)")
            spike = Spike(threshold=float(spike))
        if spike is not None and self._history is None:
            raise BadInput("Guard(spike=...) needs the history it compares with; keep history "
                           "on (history=N)")
        self.spike = spike
        self.spikes: list[Path] = []        # the spike bundles written, oldest first
        self._in_spike = False
        self._lr: Any = None
        self._params: list[torch.nn.Parameter] = []   # the model's, read as each step begins
        self._buffers: list[torch.Tensor] = []
        self._warned_undeclared = False
        self._warned_snapshot = False
        opt = task.optimizer
        if snapshot == "rebuild" and opt is not None and \
                not isinstance(opt, torch.optim.Optimizer):
            warnings.warn(f"Guard: the Task's optimizer ({type(opt).__name__}) is not a "
                          "torch.optim.Optimizer: it has no step hook to read the step before "
                          "its update, so the whole state is copied before every step "
                          "(snapshot='every-step')", RuntimeWarning, stacklevel=2)
            snapshot = "every-step"
        self.snapshot = snapshot
        self._keeper: Keeper | None = None
        if snapshot == "rebuild":
            p = next(task.model.parameters(), None)
            on_host = p is None or local(p).device.type == "cpu"
            self._keeper = Keeper(every=snapshot_every, on_host=on_host,
                                  distributed=self._rank.distributed,
                                  agree=_agree_max if self._rank.distributed else None,
                                  agree_failed=(lambda bad: _ranks_max(float(bad)) > 0)
                                  if self._rank.distributed else None)
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
        self._hook = (opt.register_step_pre_hook(_pre_hook(self))
                      if self._keeper is not None and opt is not None else None)

    def step(self, batch: Any) -> float:
        """Run the Task's step (micro-batches, scaler, clipping, optimizer); return its loss
        (unscaled: the mean over micro-batches)."""
        task = self.task
        rng = self._begin(batch, watched=False)
        if task.optimizer is not None:
            task.optimizer.zero_grad(set_to_none=True)
        last = None
        before = self._before_update if self._keeper is not None else None
        try:
            for last in run_step(task, batch, before_update=before):
                pass
        except BaseException:
            self._open, self._step_batch = False, None
            raise
        self._end(batch, rng, last.total if last is not None else None,
                  grad_norm=last.grad_norm, skipped=last.skipped)
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
        except BaseException:
            self._open, self._watching = False, None
            raise
        self._value = None
        try:
            self._end(w.batch, rng, w.loss, watched=True)
        finally:
            w.value = self._value

    def close(self) -> None:
        """End guarding: read the last step's update (a fault born there is otherwise seen by
        the next step's reading, which never comes: raises `NonFiniteStep` for it), then drop
        the snapshot (its file too). The Guard can be used again afterwards."""
        keeper = self._keeper
        try:
            if keeper is not None and self._last_applied is not None and \
                    self._last_applied == self.step_index - 1:
                params = list(self.task.model.parameters())
                dev = local(params[0]).device if params else torch.device("cpu")
                screen = torch.linalg.vector_norm(_norms(params, dev)).item()
                bad = float(_kind(screen) != "finite" and _any_nonfinite(params))
                if (_ranks_max(bad) if self._rank.distributed else bad) > 0:
                    self._fail_after_update(self._last_applied)
        finally:
            if keeper is not None:
                keeper.close()
            self._last_applied = None

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
        (`_external`). A second call in a step reads nothing."""
        if not self._open or self._busy or self._keeper is None:
            return True
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

    def _fail_live(self, batch: Any, rng: RngState, observed: dict,
                   scale: torch.Tensor | None, dev: torch.device) -> None:
        """Bundle the step from the live state (its update never ran) and raise."""
        self._restore(scale)
        tape = self._record_tape(batch, rng, dev) if self._rank.distributed else None
        path, error = self._write_failure(batch, rng, observed, tape)
        raise NonFiniteStep(path, observed, error,
                            ranks=held_ranks(path) if self._rank.distributed else None)

    def _read_values(self, total: torch.Tensor | None) -> tuple[float | None, float]:
        """(the loss, the gradients' global norm) as `_read_screen` reads them, for a rebuild
        to compare with."""
        params = list(self.task.model.parameters())
        dev = local(params[0]).device if params else torch.device("cpu")
        with torch.no_grad():
            norms = _step_norms(params, [p.grad for p in params], dev)
            v = torch.cat([_loss_slot(total, dev), torch.linalg.vector_norm(norms, dim=1)])
            v = v.tolist()
        return (v[0] if total is not None else None), v[2]

    def _fail_after_update(self, step: int, batch: Any = None, rng: RngState | None = None
                           ) -> None:
        """A failure whose update ran (step ``step``'s: its parameters are not finite): rebuild
        its pre-state from the snapshot and the steps since, bundle it, raise. When no snapshot
        reaches it (or the model or optimizer changed since), the step in progress is bundled
        as it began instead (``batch``, ``rng``; the non-finite parameters are then its input),
        saying why."""
        task, keeper = self.task, self._keeper
        params = _bad_names([(n, p.data) for n, p in task.model.named_parameters()])
        if keeper is None:
            why = "the Guard keeps no snapshot"
        elif not keeper.can_rebuild(step):
            why = (f"no snapshot reaches step {step}" + (f" (the last could not be written: "
                                                          f"{keeper.failed})" if keeper.failed
                                                         else ""))
        else:
            why = keeper.unfit(task)
        if self._rank.distributed:    # every rank rebuilds, or none
            if _ranks_max(float(why is not None)) > 0 and why is None:
                why = "another rank could not rebuild"
        rec = None
        if why is None:
            self._busy = True
            try:
                rebuilt, rec = keeper.rebuild(task, step, self._read_values)
                rebuild = rebuilt.to_json()
                batch, rng = decode(rec.batch, rec.tensors), rec.rng
                self.step_index = step
                keeper.drop_from(step)
            except Exception as e:  # noqa: BLE001 - the failure is bundled all the same
                rec = None
                rebuild = _unavailable(f"the rebuild raised {exception_line(e)}: the state is "
                                       "where it stopped")
            finally:
                self._busy = False
        else:
            rebuild = _unavailable(why)
            if self._open or batch is not None:
                # the step in progress, as it began: buffers and scale back (its forward and
                # backward ran), its parameters the non-finite ones it was given
                self._restore(_live_scale(task.grad_scaler))
            else:      # `close`: no step in progress; the last step's batch stands in
                last = keeper.records[-1] if keeper is not None and keeper.records else None
                if last is not None:
                    batch, rng = decode(last.batch, last.tensors), last.rng
            rng = rng if rng is not None else RngState.get(self._accel)
        if self._history is not None:
            self._history.drop_from(self.step_index + 1)
        loss = rec.loss if rec is not None else None
        grads = rec.grad_norm if rec is not None else None
        loss_kind = _kind(loss) if loss is not None else "unknown"
        grads_kind = _kind(grads) if grads is not None else "unknown"
        params_kind = "nan" if params["nan"] else "inf" if params["inf"] else "finite"
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if grads_kind in ("nan", "inf") else
                 "param" if params_kind != "finite" else "other-rank")
        observed = {"step": self.step_index, "first": first,
                    "loss": loss if loss_kind not in ("nan", "inf") else loss_kind,
                    "summary": {"loss": loss_kind, "grads": grads_kind, "params": params_kind},
                    "nonfinite_grads": _listed({"nan": [], "inf": []}),
                    "nonfinite_params": _listed(params), "rebuild": rebuild}
        self._value = loss
        dev = local(next(task.model.parameters())).device if self._params else \
            torch.device("cpu")
        tape = self._record_tape(batch, rng, dev) if self._rank.distributed else None
        path, error = self._write_failure(batch, rng, observed, tape)
        raise NonFiniteStep(path, observed, error,
                            ranks=held_ranks(path) if self._rank.distributed else None)

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

    def _nonfinite_grads(self, skipped: bool, watched: bool) -> tuple[bool, bool]:
        """The exact check of gradients the screen saw non-finite while loss and parameters are
        finite: (the step was skipped, a non-finite update was applied). With parameters that
        moved, something applied part of a non-finite update: a failure at once. With
        parameters that did not move, the step was skipped: a declared scaler says so itself
        (``skipped``); without one, whatever skipped it (a GradScaler the loop keeps for itself:
        warned about once). `step` without an optimizer skips nothing: a failure at once."""
        if not _any_nonfinite(p.grad for p in self._params):
            return skipped, False     # the sum of squares overflowed on finite gradients
        moved = self._copying and self._snapshot.moved()
        if moved or (not watched and self.task.optimizer is None):
            return skipped, True
        if _declared_scaler(self.task):
            return skipped, False
        if not self._warned_undeclared:
            self._warned_undeclared = True
            warnings.warn(
                f"Guard: step {self.step_index} was skipped (its gradients are not finite "
                "and the parameters did not move) but the Task declares no GradScaler; "
                "if the loop scales its loss with one, declare it: Task(grad_scaler="
                f"scaler). {self.max_scaler_skips} skipped steps in a row are a failure "
                "(a stalled scaler)", RuntimeWarning, stacklevel=5 if watched else 4)
        return True, False

    def _read_screen(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
                     skipped: torch.Tensor | None, before: bool = False
                     ) -> tuple[torch.device, torch.Tensor | None, dict, list[float]]:
        """The screen of the step, read back in its one host synchronisation: (the device, the
        scaler's live scale, slot -> value, the ranks' failure flag (under torch.distributed)).
        Slots: the loss, the sum of the parameters' norms (the screen), the gradients' global
        norm (their finiteness flag), and what the step or the history adds. ``before``: read
        just before the update (the parameters are the step's pre-state: they are the previous
        step's "after" in the history); the flag is [a failure, a failure whose update ran].
        """
        self._snapshot.wait()     # a step without the Task's optimizer: its copies, before all
        params = self._params
        dev = local(params[0]).device if params else torch.device("cpu")
        scaler, scale = self.task.grad_scaler, _live_scale(self.task.grad_scaler)
        if skipped is None and scale is not None and not before:
            # a loop of its own (watch): the scaler skipped when it backed its scale off
            began = (self._snapshot.scale if self._snapshot.scale is not None else
                     torch.full_like(scale, scaler._init_scale))
            skipped = (scale < began).float()
        with torch.no_grad():
            # per parameter its norm after the update (the screen) and its gradient's, in one
            # pass, written straight into the history's ring row when there is a history
            row = self._history.row(self.step_index, len(params), dev, lambda: [
                n for n, _ in self.task.model.named_parameters()]) \
                if self._history is not None else None
            norms = _step_norms(params, [p.grad for p in params], dev, out=row)
            if row is not None:
                prev = self._prev_row
                if before and prev is not None and prev[0] == self.step_index - 1:
                    prev[1][0].copy_(row[0])    # the previous step's parameters after its update
                self._prev_row = (self.step_index, row) if before else None
            # [the parameters' screen, the gradients' global norm] in one kernel: each is
            # non-finite iff some norm is (or the sum of squares overflows: the exact check
            # clears it); the global norm is the gradients' finiteness flag
            parts = [_loss_slot(loss, dev), torch.linalg.vector_norm(norms, dim=1)]
            keys = ["loss", "screen", "grads"]
            for key, t in (("grad_norm", grad_norm), ("skipped", skipped)):
                if t is not None:
                    parts.append(t.detach().float().reshape(1).to(dev))
                    keys.append(key)
            if self._history is not None and isinstance(self._lr, torch.Tensor):
                parts.append(self._lr.detach().float().reshape(1).to(dev))
                keys.append("lr")
            vals = torch.cat(parts)      # one kernel: every slot in one tensor, read at once
        # NB: a non-finite gradient reaches the parameters through any update with lr > 0; one
        # that does not (the step was skipped) is checked exactly on the host (`_end`).
        # The one host synchronisation of a healthy step (under torch.distributed, after one
        # all-reduce of a one-element flag, so that all ranks agree on a failure):
        stall_next = self.scaler_skips + 1 >= self.max_scaler_skips
        if self._rank.distributed:
            flag = (~torch.isfinite(vals[:3])).any()
            if skipped is not None and stall_next:
                flag = flag | (skipped.reshape(()).to(dev) > 0)
            # a failure whose update ran: parameters no longer finite after an update
            ran = (~torch.isfinite(vals[1])) if before and self._last_applied is not None \
                else torch.zeros((), dtype=torch.bool, device=dev)
            # the kept steps past their share on some rank: a snapshot on every rank
            over = torch.tensor(before and self._keeper is not None and
                                self._keeper.over_share(), device=dev)
            flag = torch.stack([flag, ran, over]).float()
            flag = any_rank(flag.cpu() if self._rank.backend == "gloo" else flag)
            vals = torch.cat([vals, flag.to(dev)])
            got = vals.tolist()
            out = dict(zip(keys, got[:-3]))
            out["over"] = got[-1] > 0
            return dev, scale, out, got[-3:-1]
        got = vals.tolist()
        return dev, scale, dict(zip(keys, got)), [0.0, 0.0]

    def _confirm(self, loss: float | None, loss_v: float, grad_norm: float | None,
                 stalled: bool, dev: torch.device, applied: bool = False,
                 before: bool = False) -> dict | None:
        """The exact check of a tripped screen: what was observed, or None when it clears (the
        screen overflowed on finite values; under torch.distributed, no rank confirms it)."""
        observed = self._observe(loss, grad_norm, stalled, applied)
        if self._rank.distributed:  # does any rank confirm it with the exact check?
            confirmed = any_rank(torch.tensor(
                [float(observed is not None)],
                device="cpu" if self._rank.backend == "gloo" else dev))
            if confirmed.item() == 0:
                return None
            observed = observed or {"step": self.step_index, "first": "other-rank",
                                    "loss": loss_v, "summary": {"local": "finite"}}
        return observed     # None: the screen overflowed on finite values

    def _record_tape(self, batch: Any, rng: RngState, dev: torch.device):
        """Under torch.distributed: every rank runs the failing step once more, from the same
        pre-step state and RNG, keeping what each collective gave it (a replay of a few ranks
        serves it to them); the state is put back after it (from the whole-state copy, or from
        a snapshot of it taken now, off the device). None, on every rank, when any rank could
        not record it."""
        keeper, task = self._keeper, self.task
        copied = self._copying or keeper is None
        ok = True
        if not copied:     # the state to put back after the recording, off the device
            try:
                keeper.take(self.step_index, task.model, task.optimizer, _scaler_state(task), {})
            except SnapshotFailed as e:
                ok, why = False, f"its state could not be kept aside: {e}"
        if _ranks_max(float(not ok)) > 0:    # every rank records, or none
            warnings.warn("Guard: the failing step's collectives were not recorded ("
                          f"{why if not ok else 'another rank could not keep its state aside'}"
                          "); the bundle replays all ranks only (no --ranks)", RuntimeWarning,
                          stacklevel=4)
            return None
        scale = _live_scale(task.grad_scaler)
        pre_scale = None if scale is None else scale.clone()
        rng.set()
        self._busy = True
        try:
            tape, why = record_step(task, batch)
        finally:
            self._busy = False
        if copied:
            self._restore(scale)
        else:
            keeper.restore(task)
            if pre_scale is not None and task.grad_scaler._scale is not None:
                task.grad_scaler._scale.copy_(pre_scale)
            reset_scaler_stage(task.grad_scaler)
        lost = any_rank(torch.tensor([float(tape is None)], device=(
            "cpu" if self._rank.backend == "gloo" else dev)))
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
        path = self._free_path()
        if self._rank.distributed:
            path = Path(broadcast_str(str(path)))
            observed["rank"] = self._rank.rank
        # the hashes read when training started win: a file edited since is not what ran
        sources = {**user_sources(self._entry_file), **self._sources}
        write = partial(_write, self.task, batch, rng, entry=self.entry,
                        entry_file=self._entry_file, step=self.step_index, observed=observed,
                        sources=sources, scaler_state=_scaler_state(self.task), unique=True,
                        tape=tape, history=self._history, lookback=self._lookback,
                        write_timeout=self._write_timeout)
        return write_or_rescue(write, path, self.out, distributed=self._rank.distributed)

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

    def _restore(self, scale: torch.Tensor | None) -> None:
        """Back to the pre-step state (the scaler's too, on its first step): from the whole-state
        copy, or (the update never ran) the buffers' and the scaler's."""
        if self._copying:
            self._snapshot.restore(self.task.optimizer)
        else:
            self._snapshot.restore_early(self.task.optimizer)
        scaler = self.task.grad_scaler
        reset_scaler_stage(scaler)
        if scale is not None and self._snapshot.scale is None:   # the scaler's first step
            scale.fill_(scaler._init_scale)
            scaler._growth_tracker.zero_()

    def _observe(self, loss: float | None, grad_norm: float | None,
                 stalled: bool = False, applied: bool = False) -> dict | None:
        named = list(self.task.model.named_parameters())
        grads = _bad_names([(n, p.grad) for n, p in named if p.grad is not None])
        params = _bad_names([(n, p.data) for n, p in named])
        loss_kind = _kind(loss) if loss is not None else "unknown"
        if loss_kind not in ("nan", "inf") and not any(params.values()) and not stalled \
                and not applied:
            return None  # loss, parameters and skips decide; gradients say where it came from
        grads_kind = "nan" if grads["nan"] else "inf" if grads["inf"] else "finite"
        if grad_norm is not None and _kind(grad_norm) != "finite":
            # clipping multiplied the gradients by max_norm / norm: an inf gradient became NaN.
            # The norm before clipping has the kind the gradients had after backward.
            grads_kind = _kind(grad_norm)
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if grads_kind != "finite" else "scaler" if stalled else "param")
        summary = {"loss": loss_kind, "grads": grads_kind,
                   "params": "nan" if params["nan"] else "inf" if params["inf"] else "finite"}
        out = {"step": self.step_index, "first": first,
               "loss": loss if loss_kind not in ("nan", "inf") else loss_kind,
               "summary": summary, "nonfinite_grads": _listed(grads),
               "nonfinite_params": _listed(params)}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm if _kind(grad_norm) == "finite" else _kind(grad_norm)
        if stalled:
            out["scaler_skips"] = self.scaler_skips
            if not _declared_scaler(self.task):
                # skipped by what the Task does not know of: the note names the fix
                out["undeclared_scaler"] = True
        return out

    def _free_path(self, suffix: str = "") -> Path:
        base = self.out / f"step{self.step_index:06d}{suffix}"
        path, i = base, 1
        while path.exists():
            path, i = base.with_name(f"{base.name}-{i}"), i + 1
        return path
