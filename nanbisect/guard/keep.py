"""The default Guard's way back to a step's pre-state without a copy of the state on its device:
a snapshot every K steps, off the device, and the steps since, replayed (issue 40).

Guarantees: `Keeper.take` stores the parameters, buffers, optimizer state, module modes and the
GradScaler's state of a step that began with finite parameters: in a file under the system's
temporary directory when the state lives in host memory (the CPU: a copy in memory would double
it), else in host memory (pinned, copied without a host synchronisation on the device's stream,
so it is complete before the optimizer changes the state). Each later step's RNG, hyper-parameters,
batch (a copy: a loop may refill its buffer), loss and gradient norm are kept (`record`).
`rebuild` restores the snapshot into the live model and optimizer and replays the kept steps
through the Task's step (`nanbisect.step.run_step`) up to a given step, then that step's forward
and backward alone, comparing each step's loss and gradient norm with what the Guard read while
training: ``bit-exact``, ``within-tolerance`` (relative difference at most `TOLERANCE`) or
``mismatch`` (what the loop did outside the Task, an edit of the weights between steps, a thread
count the kernels depend on). K is chosen so that a snapshot's cost, amortised, stays under
`BUDGET` of a step (``Guard(snapshot_every=K)`` fixes it); under torch.distributed every rank
snapshots at the same steps (one all-reduce of K, once). Memory: the kept steps' batches and RNG
states, at most `RECORD_SHARE` of the state's bytes: copies beyond it are written to a file by a
thread of their own (`nanbisect.guard.spill`), up to `SPILL_SHARE` of the state's bytes on disk;
past those, or RNG states past the share, a snapshot is taken sooner.
Not guaranteed: state outside the model, the optimizer and the scaler (a scheduler's, a data
loader's); a rebuild needs every step since the snapshot to replay as it ran.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nanbisect import devices
from nanbisect.bundle.lookback import Snap
from nanbisect.bundle.state import (RngState, Tensors, decode, encode, encode_model,
                                    encode_optimizer, hyper_parameters, local, model_entries,
                                    restore_model, restore_modes, restore_optimizer)
from nanbisect.guard.spill import Spill, Spilled
from nanbisect.guard.stores import FileStore, HostStore, LazyFile, Scratch
from nanbisect.util import torch_internals as ti

BUDGET = 0.002          # a snapshot's amortised share of a step's time (a rebuild replays up to K)
MAX_EVERY = 1000        # steps between snapshots at most (a rebuild replays up to this many)
CHOOSE_AFTER = 4        # steps timed after a snapshot before K is chosen from their median
RETRY_AFTER = 16        # steps before a snapshot that could not be written is tried again
RECORD_SHARE = 0.05     # the kept steps' copies in memory, as a share of the state's bytes, before
                        # they are spilled to a file (`nanbisect.guard.spill`); their RNG states
                        # (not spilled) before a new snapshot
SPILL_SHARE = 4.0       # the spilled bytes, as a multiple of the state's, before a new snapshot
SPILL_FLOOR = 256 << 20  # ... or these bytes, if more (and at most a quarter of the free space)
TOLERANCE = 1e-4        # relative difference of a replayed step's loss and gradient norm
_RNG_BYTES = 32 * 1024  # a step's RNG states: torch's (5 KB), NumPy's (2.5 KB), Python's (24 KB)


def _nbytes(ts: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in ts.values())


class SnapshotFailed(Exception):
    """The snapshot could not be written (the training goes on without it)."""


@dataclass
class Record:
    """One step as the Guard saw it: what a rebuild needs to run it again and to check it."""

    step: int
    rng: RngState
    groups: Any               # the optimizer's hyper-parameters, encoded
    batch: Any                # the batch, encoded
    tensors: Tensors          # the batch's and groups' tensors (copies)
    loss: float | None        # as the Guard read it (None: not read)
    grad_norm: float | None   # the gradients' global norm as the Guard read it
    nbytes: int = 0           # in all: the tensors' and the RNG states' added
    accumulate: int = 1       # the step's micro-batches (a trainer's last window is shorter)
    loss_normalized: bool = False
    groups_key: tuple | None = None     # the hyper-parameters as plain values (None: tensors)
    tensor_bytes: int = 0     # the tensors' (what a spill moves to the file)
    kept: bool = True         # still one of the Keeper's records


@dataclass
class Rebuilt:
    """What `Keeper.rebuild` did: bundle's ``observed.rebuild``."""

    from_step: int
    steps: int                     # steps replayed in full (the failing step's update excluded)
    fidelity: str                  # bit-exact | within-tolerance | mismatch
    max_rel_diff: float | None     # the largest relative difference seen (0: bit-exact)
    first_mismatch: int | None = None   # the first step whose loss or norm differed

    def to_json(self) -> dict:
        return {"from_step": self.from_step, "steps": self.steps, "fidelity": self.fidelity,
                "max_rel_diff": self.max_rel_diff, "first_mismatch": self.first_mismatch}


