"""Capture-time rank coordination: who we are, agreeing on a failure, one bundle from all ranks.

Guarantees: a guarded step costs one extra collective, an all-reduce (MAX) of a one-element flag,
only when a process group is initialised. A failing step, on any rank, makes *every* rank write
its part (``rank{r}/``) of one bundle; rank 0 adds the top manifest (world size, backend,
process-group layout, each part's checksum) and renames the directory into place only after a
barrier, so a bundle that exists is complete. Watching DDP's reduction is `multirank.ddp`.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nanbisect.bundle.atomic import place
from nanbisect.bundle.format import MANIFEST, SCHEMA, environment


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


def write_all_ranks(final: Path, write_part: Callable[[Path], None], manifest: dict,
                    unique: bool = False) -> Path:
    """Every rank writes ``tmp/rank{r}`` with ``write_part``; rank 0 writes the top manifest
    and renames ``tmp`` to ``final`` after all parts exist, never over an existing path (with
    ``unique``, the first free ``final-N``). Returns where it went, on every rank."""
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
        final = place(tmp, final, unique=unique)
    return Path(broadcast_str(str(final)))   # also the barrier: every rank gets rank 0's name


# ------------------------------------------------------------------------------------------
# DDP gradient reduction
