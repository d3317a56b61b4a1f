"""What crossed between ranks in a replayed step, as one rank saw it: every collective (in every
phase: a forward tensor-parallel all-reduce, an all-to-all, an all-gather, the gradient
reduction) and every op a DDP comm hook runs (its casts, divisions, compression), each with the
NaN/inf this rank fed it and the NaN/inf it wrote (`nanbisect.records.Crossing`).

`Ledger` rides along a rank's first lockstep pass (`multirank.worker`); every rank's entries are
exchanged with the first-pass summaries, so the rule of birth holds across ranks without a
reference device (`multirank.paths`): finite in on every rank of the group and non-finite out
makes the collective the place a value was born; one rank's input already bad names that rank.

Guarantees: only what a rank fed or got non-finite is kept (at most `KEEP` entries, the first
ones: what the decision needs), so the exchange stays small at any world size; a collective's
output is waited for before it is counted; a comm hook's op names the parameters whose slice of
the bucket went bad, an FSDP2 reduction the parameters whose shard went bad and its unit.
Costs: a NaN/inf count of what each collective (and hook op) reads and writes, read back at
once (one host wait per collective), and a magnitude of the finite low-precision inputs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from nanbisect.records import Crossing
from nanbisect.records.ranks import LOW_RANGE
from nanbisect.replay.collectives import (caller, collective_outputs, ddp_internal, group_ranks,
                                          leaf_tensors, taped, wait_collective)
from nanbisect.replay.p2p import StandIns, direction, ends, is_p2p, is_receive, rank_timeout
from nanbisect.replay.recorder import read_args, written_tensors
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.locate.catch import short_path
from nanbisect.step import backward_began, in_stage_backward, op_phase
from nanbisect.util import frames
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import finite_absmax, nan_inf_counts

KEEP = 16     # entries a rank keeps (and sends every other rank)


def _dtype(ts: list[torch.Tensor]) -> str:
    return str(ts[0].dtype).removeprefix("torch.") if ts else ""


def _floating(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in ts if t.is_floating_point() or t.is_complex()]


def _bad(ts: list[torch.Tensor]) -> tuple[int, int]:
    """(NaN count, inf count) over ``ts`` (`nan_inf_counts`; a dtype the counting kernels
    lack, float8 on the CPU, counted through float16, which holds its every value)."""
    return nan_inf_counts([t.to(torch.float16) if t.element_size() == 1 else t
                           for t in _floating(ts)])


def _receives(func, args: tuple, kwargs: dict) -> bool:
    """A broadcast on a rank that is not its root: what its buffer held is overwritten, not
    fed in."""
    if ti.schema_name(func) != "c10d::broadcast_":
        return False
    named = dict(zip((a.name for a in ti.schema_arguments(func)), args)) | kwargs
    pg = ti.op_process_group(func, args, kwargs)
    return pg is not None and named.get("root_rank") is not None and \
        pg.rank() != named["root_rank"]


def _absmax(ts: list[torch.Tensor]) -> float | None:
    """The largest finite magnitude in ``ts`` (None: no finite floating value)."""
    best = None
    for t in _floating(ts):
        if t.is_complex() or t.numel() == 0:
            continue
        if t.element_size() == 1:
            t = t.to(torch.float16)
        m = float(finite_absmax(t))
        best = m if best is None else max(best, m)
    return best


def _aliases(func) -> bool:
    """Does ``func`` return a view of an input (``view``, ``split``, ``as_strided``; not an
    in-place op, which writes it)?"""
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in ti.schema_returns(func))


def _bad_slices(flat: torch.Tensor, names: list[str], sizes: list[int]) -> list[str]:
    """The names whose slice holds NaN/inf: ``flat`` is the slices (``sizes``, in order) once,
    or repeated (an FSDP reduce-scatter's input: one such run per rank)."""
    flat, total = flat.reshape(-1), sum(sizes)
    if not total or flat.numel() % total:
        return []
    runs = flat.reshape(flat.numel() // total, total)
    out, at = [], 0
    for name, n in zip(names, sizes):
        if n and not bool(torch.isfinite(runs[:, at:at + n]).all()):
            out.append(name)
        at += n
    return out


def _source(frame) -> str | None:
    """"path:line" of the user's code that issued the op (the innermost frame of the user's
    before the stack goes back into nanbisect's), else of the code that did (a comm hook of
    torch's, FSDP's reduction)."""
    first = f = ti.issuing_frame(frame)
    while f is not None and frames.kind(f.f_code.co_filename) != "nanbisect":
        if frames.kind(f.f_code.co_filename) in ("user", "installed"):
            return short_path(f.f_code.co_filename, f.f_lineno)
        f = f.f_back
    return short_path(first.f_code.co_filename, first.f_lineno) if first is not None else None


class Ledger(ti.ObserverMode):
    """Records this rank's crossings in one replay of the step. ``phase(name)`` is given to
    `Replayer.run` (it labels what follows), ``hook(...)`` wraps a DDP comm hook's call
    (`multirank.ddp.ReductionObserver`), `read` gives the entries kept."""

    def __init__(self, model: torch.nn.Module, tracker: ModuleTracker | None = None,
                 ddp: bool = False) -> None:
        super().__init__()
        self.tracker = tracker
        self.ddp = ddp
        self.module_names = {m: n for n, m in model.named_modules()}
        self.now = "forward"
        self.reducing: _Reduction | None = None     # a comm hook or FSDP reduction running
        self.nth = 0                  # collectives seen in this step
        self.seq: dict[tuple | None, int] = {}    # ... on each process group
        self.kept: list = []          # Crossings, and receives still arriving (`_Arriving`)
        self.pairs: dict[tuple | None, int] = {}   # messages (src, dst) -> count so far
        self.stand_ins: StandIns | None = None
        self.active = True
        self.errors = 0               # ops it could not count (their step ran untouched)

    # -- what the replay tells it ------------------------------------------------------------
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.now = name
        yield

    @contextmanager
    def hook(self, index: int, names: list[str], sizes: list[int]) -> Iterator[None]:
        """A DDP comm hook runs for bucket ``index`` (its parameters' names and sizes, in the
        bucket's order): every op it runs is recorded."""
        with self._reducing(_Reduction(index, None, names, sizes)):
            yield

    @contextmanager
    def fsdp(self, names: list[str], sizes: list[int], modules: list) -> Iterator[None]:
        """An FSDP2 unit reduces its gradients (`ti.observing_fsdp_reductions`): every op of
        the reduction is recorded."""
        unit = next((self.module_names[m] for m in modules if m in self.module_names), "")
        with self._reducing(_Reduction(None, unit, names, sizes)):
            yield

    @contextmanager
    def _reducing(self, r: "_Reduction") -> Iterator[None]:
        self.reducing = r
        try:
            yield
        finally:
            self.reducing = None

    def __enter__(self):
        self._fsdp = ti.observing_fsdp_reductions(self.fsdp)
        self._fsdp.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._fsdp.__exit__(*exc)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """nanbisect's own ops (the reduction observer's counts) go unrecorded."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    # -- the mode ---------------------------------------------------------------------------
    def wants(self, func) -> bool:
        in_stage_backward()       # notes that a pipeline stage's step began its backward
        if not self.active or func in ti.METADATA_OPS or len(self.kept) >= KEEP:
            return False
        return self.reducing is not None or taped(func)

    def before(self, call: ti.OpCall) -> bool:
        try:
            return self._before(call)
        except Exception:  # noqa: BLE001 - a count that fails must not fail the user's step
            self.errors += 1
            return False

    def after(self, call: ti.OpCall, out) -> None:
        try:
            self._after(call, out)
        except Exception:  # noqa: BLE001 - as in `before`
            self.errors += 1

    def _before(self, call: ti.OpCall) -> bool:
        func, args, kwargs = call.func, call.args, call.kwargs
        collective = taped(func)
        if collective and ddp_internal(caller(), self.ddp) == "rebuild":
            return False
        call.ledger_key = None
        call.ledger_phase = op_phase(self.now)
        if collective and is_p2p(func):
            # a send and its receive are one crossing: the n-th message from src to dst
            pair = ends(func, args, kwargs)
            key = tuple(pair) if pair is not None else None
            seq = self.pairs.get(key, 0)
            self.pairs[key] = seq + 1
            call.ledger_key = (self.nth, pair, seq)
            self.nth += 1
            # what it carries: as the issuing code says, else by whether this stage's
            # backward began (a hand-written stage: forward's sends, then backward's)
            call.ledger_phase = direction(func, ti.issuing_frame(caller())) or (
                "backward" if backward_began() else call.ledger_phase)
            reads = leaf_tensors(read_args(func, args, kwargs))    # a receive reads nothing
        elif collective:
            call.ledger_phase = op_phase(self.now, collective=True, in_module=(
                self.tracker is None or self.tracker.current() is not None))
            group = group_ranks(func, args, kwargs)
            key = tuple(group) if group is not None else None
            seq = self.seq.get(key, 0)
            self.seq[key] = seq + 1
            call.ledger_key = (self.nth, group, seq)
            self.nth += 1
            reads = ([] if _receives(func, args, kwargs)
                     else leaf_tensors(read_args(func, args, kwargs)))
        else:
            if _aliases(func):
                return False     # a view: the values of its input, not new ones
            outs = {a.name for a in ti.schema_arguments(func) if a.is_out}
            reads = leaf_tensors([v for v in read_args(func, args, {})] + [
                v for k, v in kwargs.items() if k not in outs])
            if not _floating(reads):
                return False     # made from no values (an empty buffer, a constant): no birth
        call.ledger_reads = _bad(reads)
        call.ledger_tensors = reads
        # the largest finite magnitude fed in, for an overflow's words: read now where the op
        # may overwrite its input (an in-place collective), later where it may be needed
        call.ledger_absmax = (_absmax(reads) if any(t.dtype in _LOW for t in _floating(reads))
                              else None)
        call.ledger_inputs = ([str(t.dtype).removeprefix("torch.") for t in reads[:4]],
                              [list(t.shape) for t in reads[:4]])
        return True

    def run(self, call: ti.OpCall):
        """A send or receive runs with its work handed back as a stand-in (`StandIns`): a
        receive is counted once it arrived, before its caller can read it; never waited here (a
        schedule waits later, and gloo's works never return from a second wait)."""
        out = call.func(*call.args, **call.kwargs)
        if getattr(call, "ledger_key", None) is None or not is_receive(call.func):
            return out
        if self.stand_ins is None:
            self.stand_ins = StandIns(rank_timeout())
        arrived = call.ledger_arrived = {}
        wrote = collective_outputs(call.func, call.args, call.kwargs, out)

        def count() -> None:
            arrived["bad"] = _bad(wrote)

        return self.stand_ins.hand_back(out, f"{call.func} (a replay's first pass)", count)

    def _after(self, call: ti.OpCall, out) -> None:
        func, args, kwargs = call.func, call.args, call.kwargs
        key = call.ledger_key
        arriving = None
        if key is not None and is_p2p(func):
            nth, group, seq = key
            wrote = mutated = []
            if is_receive(func):       # counted when it arrives (`run`, `read`)
                arriving, (out_nan, out_inf) = call.ledger_arrived, (0, 0)
            else:
                out_nan, out_inf = call.ledger_reads      # a send carries what it read
        elif key is not None:
            wait_collective(func, out)
            wrote = mutated = collective_outputs(func, args, kwargs, out)
            nth, group, seq = key
            out_nan, out_inf = _bad(wrote)
        else:
            returned, mutated = written_tensors(func, out, args, kwargs)
            wrote = list({id(t): t for t in leaf_tensors(returned + mutated)}.values())
            nth, group, seq = None, None, None
            out_nan, out_inf = _bad(wrote)
        in_nan, in_inf = call.ledger_reads
        if arriving is None and not (out_nan or out_inf or in_nan or in_inf):
            return
        absmax = call.ledger_absmax
        if (absmax is None and key is None and out_inf and not (in_nan or in_inf)
                and any(t.dtype in _LOW for t in _floating(wrote))
                and not mutated):
            absmax = _absmax(call.ledger_tensors)   # a cast into a narrow dtype, its input kept
        frame = caller()
        phase, module, module_call, params, bucket, unit = (call.ledger_phase, "", None, [],
                                                            None, None)
        r = self.reducing
        if r is not None:
            phase, bucket, unit = "grad-reduce", r.bucket, r.unit
            if out_nan or out_inf:
                params = next((p for t in _floating(wrote)
                               if (p := _bad_slices(t, r.names, r.sizes))), [])
        elif key is not None and self.now == "backward" and \
                ddp_internal(frame, self.ddp) == "bucket":
            phase = "grad-reduce"
        if phase == "forward" and self.tracker is not None:
            cur = self.tracker.current()
            if cur is not None:
                module, module_call = cur.module, cur.call
        crossing = Crossing(
            nth, str(func), phase, module, module_call, group,
            _dtype(_floating(wrote)) or _dtype(_floating(call.ledger_tensors)),
            ti.reduce_op_name(func, args, kwargs) if key is not None
            else None, in_nan, in_inf, out_nan, out_inf, absmax, params, bucket,
            unit, _source(frame), *call.ledger_inputs, seq=seq)
        if arriving is not None:
            dtype = _dtype(_floating(collective_outputs(func, args, kwargs, out)))
            crossing = _Arriving(replace(crossing, dtype=dtype), arriving)
        self.kept.append(crossing)

    def read(self) -> list[Crossing]:
        """The entries kept, once every receive arrived (each by the deadline): a receive that
        brought nothing non-finite is left out."""
        if self.stand_ins is not None:
            self.stand_ins.finish()
        out = []
        for c in self.kept:
            if isinstance(c, _Arriving):
                nan, inf = c.arrived.get("bad", (0, 0))
                if not (nan or inf):
                    continue
                c = replace(c.crossing, out_nan=nan, out_inf=inf)
            out.append(c)
        return out


_LOW = tuple(getattr(torch, n) for n in LOW_RANGE if hasattr(torch, n))


@dataclass(frozen=True)
class _Arriving:
    """A receive whose data had not arrived when it was issued: its counts come with it."""

    crossing: Crossing
    arrived: dict


@dataclass(frozen=True)
class _Reduction:
    """A gradient reduction running: a DDP bucket's comm hook, or an FSDP2 unit's."""

    bucket: int | None
    unit: str | None
    names: list[str]
    sizes: list[int]