def _rel(a: float | None, b: float | None) -> float | None:
    """The relative difference of two read values (0 when both are the same, inf when one is
    not finite and the other is); None when either was not read."""
    if a is None or b is None:
        return None
    if a == b or (a != a and b != b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@dataclass
class Keeper:
    """The Guard's side: `due`, `take` (in the step, before its update), `record` (after it),
    `rebuild` (after a failure seen once the update had run)."""

    every: int | None = None            # fixed K (None: chosen from the snapshot's cost)
    on_host: bool = True                # the state lives in host memory: a file, not a copy
    distributed: bool = False
    agree: Callable[[int], int] | None = None   # under torch.distributed: the ranks' largest K
    agree_failed: Callable[[bool], bool] | None = None   # ... did any rank's snapshot fail
    snap: Snap | None = None
    records: list[Record] = field(default_factory=list)
    k: int | None = None
    state_bytes: int = 0
    kept_bytes: int = 0                 # the records' bytes
    tensor_bytes: int = 0               # ... of which their tensors' (the rest: RNG states)
    spilled_bytes: int = 0              # ... of which in the spill's file, not in memory
    _store: Any = None
    _spill: Any = None
    _disk_cap: int = SPILL_FLOOR
    _next_spill: int = 0                # the first record not handed to the spill yet
    _step_times: deque = field(default_factory=lambda: deque(maxlen=16))
    _last: float | None = None
    _retry_at: int | None = None    # a snapshot failed: the next try (`due`)
    _stateless: bool = False        # the snapshot was taken before the optimizer had state
    failed: str | None = None       # why the last snapshot could not be written

    def __post_init__(self) -> None:
        scratch = Scratch()
        self._store = FileStore(scratch) if self.on_host else HostStore()
        self._spill = Spill(scratch)
        if self.every is not None:
            self.k = self.every

    # -- while training ---------------------------------------------------------------------
    def tick(self) -> None:
        """A step begins: its wall time since the last (for K)."""
        now = time.perf_counter()
        if self._last is not None:
            self._step_times.append(now - self._last)
        self._last = now

    def memory_bytes(self) -> int:
        """The kept steps' bytes held in memory (the RNG states, and copies not spilled)."""
        return self.kept_bytes - self.spilled_bytes

    def _copies_in_memory(self) -> int:
        return self.tensor_bytes - self.spilled_bytes

    def over_share(self) -> bool:
        """Must a snapshot come sooner than K? When the kept steps outgrew what the spill can
        hold (`SPILL_SHARE` of the state's bytes on disk); or what memory should hold while the
        spill does not keep up (copies of twice the share, beyond the newest two steps', which
        the writer may still be writing: a slow disk, a failed write, a batch on an accelerator);
        or when their RNG states, which stay in memory, pass the share (or two steps' states,
        for a model smaller than that)."""
        if self.state_bytes <= 0:
            return False
        self._spill.collect(self._spilled)
        share = RECORD_SHARE * self.state_bytes
        recs = self.records
        newest = (recs[-1].tensor_bytes if recs else 0) + \
            (recs[-2].tensor_bytes if len(recs) > 1 else 0)
        return (self._spill.disk_bytes > self._disk_cap or
                self._copies_in_memory() > 2 * share + newest or
                self.kept_bytes - self.tensor_bytes > max(share, 2 * _RNG_BYTES))

    def due(self, step: int, opt=None, over: bool | None = None) -> bool:
        """Is a snapshot due at ``step``? ``over``: `over_share` as every rank agreed on it
        (under torch.distributed each rank's own would split them)."""
        if self._retry_at is not None and step < self._retry_at:
            return False        # the last snapshot could not be written: not every step
        if self.snap is None:
            return True
        if self._stateless and self.every is None and opt is not None and opt.state:
            # the first update made the optimizer's state: a snapshot of it, so that its size
            # and cost (for K and the kept steps' share) are the state's
            return True
        if self.k is None and step - self.snap.step >= CHOOSE_AFTER:
            # K from the snapshot's cost and the steps' time, once a few steps were timed (under
            # torch.distributed every rank is here at the same step: one all-reduce)
            self.k = self._choose_k(self.snap.seconds)
        if self.k is not None and step - self.snap.step >= self.k:
            return True
        # the kept steps outgrew their share (big batches): a snapshot sooner
        if self.every is not None:
            return False
        return bool(over) if self.distributed else self.over_share()

    @torch.no_grad()
    def take(self, step: int, model: torch.nn.Module, opt, scaler_state: dict | None,
             buffers: dict[int, torch.Tensor]) -> None:
        """Snapshot the step's pre-state: the live parameters and optimizer state (the update has
        not run), the buffers as the step began (``buffers``: id of a live buffer -> its copy
        from before the forward pass), the scaler's state before the step."""
        why = None
        try:      # once: its directory (not timed: K is for the steady cost)
            self._store.prepare()
        except Exception as e:  # noqa: BLE001 - no room for it must not stop the training
            why = f"{type(e).__name__}: {str(e)[:300]}"
        t0 = time.perf_counter()
        ts: Tensors = {}
        keep = lambda t: buffers.get(id(t), local(t)).detach()  # noqa: E731
        meta = opt_meta = None
        try:
            meta = encode_model(model, ts, keep)
            opt_meta = encode_optimizer(opt, ts, keep) if opt is not None else None
        except Exception as e:  # noqa: BLE001 - a state it cannot read must not stop the training
            why = why or f"{type(e).__name__}: {str(e)[:300]}"
        modes = {"training": {n: m.training for n, m in model.named_modules()},
                 "frozen": [n for n, p in model.named_parameters() if not p.requires_grad]}
        self.state_bytes = _nbytes(ts)
        if why is None:
            try:
                self._store.stage(ts)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the training
                why = f"{type(e).__name__}: {str(e)[:300]}"
        if self.distributed and self.agree_failed is not None and \
                self.agree_failed(why is not None) and why is None:
            why = "another rank could not write its snapshot"     # every rank keeps its last
        if why is not None:
            # NB: the last snapshot stays whole until a new one is: it and the steps kept since
            # still rebuild what they reach
            self._store.abort()
            self._retry_at = step + RETRY_AFTER
            self.failed = why
            raise SnapshotFailed(why)
        self._store.commit()
        self._store.settle()
        self._retry_at, self.failed = None, None
        del ts
        self.snap = Snap(step, meta, opt_meta, scaler_state, modes,
                         seconds=time.perf_counter() - t0)
        self._stateless = opt is not None and not opt.state
        self._set_records([r for r in self.records if r.step >= step], reset=True)
        self._disk_cap = self._spill_cap()
        if self.every is None:
            self.k = None         # chosen CHOOSE_AFTER steps from now (`due`)

    def _spill_cap(self) -> int:
        """The spill's bytes at most before a snapshot comes sooner: `SPILL_SHARE` of the
        state's bytes or `SPILL_FLOOR`, and at most a quarter of the free space where it is."""
        cap = int(max(SPILL_SHARE * self.state_bytes, SPILL_FLOOR))
        try:
            free = shutil.disk_usage(self._spill.scratch.dir or tempfile.gettempdir()).free
        except OSError:
            return cap
        return min(cap, free // 4)

    def _choose_k(self, seconds: float) -> int:
        times = sorted(list(self._step_times)[-CHOOSE_AFTER:])
        step = times[len(times) // 2] if times else None
        k = MAX_EVERY if not step else max(1, min(MAX_EVERY, math.ceil(
            seconds / (BUDGET * step))))
        if self.distributed and self.agree is not None:
            k = self.agree(k)       # every rank snapshots at the same steps
        return k

    def record(self, step: int, rng: RngState, opt, groups: list[dict] | None, batch: Any,
               loss: float | None, grad_norm: float | None, accumulate: int = 1,
               loss_normalized: bool = False) -> None:
        """Keep step ``step`` (after its update, or its skip) for a later rebuild; a step run
        again (a loop that goes on after a failure) replaces the one kept."""
        if self.snap is None or step < self.snap.step:
            return
        if self.records and self.records[-1].step >= step:
            self.drop_from(step)
        last = self.records[-1] if self.records else None
        self._spill.collect(self._spilled)
        ts: Tensors = {}
        groups = groups if groups is not None else hyper_parameters(opt)
        key = _plain(groups)
        if key is not None and last is not None and key == last.groups_key:
            g = last.groups        # the same hyper-parameters as the last step: kept once
        else:
            g = encode(groups, "groups", ts, self._copy)
        b = encode(batch, "batch", ts, self._copy)
        rng, rng_bytes = _shared(rng, last.rng if last is not None else None)
        tensor_bytes = _nbytes(ts)
        rec = Record(step, rng, g, b, ts, loss, grad_norm, tensor_bytes + rng_bytes, accumulate,
                     loss_normalized, key, tensor_bytes)
        self.records.append(rec)
        self.kept_bytes += rec.nbytes
        self.tensor_bytes += tensor_bytes
        if self._copies_in_memory() - self._spill.pending() > \
                RECORD_SHARE * self.state_bytes:
            self._spill_some()
        if self.failed is not None and (len(self.records) > MAX_EVERY or
                                        self.memory_bytes() > 4 * RECORD_SHARE *
                                        self.state_bytes or
                                        self._spill.disk_bytes > self._disk_cap):
            # snapshots keep failing (a full disk): the kept steps are bounded, the rebuild
            # becomes unavailable until a snapshot is written again
            self.snap = None
            self._set_records([], reset=True)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        """A kept copy of a batch's (or a group's) tensor: in host memory, into storage the
        spill gives back (no new allocation in a steady run); elsewhere, a clone there."""
        t = local(t).detach()
        if devices.on_host(t.device) and t.layout == torch.strided and not t.is_quantized:
            return self._spill.buffer(t).copy_(t)
        return t.clone()

    def _spill_some(self) -> None:
        """Hand every record held in memory to the spill's writer (all at once: small batches
        pass the share every few dozen steps, not every step)."""
        recs = self.records
        for i in range(self._next_spill, len(recs)):
            r = recs[i]
            if r.tensor_bytes and not isinstance(r.tensors, Spilled) and \
                    not self._spill.put(r, r.tensor_bytes):
                return              # the spill has stopped (a full disk) until `reset`
        self._next_spill = len(recs)

    def _spilled(self, rec: Record, nbytes: int) -> None:
        if rec.kept:
            self.spilled_bytes += nbytes

    def drop_from(self, step: int) -> None:
        self._set_records([r for r in self.records if r.step < step])

    def _set_records(self, records: list[Record], reset: bool = False) -> None:
        keep = {id(r) for r in records}
        for r in self.records:
            if id(r) not in keep:
                r.kept = False
        if reset:       # a new snapshot: the spill's file holds nothing that is kept
            self._spill.reset(records)
        self.records, self.kept_bytes = records, sum(r.nbytes for r in records)
        self.tensor_bytes = sum(r.tensor_bytes for r in records)
        self._next_spill = 0
        self.spilled_bytes = sum(r.tensor_bytes for r in records
                                 if isinstance(r.tensors, Spilled))

    def can_rebuild(self, step: int) -> bool:
        """Is step ``step``'s pre-state within reach (a snapshot at or before it, and every step
        since kept)?"""
        if self.snap is None or step < self.snap.step:
            return False
        steps = [r.step for r in self.records if r.step < step]
        return steps == list(range(self.snap.step, step))

    # -- after a failure --------------------------------------------------------------------
    def unfit(self, task) -> str | None:
        """Why the snapshot cannot be put into the live model and optimizer (their parameters,
        buffers or parameter groups changed since: a layer unfrozen into a new group); None
        when it can. Checked before anything is restored."""
        snap, tensors = self.snap, self._store.get()
        entries = model_entries(task.model)
        if {n for n, _, _ in entries} != set(snap.model["params"]) | set(snap.model["buffers"]):
            return "the model's parameters or buffers are not the snapshot's"
        aliases = snap.model["aliases"]
        for name, t, _ in entries:
            key = f"model/{aliases.get(name, name)}"
            if key not in tensors or tuple(_shape(tensors, key)) != tuple(local(t).shape):
                return f"'{name}' changed shape since the snapshot"
        opt = task.optimizer
        if opt is not None and snap.optimizer is not None:
            groups = decode(snap.optimizer["param_groups"], tensors)
            if [len(g["params"]) for g in groups] != [len(g["params"])
                                                     for g in opt.param_groups]:
                return "the optimizer's parameter groups changed since the snapshot"
        return None

    def restore(self, task) -> None:
        """Put the snapshot's state into the live model, optimizer and scaler."""
        snap, tensors = self.snap, self._store.get()
        where = "the Guard's snapshot"
        restore_model(task.model, snap.model, tensors, where)
        restore_modes(task.model, snap.modes, where)
        if task.optimizer is not None and snap.optimizer is not None:
            restore_optimizer(task.optimizer, snap.optimizer, tensors, where)
        if task.grad_scaler is not None and snap.scaler:
            task.grad_scaler.load_state_dict(dict(snap.scaler))

    def rebuild(self, task, step: int, read: Callable) -> tuple[Rebuilt, Record]:
        """Bring the live state to step ``step``'s pre-state (`can_rebuild` must hold): restore
        the snapshot, replay every kept step before ``step`` in full, then ``step`` up to its
        update alone (the update is what failed), comparing each step's loss and gradient norm
        (``read(total)``: the Guard's reading of the loss and the live gradients, where it read
        them in training: just before the update) with the ones kept. The buffers and the
        scaler end as ``step`` began; the gradients are cleared. Returns what it did and
        ``step``'s record."""
        shape = (task.accumulate, task.loss_normalized)
        self._spill.collect(self._spilled)
        try:
            return self._rebuild(task, step, read)
        finally:
            task.accumulate, task.loss_normalized = shape

    def _rebuild(self, task, step: int, read: Callable) -> tuple[Rebuilt, Record]:
        from nanbisect.step import run_step

        self.restore(task)
        worst, first_bad = 0.0, None
        recs = [r for r in self.records if self.snap.step <= r.step <= step]
        target = recs[-1]
        pre = None
        for r in recs:
            last = r is target
            if last:     # the buffers and scaler as the failing step began: kept aside
                pre = self._pre_step(task)
            self._inputs(task, r)
            batch = decode(r.batch, r.tensors)   # the copies, where the batch was
            seen: dict = {}

            def before_update(total, grad_norm, skipped, _last=last, _seen=seen) -> bool:
                _seen["v"] = read(total)
                return not _last       # the failing update is not run again

            ev = None
            for ev in run_step(task, batch, before_update=before_update):
                pass
            if "v" not in seen:        # no optimizer: read after the last backward
                seen["v"] = read(ev.total if ev is not None else None)
            loss, grad = seen["v"]
            for a, b in ((loss, r.loss), (grad, r.grad_norm)):
                d = _rel(a, b)
                if d is not None and d > worst:
                    worst = d
                if d is not None and d > 0 and first_bad is None:
                    first_bad = r.step
        self._put_back(task, pre)
        if task.optimizer is not None:
            task.optimizer.zero_grad(set_to_none=True)
        fidelity = ("bit-exact" if worst == 0 else "within-tolerance" if worst <= TOLERANCE
                    else "mismatch")
        return Rebuilt(self.snap.step, len(recs) - 1, fidelity,
                       worst if math.isfinite(worst) else None, first_bad), target

    @staticmethod
    def _inputs(task, r: Record) -> None:
        task.accumulate, task.loss_normalized = r.accumulate, r.loss_normalized
        r.rng.set()
        opt = task.optimizer
        if opt is not None:
            saved = decode(r.groups, r.tensors)
            for g, h in zip(opt.param_groups, saved):
                g.update(h)
            opt.zero_grad(set_to_none=True)
        task.model.zero_grad(set_to_none=True)

    @staticmethod
    @torch.no_grad()
    def _pre_step(task) -> tuple:
        bufs = [(b, local(b).detach().clone()) for b in task.model.buffers()]
        scaler = task.grad_scaler
        sc = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
        return bufs, sc

    @staticmethod
    @torch.no_grad()
    def _put_back(task, pre: tuple) -> None:
        bufs, sc = pre
        for b, saved in bufs:
            local(b).copy_(saved)
        if sc:
            task.grad_scaler.load_state_dict(sc)
        reset_scaler_stage(task.grad_scaler)

    def close(self) -> None:
        """Drop the snapshot (its file too) and the kept steps (the spill's writer stopped)."""
        self._spill.close()
        self._store.close()
        self._spill.scratch.close()     # (the spill's directory, on an accelerator too)
        self.snap = None
        self._set_records([])
        self._step_times.clear()
        self._last, self._retry_at, self.failed = None, None, None


_PLAIN_TYPES = (int, float, bool, str, type(None))


def _plain(groups: list[dict]) -> tuple | None:
    """The groups' hyper-parameters as a comparable tuple, or None when one is not a plain
    value (a tensor learning rate: encoded every step)."""
    out = []
    for g in groups:
        items = []
        for k, v in g.items():
            if isinstance(v, tuple) and all(type(x) in _PLAIN_TYPES for x in v):
                items.append((k, v))
            elif type(v) in _PLAIN_TYPES:
                items.append((k, v))
            else:
                return None
        out.append(tuple(items))
    return tuple(out)


def _shape(tensors, key: str) -> tuple:
    """A stored tensor's shape (from a file's header, without reading it)."""
    if isinstance(tensors, LazyFile):
        return tensors.shape(key)
    return tuple(tensors[key].shape)


def _shared(rng: RngState, last: RngState | None) -> tuple[RngState, int]:
    """``rng`` with each part equal to ``last``'s replaced by ``last``'s (one object kept, not
    two: a loop that draws from Python's or NumPy's generator rarely draws every step), and the
    bytes of the parts it adds."""
    if last is None:
        return rng, _RNG_BYTES
    python = last.python if rng.python == last.python else rng.python
    numpy = last.numpy if _same_numpy(rng.numpy, last.numpy) else rng.numpy
    cpu = last.torch_cpu if torch.equal(rng.torch_cpu, last.torch_cpu) else rng.torch_cpu
    added = ((python is not last.python) * 24 * 1024 + (numpy is not last.numpy) * 2600
             + (cpu is not last.torch_cpu) * cpu.numel() * cpu.element_size()
             + sum(t.numel() * t.element_size() for ts in rng.accel.values() for t in ts))
    return RngState(python, numpy, cpu, rng.accel), added


def _same_numpy(a, b) -> bool:
    return a[2:] == b[2:] and a[0] == b[0] and a[1].tobytes() == b[1].tobytes()


def reset_scaler_stage(scaler) -> None:
    """Forget that ``unscale_`` ran on an optimizer whose update was then not run (else the
    next step's ``unscale_`` refuses)."""
    if scaler is not None and scaler.is_enabled():
        ti.reset_scaler_optimizer_states(scaler)
