"""What every collective of the failing step gave each rank, recorded at capture (the tape a
replay of a few ranks, ``nanbisect run --ranks R,...``, is served by `nanbisect.multirank.served`).

`record_step`, called by Guard on every rank when the failure flag trips: the failing
step runs once more from its pre-step snapshot under `TapeRecorder`, a dispatch mode that
sees every dispatched collective (``c10d::*``: a tensor-parallel all-reduce, FSDP2's all-gather
and reduce-scatter, a DTensor reduction in ``clip_grad_norm_``; ``_c10d_functional::*``), waits for
it and keeps what it wrote, in order, with NaN/inf counts and a sha256 of what it read. DDP's
gradient reduction is kept per parameter instead (each parameter's gradient after every
micro-batch's backward, which is what the reduction, the user's comm hook included, left there),
so that a replay's bucket layout, which DDP builds anew, does not have to match the capture's; the
bucket collectives themselves are left out of the tape, as are DDP's bucket rebuilds. A pipeline
stage's receive is kept like a collective (what arrived, copied on its watcher's thread when it
arrives: `nanbisect.replay.p2p.StandIns`); its send as what it sent (counts). The format
is `nanbisect.bundle.tape`'s. Guarantees: recording never raises into the step (a failure makes
the tape unusable, not the step: `record_step` then returns None and why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanbisect import devices
from nanbisect.bundle.state import local
from nanbisect.bundle.tape import RECEIVE, SCHEMA, Entry, input_digest
from nanbisect.guard.deadline import BoundedWaits, RankTimeout
from nanbisect.replay.p2p import ends, is_p2p, is_receive
from nanbisect.replay.collectives import (caller, collective_outputs, ddp_internal, group_ranks,
                                          group_size, leaf_tensors, taped, wait_collective)
from nanbisect.replay.recorder import collective_writes, read_args
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import nan_inf_counts as _counts


@dataclass
class Tape:
    """What `record_step` kept: the entries and their tensors (``manifest()``: the part's
    ``collectives`` section, as `nanbisect.bundle.tape` defines it)."""

    entries: list[Entry] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    ddp_params: list[str] | None = None       # DDP: names whose reduced grads are kept
    micro_batches: int = 0
    ddp_group: list[int] | None = None        # DDP: the ranks of its process group
    rerun_failed: bool | None = None          # the re-run of the step failed again

    def manifest(self) -> dict:
        return {"schema": SCHEMA, "entries": [e.to_json() for e in self.entries],
                "ddp": ({"params": self.ddp_params, "micro_batches": self.micro_batches,
                         "group": self.ddp_group}
                        if self.ddp_params is not None else None),
                "rerun_failed": self.rerun_failed}


class TapeRecorder(BoundedWaits):
    """Capture: keep what every collective of the step wrote, in order (see the module doc)."""

    def __init__(self, tape: Tape, ddp: bool = False) -> None:
        super().__init__()                # the deadline on every collective and send/receive
        self.tape = tape
        self.ddp = ddp
        self.error: str | None = None     # the first thing that went wrong while recording
        # a receive's entry index -> NaN/inf counts of what arrived (its watcher writes them,
        # maybe before the entry exists: `arrived` fills them in once every watcher ended)
        self._arrivals: dict[int, tuple[int, int]] = {}
        self._taped = 0       # entries of kind "tape" so far: the next one's index

    # NB: no hook raises: the step must go on, with its collectives matched on every rank; a
    # failure to record makes the tape unusable, not the step
    def wants(self, func) -> bool:
        return func.namespace == "c10d" or taped(func)

    def before(self, call: ti.OpCall) -> bool:
        """What the collective reads (NaN/inf counts, digest); DDP's bucket rebuilds, barriers
        and every op after a recording error are not recorded (``call.read`` None), but still
        run under the deadline."""
        call.read = None
        if self.error is not None or not taped(call.func):
            return True
        try:
            internal = ddp_internal(caller(), self.ddp)
            if internal == "rebuild":
                return True
            reads = leaf_tensors(read_args(call.func, call.args, call.kwargs))
            in_nan, in_inf = _counts(reads)
            digest = input_digest(reads) if internal is None else ""
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
            return True
        call.read = (internal, in_nan, in_inf, digest)
        return True

    def run(self, call: ti.OpCall) -> Any:
        """The op, a c10d one's works bounded by the Guard's deadline (`BoundedWaits`: a
        `RankTimeout` leaves the re-run, and the tape is lost, never the step). What a receive
        brought is kept when it arrives (on its watcher's thread, before the caller can read
        it): the tape serves it to a replay of this rank alone."""
        func = call.func
        if func.namespace != "c10d":
            return func(*call.args, **call.kwargs)      # functional: not bounded
        if call.read is None or not is_receive(func):
            return super().run(call)
        i = self._taped       # its entry's (`after` appends it next)
        bufs = leaf_tensors(collective_writes(func, call.args, call.kwargs))

        def arrived() -> None:
            for j, t in enumerate(bufs):
                self.tape.tensors[f"c{i}.{j}"] = t.detach().to(devices.HOST, copy=True)
            self._arrivals[i] = _counts(bufs)

        return self.settled.settle(func, func(*call.args, **call.kwargs), on_done=arrived)

    def arrived(self) -> None:
        """Fill in what the receives brought (NaN/inf counts) once every watcher ended; a
        receive that never arrived makes the tape unusable."""
        taped_entries = [e for e in self.tape.entries if e.kind == "tape"]
        for i, e in enumerate(taped_entries):
            if e.op == RECEIVE:
                if i not in self._arrivals:
                    self.error = self.error or f"receive #{i} never arrived"
                    continue
                e.out_nan, e.out_inf = self._arrivals[i]

    def after(self, call: ti.OpCall, out: Any) -> None:
        """What it wrote: an entry of the tape, and its tensors unless DDP's own. A send is kept
        as what it sent (counts; kind ``p2p``: not served); a receive is served like a
        collective, its tensors kept by `run` when they arrive; both name [sender, receiver] as
        their group."""
        if call.read is None:
            return
        func, args, kwargs = call.func, call.args, call.kwargs
        internal, in_nan, in_inf, digest = call.read
        try:
            p2p = is_p2p(func)
            receive = is_receive(func)
            if p2p:     # its work completes later (a schedule waits for it): not waited here
                internal = None if receive else "p2p"
            else:
                wait_collective(func, out)
            wrote = collective_outputs(func, args, kwargs, out)
            out_nan, out_inf = _counts(wrote) if not p2p else (0, 0)
            group = ends(func, args, kwargs) if p2p else group_ranks(func, args, kwargs)
            i = self._taped
            e = Entry(str(func), group_size(func, args, kwargs), [list(t.shape) for t in wrote],
                      [str(t.dtype).removeprefix("torch.") for t in wrote], digest, in_nan,
                      in_inf, out_nan, out_inf,
                      "p2p" if internal == "p2p" else "ddp-bucket" if internal else "tape",
                      group)
            self.tape.entries.append(e)
            self._taped += e.kind == "tape"
            if internal is None and not receive:
                for j, t in enumerate(wrote):
                    self.tape.tensors[f"c{i}.{j}"] = (
                        t.detach().to(devices.HOST, copy=True).contiguous())
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {str(e)[:200]}"


def record_step(task, batch: Any) -> tuple[Tape | None, "str | RankTimeout | None"]:
    """Run the Task's step once under `TapeRecorder` (the caller restores the pre-step state and
    RNG before and after); keep DDP's reduced gradients per parameter per micro-batch. Returns
    the tape, or (None, why) when it could not be recorded (the step raised, or recording did;
    a `RankTimeout` itself when another rank did not meet one of the re-run's waits):
    the bundle is then written without one, never lost over it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from nanbisect.step import run_step

    tape = Tape()
    model = task.model
    ddp = isinstance(model, DistributedDataParallel)
    if ddp:
        tape.ddp_params = []
        try:
            tape.ddp_group = sorted(dist.get_process_group_ranks(model.process_group))
        except (RuntimeError, ValueError, KeyError, AttributeError):
            tape.ddp_group = None
    if task.optimizer is not None:
        task.optimizer.zero_grad(set_to_none=True)
    rec = TapeRecorder(tape, ddp)
    last = None
    try:
        with rec:
            for ev in run_step(task, batch):
                last = ev
                if ev.phase == "backward" and ddp:
                    m = tape.micro_batches
                    for name, p in model.named_parameters():
                        if p.grad is not None:
                            if m == 0:
                                tape.ddp_params.append(name)
                            tape.tensors[f"ddp{m}.{name}"] = (
                                local(p.grad).detach().to(devices.HOST, copy=True).contiguous())
                    tape.micro_batches += 1
    except RankTimeout as e:      # a rank that did not meet: its one line, as the exception
        return None, rec.settled.unmet or e       # (a send or receive first, when one did not)
    except Exception as e:  # noqa: BLE001 - the bundle matters more than the tape
        if rec.settled.unmet is not None:          # a send or receive no rank met
            return None, rec.settled.unmet
        return None, f"re-running the step raised {type(e).__name__}: {str(e)[:200]}"
    rec.arrived()
    if rec.error is not None:
        return None, f"recording a collective failed ({rec.error})"
    loss = last.total if last is not None else None
    finite = [bool(torch.isfinite(local(p.data)).all()) for p in model.parameters()]
    tape.rerun_failed = not (all(finite) and (loss is None or bool(
        torch.isfinite(local(loss).detach()).all())))
    return tape, None
