"""Every wait the Guard issues on other ranks ends by a deadline: a job may fail, never hang.

The Guard talks to the other ranks in three places: the per-step agreement on a failure (one
all-reduce of a flag), the failing step's re-run that records its collectives (the user's own
collectives and point-to-point sends and receives, run again under `nanbisect.guard.retape`), and
the write of one bundle by every rank (a few broadcasts and gathers before the parts are written;
the write itself is bounded by `nanbisect.guard.agree`). Each of those waits here, on the
collective's work, with ``NANBISECT_RANK_TIMEOUT`` seconds (default: the job's own process-group
timeout, else 600) as its limit; past it,
or when the backend reports the peer gone, `RankTimeout` says in one line which rank waited for
which operation. The Guard then writes what it has and raises `NonFiniteStep`
(`nanbisect.guard.failing`).

A point-to-point work is waited here once, on a thread, and a stand-in that completes with it (or
fails at the deadline) handed back to the caller: gloo's send and receive works never return from
a second ``wait`` (the re-run's hang this module exists for), and a schedule that issues sends
and receives together must not be made to wait for each in turn.

Guarantees: on gloo a wait returns or raises `RankTimeout` within the limit (``Work.wait(timeout)``
ends it there); on NCCL the same call aborts the communicator at the limit (torch's own
behaviour), so the process can write and leave. Not guaranteed: a functional collective
(``torch.distributed._functional_collectives``) is waited through ``wait_tensor``, which takes no
limit; user code that blocks outside torch.distributed (a queue, a file lock) is not bounded.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nanbisect import devices
from nanbisect.replay.p2p import (RANK_TIMEOUT, StandIns, bounded_wait, is_p2p,  # noqa: F401
                                   rank_timeout)
from nanbisect.util import torch_internals as ti



class RankTimeout(Exception):
    """A wait on other ranks that did not end in time, or ended because a peer went away.

    >>> str(RankTimeout("the all-reduce of step 4's failure flag", 2.0, rank=1))
    "rank 1: the all-reduce of step 4's failure flag did not complete within 2 s (another rank \
did not join it; NANBISECT_RANK_TIMEOUT)"
    """

    def __init__(self, what: str, seconds: float, why: str = "", rank: int | None = None):
        self.what, self.seconds, self.why = what, seconds, why
        self.rank = _rank() if rank is None else rank
        cause = why or "another rank did not join it"
        super().__init__(f"rank {self.rank}: {what} did not complete within {seconds:g} s "
                         f"({cause}; NANBISECT_RANK_TIMEOUT)")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def wait(work: Any, what: str, timeout: float | None = None) -> None:
    """Wait for ``work`` (a c10d work, boxed or not) at most ``timeout`` seconds (default
    `rank_timeout`); `RankTimeout` when it does not end in time or ends in an error."""
    w = ti.work_of(work)
    if w is None:
        return
    t = rank_timeout() if timeout is None else timeout
    why = bounded_wait(w, t)
    if why:
        raise RankTimeout(what, t, why)


class Settled:
    """The works of the c10d ops one run of the user's step issued (the failing step's re-run, a
    rebuild's steps), each bounded by the deadline (see `settle`); ``finish()`` waits for the
    sends' and receives' watchers (each ends by the deadline) and returns the first `RankTimeout`
    among them, or None. NB: a stand-in work whose future failed returns from ``wait()`` without
    raising (torch 2.13), so a receive that timed out is seen here, not by the caller."""

    def __init__(self) -> None:
        self.unmet: RankTimeout | None = None
        self._stand_ins: StandIns | None = None

    def settle(self, func, out: Any, on_done=None) -> Any:
        """What a dispatched c10d op returned, its works bounded by the deadline: a collective's
        waited here (`wait`); a send's or receive's waited once, on a thread of its own, and
        handed back as a work that completes with it, after ``on_done()`` (`StandIns`: a
        pipeline schedule issues them together and waits later). A receive from any source is
        left as it is (its caller asks the work for the sender, which a stand-in cannot tell):
        bounded by the process group's own timeout only."""
        name = ti.schema_name(func)
        if name == "c10d::recv_any_source_":
            return out
        what = f"{func} (the failing step's re-run)"
        if is_p2p(func):
            if self._stand_ins is None:
                self._stand_ins = StandIns(rank_timeout())
            return self._stand_ins.hand_back(out, what, on_done)
        for x in ti.tree_leaves(out):
            if ti.work_of(x) is not None:
                wait(x, what)
        return out

    def finish(self) -> RankTimeout | None:
        """Wait for every watcher (each ends by the deadline); the first wait not met."""
        if self._stand_ins is not None and self.unmet is None:
            missed = self._stand_ins.finish()
            if missed is not None:
                self.unmet = RankTimeout(*missed)
        return self.unmet


def all_reduce_max(flag: torch.Tensor, what: str) -> torch.Tensor:
    """All-reduce (MAX) of ``flag`` in place, bounded; returns it."""
    wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), what)
    return flag


def _device() -> torch.device:
    return devices.collective_device(str(dist.get_backend()))


def broadcast_object(obj: Any, what: str, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (two bounded broadcasts: its size, its bytes)."""
    dev = _device()
    mine = ti.object_to_bytes(obj, devices.HOST) if dist.get_rank() == src else None
    n = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.long, device=dev)
    wait(dist.broadcast(n, src=src, async_op=True), what)
    buf = mine.to(dev) if mine is not None else torch.empty(int(n.item()), dtype=torch.uint8,
                                                            device=dev)
    wait(dist.broadcast(buf, src=src, async_op=True), what)
    return obj if mine is not None else ti.bytes_to_object(buf.to(devices.HOST))


def all_gather_objects(obj: Any, what: str) -> list:
    """Every rank's ``obj``, in rank order (two bounded all-gathers: sizes, padded bytes)."""
    dev, world = _device(), dist.get_world_size()
    mine = ti.object_to_bytes(obj, dev)
    n = torch.tensor([mine.numel()], dtype=torch.long, device=dev)
    sizes = [torch.zeros(1, dtype=torch.long, device=dev) for _ in range(world)]
    wait(dist.all_gather(sizes, n, async_op=True), what)
    lens = [int(s.item()) for s in sizes]
    top = max(lens)
    padded = torch.zeros(top, dtype=torch.uint8, device=dev)
    padded[:mine.numel()] = mine
    out = [torch.empty(top, dtype=torch.uint8, device=dev) for _ in range(world)]
    wait(dist.all_gather(out, padded, async_op=True), what)
    return [ti.bytes_to_object(t[:k].to(devices.HOST)) for t, k in zip(out, lens)]


class BoundedWaits(ti.ObserverMode):
    """Inside it, every c10d collective and send/receive the user's code issues is waited with
    the deadline (`Settled`): the Guard's own runs of the user's step (a rebuild's steps, the
    failing step's re-run: `nanbisect.guard.retape.TapeRecorder` is one) end by it; leaving it
    without an error raises the first `RankTimeout` a send or receive met (``settled.unmet``
    holds it either way, once it is left)."""

    def __init__(self) -> None:
        super().__init__()
        self.settled = Settled()

    def wants(self, func) -> bool:
        return func.namespace == "c10d"

    def run(self, call: ti.OpCall) -> Any:
        return self.settled.settle(call.func, call.func(*call.args, **call.kwargs))

    def __exit__(self, *exc) -> Any:
        out = super().__exit__(*exc)
        unmet = self.settled.finish()
        if unmet is not None and exc[0] is None:
            raise unmet
        return out
