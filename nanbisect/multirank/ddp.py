"""Watching DDP's gradient reduction: `ReductionObserver` wraps DDP's communication hook (the
user's own hook when one is registered, else the built-in all-reduce) and records, per bucket,
whether the gradient going into the collective and what came out held NaN/inf.

FSDP2's reduce-scatter is not hooked here: it is a dispatched collective, which the op recorder
sees (`nanbisect.replay.recorder`, `nanbisect.multirank.worker`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from nanbisect.records import Bucket
from nanbisect.util.tensors import nan_inf_on_device as _counts


@dataclass
class BucketRecord:
    index: int
    params: list[str]
    before: torch.Tensor        # (nan, inf) counts of the bucket going into the collective
    after: torch.Tensor | None  # (nan, inf) counts of what came out


class ReductionObserver:
    """Wraps a DDP comm hook; records per bucket what went in and what came out."""

    def __init__(self, names: dict[torch.Tensor, str], server=None) -> None:
        self.names = names
        self.records: list[BucketRecord] = []
        self.active = True
        # a replay without the other ranks (`multirank.served.TapeServer`): every bucket gets
        # what the capture's reduction gave, the hook (the user's too) never runs
        self.server = server
        self.ledger = None      # records the hook's ops while set (`multirank.ledger.Ledger`)

    def wrap(self, hook: Callable) -> Callable:
        def observed(state, bucket):  # NB: no annotations: DDP checks them against its own
            names = [self.names.get(p, "?") for p in bucket.parameters()]
            if self.server is not None:
                served = self.server.ddp_bucket(names, bucket.buffer(),
                                                [p.numel() for p in bucket.parameters()])
                if self.active:
                    self.records.append(BucketRecord(bucket.index(), names,
                                                     self._count(bucket.buffer()),
                                                     self._count(served)))
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_result(served)
                return fut
            if not self.active:
                return hook(state, bucket)
            rec = BucketRecord(bucket.index(), names, self._count(bucket.buffer()), None)
            self.records.append(rec)

            def after(fut):
                value = fut.value()
                out = value[0] if isinstance(value, list) else value
                rec.after = self._count(out)
                return out
            ledger = self.ledger
            if ledger is None:
                return hook(state, bucket).then(after)
            with ledger.hook(bucket.index(), names, [p.numel() for p in bucket.parameters()]):
                return hook(state, bucket).then(after)
        observed.__qualname__ = getattr(hook, "__qualname__", "hook")
        return observed

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s NaN/inf counts, unseen by the ledger (they are not the hook's ops)."""
        ledger = self.ledger
        if ledger is None:
            return _counts(t)
        with ledger.quiet():
            return _counts(t)

    def read(self) -> list[Bucket]:
        out = []
        for r in self.records:
            b = r.before.tolist()
            a = r.after.tolist() if r.after is not None else [0.0, 0.0]
            out.append(Bucket(r.index, r.params, int(b[0]), int(b[1]), int(a[0]), int(a[1])))
        return out


@contextlib.contextmanager
def observing_comm_hooks(observer: ReductionObserver) -> Iterator[None]:
    """While building the task, wrap any comm hook the user registers on a DDP model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.register_comm_hook

    def register(self, state, hook):
        self._nanbisect_observed = True
        return original(self, state, observer.wrap(hook))

    DDP.register_comm_hook = register
    try:
        yield
    finally:
        DDP.register_comm_hook = original


def observe_default_hook(model: torch.nn.Module, observer: ReductionObserver) -> None:
    """A DDP model with no comm hook of the user's gets the built-in all-reduce, observed."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP) and not getattr(model, "_nanbisect_observed", False):
        DDP.register_comm_hook(model, model.process_group, observer.wrap(
            default_hooks.allreduce_hook))
        model._nanbisect_observed = True
