"""What nanbisect needs from torch.distributed: who we are, agreeing on a failure, one bundle from
all ranks, and watching DDP's gradient reduction.

Guarantees: a guarded step costs one extra collective, an all-reduce (MAX) of a one-element flag,
only when a process group is initialised. A failing step, on any rank, makes *every* rank write
its part (``rank{r}/``) of one bundle; rank 0 adds the top manifest (world size, backend,
process-group layout, each part's checksum) and renames the directory into place only after a
barrier, so a bundle that exists is complete. `ReductionObserver` wraps DDP's communication hook
(the user's own hook when one is registered, else the built-in all-reduce) and records, per bucket,
the gradient going into the collective and what came out. FSDP2's reduce-scatter is not hooked
here: it is a dispatched collective, which the op recorder sees (`oprecord`, `rankworker`).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .bundle import MANIFEST, SCHEMA, environment


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_info() -> RankInfo:
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
    return RankInfo(0, 1, None)


def any_rank(flag: torch.Tensor) -> torch.Tensor:
    """All-reduce (MAX) of a one-element flag: did any rank see a failure? Stays on device."""
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def broadcast_str(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def process_groups() -> dict[str, list[int]]:
    """The process groups this rank belongs to: torch's group name -> global ranks."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    out = {}
    for pg, name in list(world.pg_names.items()):
        desc = getattr(pg, "group_desc", None)   # new_group(..., group_desc="tp") names it
        key = desc if desc and desc not in ("undefined", "default_pg") else name
        out[key] = sorted(int(g) for g in world.pg_group_ranks.get(pg, {}))
    return out


def _merge_groups(per_rank: list[dict], world_size: int) -> dict[str, list[int]]:
    """One layout from every rank's view (a rank knows only the groups it is in): "world" plus
    every other group (tensor/data-parallel groups, a device mesh's, FSDP's) under torch's name."""
    everyone = list(range(world_size))
    merged: dict[str, list[int]] = {"world": everyone}
    for groups in per_rank:
        for name, ranks in (groups or {}).items():
            if ranks != everyone or name != "0":
                merged.setdefault(name, ranks)
    return merged


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_all_ranks(final: Path, write_part: Callable[[Path], None], manifest: dict) -> Path:
    """Every rank writes ``tmp/rank{r}`` with ``write_part``; rank 0 writes the top manifest
    and renames ``tmp`` to ``final`` after all parts exist. Returns ``final`` on every rank."""
    info = rank_info()
    tmp_name = broadcast_str(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp = final.parent / tmp_name
    if info.rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    write_part(tmp / f"rank{info.rank}")
    groups: list = [None] * info.world_size
    dist.all_gather_object(groups, process_groups())   # also the barrier after the parts
    if info.rank == 0:
        parts = {}
        for r in range(info.world_size):
            m = tmp / f"rank{r}" / MANIFEST
            parts[str(r)] = {"dir": f"rank{r}", "manifest_sha256": _sha256(m),
                             "observed": json.loads(m.read_text()).get("observed")}
        top = {"schema": SCHEMA, "kind": "multi-rank",
               "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
               "environment": environment(),
               **manifest, "world_size": info.world_size, "backend": info.backend,
               "process_groups": _merge_groups(groups, info.world_size), "ranks": parts,
               "files": {}}
        with open(tmp / MANIFEST, "w") as f:
            f.write(json.dumps(top, indent=1, allow_nan=False))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    dist.barrier()
    return final


# ------------------------------------------------------------------------------------------
# DDP gradient reduction


@dataclass
class BucketRecord:
    index: int
    params: list[str]
    before: torch.Tensor        # (nan, inf) counts of the bucket going into the collective
    after: torch.Tensor | None  # (nan, inf) counts of what came out


def _counts(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.isnan(t).sum(), torch.isinf(t).sum()]).float()


class ReductionObserver:
    """Wraps a DDP comm hook; records per bucket what went in and what came out."""

    def __init__(self, names: dict[torch.Tensor, str]) -> None:
        self.names = names
        self.records: list[BucketRecord] = []
        self.active = True

    def wrap(self, hook: Callable) -> Callable:
        def observed(state, bucket):  # NB: no annotations: DDP checks them against its own
            if not self.active:
                return hook(state, bucket)
            rec = BucketRecord(bucket.index(), [self.names.get(p, "?") for p in
                                                bucket.parameters()], _counts(bucket.buffer()),
                               None)
            self.records.append(rec)

            def after(fut):
                value = fut.value()
                out = value[0] if isinstance(value, list) else value
                rec.after = _counts(out)
                return out
            return hook(state, bucket).then(after)
        observed.__qualname__ = getattr(hook, "__qualname__", "hook")
        return observed

    def read(self) -> list[dict]:
        out = []
        for r in self.records:
            b = r.before.tolist()
            a = r.after.tolist() if r.after is not None else [0.0, 0.0]
            out.append({"bucket": r.index, "params": r.params, "in_nan": int(b[0]),
                        "in_inf": int(b[1]), "out_nan": int(a[0]), "out_inf": int(a[1])})
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
