"""`Guard`: run training steps, and freeze the first non-finite one into a bundle.

Guarantees: `Guard.step` runs the Task's whole step (`nanbisect.step.run_step`: micro-batches,
scaler, clipping), the same code every replay runs; a failing step's bundle holds the state before
it (`nanbisect.guard.snapshot`, written by `nanbisect.guard.write`). A healthy step costs one
snapshot copy of the parameters, buffers and optimizer state (kept on their device), one norm per
parameter and per gradient from one pass over both, and one host synchronisation; exact checks run
only when that screen trips (`nanbisect.guard.screen`). Every bundle holds the last ``history``
steps' health (`nanbisect.history`); with ``lookback`` it holds the steps since a snapshot up to 2K
steps back (`nanbisect.bundle.lookback`); with ``spike`` a loss far above its recent history writes
a bundle and training goes on. A non-finite gradient becomes a non-finite parameter through the
update (caught, and classified as a gradient fault by the exact check); the gradients' global norm,
read in the same synchronisation, is their finiteness flag for the steps where it does not: with
parameters that moved (part of a non-finite update applied) a failure at once; with parameters that
did not move a skipped step (the declared GradScaler's skip; without one, whatever skipped it: a
scaler the loop keeps for itself, warned about once). A skipped step is normal; ``max_scaler_skips``
skips in a row is a failure (the scaler has stalled), bundled as the last skipped step
(``observed.undeclared_scaler`` when the Task declares no scaler: the report names the fix). With
``clip_grad_norm``, the gradients' kind (NaN or inf) is the one the total norm had before clipping
turned it into NaN. Under torch.distributed all ranks agree on a failure (one all-reduce of a
one-element flag per step: a rank's non-finite gradients trip every rank's exact check) and every
rank writes its part of one bundle, with what each collective of the failing step gave it
(`nanbisect.guard.tape`). Not guaranteed: custom loops (`Guard.watch`) are replayed through the
Task, not through the loop: what the loop does beyond the Task's fields is not in the bundle.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.lookback import Lookback
from nanbisect.bundle.state import RngState, accelerator_types, local
from nanbisect.errors import BadInput, NonFiniteStep
from nanbisect.guard.agree import write_timeout
from nanbisect.guard.coord import any_rank, broadcast_str, rank_info
from nanbisect.guard.entry import _check_out, resolve_entry_file
from nanbisect.guard.parts import held_ranks
from nanbisect.guard.screen import _bad_names, _kind, _listed, _step_norms
from nanbisect.guard.snapshot import _live_scale, _Snapshot, model_tensors
from nanbisect.guard.tape import record_step
from nanbisect.guard.write import _scaler_state, _write, write_or_rescue
from nanbisect.step import run_step
from nanbisect.task import Task, refuse_training_at_import
from nanbisect.util.text import exception_line


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
    ...     print(e.bundle.name, e.observed["first"])
    step000000 param
    """

    def __init__(self, task: Task, *, entry: str, out: str | Path, start_step: int = 0,
                 max_scaler_skips: int = 10, history: int | None = hist.DEFAULT_N,
                 lookback: int | None = None, lookback_on: str = "device",
                 spike: "float | Spike | None" = None, snapshot_stream: bool = True) -> None:
        refuse_training_at_import("Guard(...)")   # before `out` is made: nothing written
        if not isinstance(task, Task):
            raise BadInput(f"Guard: got a {type(task).__name__}, not a nanbisect.Task; pass "
                           "Task(model=..., optimizer=..., loss_fn=...)")
        self._entry_file = resolve_entry_file(entry)
        self.task, self.entry, self.out = task, entry, Path(out)
        _check_out(self.out)
        if max_scaler_skips < 1:
            raise BadInput(f"Guard(max_scaler_skips={max_scaler_skips}): give a count >= 1")
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
        self._warned_undeclared = False

    def step(self, batch: Any) -> float:
        """Run the Task's step (micro-batches, scaler, clipping, optimizer); return its loss
        (unscaled: the mean over micro-batches)."""
        task = self.task
        rng = self._begin()
        if task.optimizer is not None:
            task.optimizer.zero_grad(set_to_none=True)
        last = None
        for last in run_step(task, batch):
            pass
        self._end(batch, rng, last.total if last is not None else None,
                  grad_norm=last.grad_norm, skipped=last.skipped)
        return self._value

    @contextmanager
    def watch(self, batch: Any) -> Iterator[StepWatch]:
        """Guard a step that your own loop runs (forward, backward, optimizer step inside).

        The bundle replays through the Task (its loss_fn, scaler, clipping and accumulation),
        not through your loop: a loop that does more than the Task describes replays as
        ``replay-mismatch``.

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
        rng = self._begin()
        w = StepWatch(batch=batch)
        yield w
        self._value = None
        try:
            self._end(w.batch, rng, w.loss, watched=True)
        finally:
            w.value = self._value

    # -- the step's two halves -----------------------------------------------------------
    def _begin(self) -> RngState:
        rng = RngState.get(self._accel)
        task = self.task
        self._params, buffers = model_tensors(task.model)   # one walk of the module tree
        self._snapshot.take(task.model, task.optimizer, task.grad_scaler, self._params, buffers)
        if self._lookback is not None:
            self._lookback.begin(self.step_index, task.model, task.optimizer, task.grad_scaler)
        # the learning rate this step uses (a scheduler changes it after the step)
        self._lr = task.optimizer.param_groups[0].get("lr") if task.optimizer is not None and \
            task.optimizer.param_groups else None
        return rng

    def _end(self, batch: Any, rng: RngState, loss: torch.Tensor | None,
             grad_norm: torch.Tensor | None = None, skipped: torch.Tensor | None = None,
             watched: bool = False) -> None:
        """The step's screen, its history, and a failure bundled and raised (``watched``: the
        step of a `watch` block, else `step`'s)."""
        dev, scale, read, flag = self._read_screen(loss, grad_norm, skipped)
        loss_v, param_v, grads_v = read["loss"], read["screen"], read["grads"]
        norm_v, skip_v = read.get("grad_norm"), read.get("skipped")
        self._value = loss_v if loss is not None else None
        skip, applied = skip_v is not None and skip_v > 0, False
        if _kind(grads_v) != "finite" and _kind(param_v) == "finite" and \
                _kind(loss_v) == "finite":
            skip, applied = self._nonfinite_grads(skip, watched)
        if self._history is not None:
            lr = read.get("lr", self._lr)
            self._history.add({
                "step": self.step_index, "loss": self._value,
                "grad_norm": norm_v if norm_v is not None else grads_v,
                "skipped": skip, "lr": float(lr) if isinstance(lr, (int, float)) else None})
        if self._lookback is not None:
            self._lookback.end(self.step_index, rng, batch)
        self.scaler_skips = self.scaler_skips + 1 if skip else 0
        stalled = self.scaler_skips >= self.max_scaler_skips
        tripped = (flag > 0 if self._rank.distributed else
                   _kind(param_v) != "finite" or _kind(loss_v) != "finite" or stalled or applied)
        if not tripped:
            self._check_spike(batch, rng, loss_v if loss is not None else None)
            self.step_index += 1
            return
        observed = self._confirm(loss_v if loss is not None else None, loss_v, norm_v, stalled,
                                 dev, applied)
        if observed is None:
            self.step_index += 1
            return
        self._restore(scale)
        tape = self._record_tape(batch, rng, scale, dev) if self._rank.distributed else None
        path, error = self._write_failure(batch, rng, observed, tape)
        raise NonFiniteStep(path, observed, error,
                            ranks=held_ranks(path) if self._rank.distributed else None)

    def _nonfinite_grads(self, skipped: bool, watched: bool) -> tuple[bool, bool]:
        """The exact check of gradients the screen saw non-finite while loss and parameters are
        finite: (the step was skipped, a non-finite update was applied). With parameters that
        moved, something applied part of a non-finite update: a failure at once. With
        parameters that did not move, the step was skipped: a declared scaler says so itself
        (``skipped``); without one, whatever skipped it (a GradScaler the loop keeps for itself:
        warned about once). `step` without an optimizer skips nothing: a failure at once."""
        if not any(g is not None and not bool(torch.isfinite(local(g)).all())
                   for g in (p.grad for p in self._params)):
            return skipped, False     # the sum of squares overflowed on finite gradients
        if self._snapshot.moved() or (not watched and self.task.optimizer is None):
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
                     skipped: torch.Tensor | None
                     ) -> tuple[torch.device, torch.Tensor | None, dict, float]:
        """The screen of the step, read back in its one host synchronisation: (the device, the
        scaler's live scale, slot -> value, the ranks' failure flag (under torch.distributed)).
        Slots: the loss, the sum of the parameters' norms (the screen), the gradients' global
        norm (their finiteness flag), and what the step or the history adds."""
        self._snapshot.wait()     # a step without the Task's optimizer: its copies, before all
        params = self._params
        dev = local(params[0]).device if params else torch.device("cpu")
        scaler, scale = self.task.grad_scaler, _live_scale(self.task.grad_scaler)
        if skipped is None and scale is not None:
            # a loop of its own (watch): the scaler skipped when it backed its scale off
            before = (self._snapshot.scale if self._snapshot.scale is not None else
                      torch.full_like(scale, scaler._init_scale))
            skipped = (scale < before).float()
        with torch.no_grad():
            # per parameter its norm after the update (the screen) and its gradient's, in one
            # pass, written straight into the history's ring row when there is a history
            row = self._history.row(self.step_index, len(params), dev, lambda: [
                n for n, _ in self.task.model.named_parameters()]) \
                if self._history is not None else None
            norms = _step_norms(params, [p.grad for p in params], dev, out=row)
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
            flag = any_rank(flag.float().reshape(1).cpu() if self._rank.backend == "gloo"
                            else flag.float().reshape(1))
            vals = torch.cat([vals, flag.to(dev)])
        got = vals.tolist()
        return dev, scale, dict(zip(keys, got)), got[-1]

    def _confirm(self, loss: float | None, loss_v: float, grad_norm: float | None,
                 stalled: bool, dev: torch.device, applied: bool = False) -> dict | None:
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

    def _record_tape(self, batch: Any, rng: RngState, scale: torch.Tensor | None,
                     dev: torch.device):
        """Under torch.distributed: every rank runs the failing step once more, from the same
        pre-step state and RNG, keeping what each collective gave it (a replay of a few ranks
        serves it to them). None, on every rank, when any rank could not record it."""
        rng.set()
        tape, why = record_step(self.task, batch)
        self._restore(scale)
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

    def _check_spike(self, batch: Any, rng: RngState, loss: float | None) -> None:
        """A loss far above its recent history: write a bundle of the step, go on training."""
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
        self._snapshot.swap(opt)     # the live tensors hold the pre-step state while it writes
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
            self._snapshot.swap(opt)
        self.spikes.append(path)
        warnings.warn(f"Guard: loss spike at step {self.step_index} ({loss:.4g} against a median "
                      f"of {med:.4g}): wrote {path} (replay it with --reference); training goes "
                      "on", RuntimeWarning, stacklevel=4)

    def _restore(self, scale: torch.Tensor | None) -> None:
        """Back to the pre-step state (the scaler's too, on its first step)."""
        self._snapshot.restore(self.task.optimizer)
        scaler = self.task.grad_scaler
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
