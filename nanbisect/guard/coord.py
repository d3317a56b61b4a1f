"""Capture-time rank coordination: who we are, agreeing on a failure, what the ranks write once.

Guarantees: a guarded step costs one extra collective, an all-reduce (MAX) of a one-element flag,
only when a process group is initialised. A failing step, on any rank, makes *every* rank write
its part (``rank{r}/``) of one bundle (`nanbisect.guard.parts`: the write, the bounded agreement
on which parts made it, the top manifest). Watching DDP's reduction is `multirank.ddp`.

Replicas are written once: a tensor (any role but batch and RNG, which every rank writes itself)
whose bytes, dtype and shape equal the same-named tensor of a lower rank is written only by the
lowest rank holding it; the other parts name it in their manifest's ``shared`` (by role: one
entry per file, listing only exceptions), and `nanbisect.bundle.format.Bundle.part` reads it
back from the owner's file. This costs one sha256 pass over the rank's tensors and one
all_gather_object of a digest per role; only when some role differs between ranks, also one
broadcast of tensor keys per distinct copy (at most `MAX_COMPARED`). For a DDP model, the
replicas of its process group are compared: the top manifest's ``replicas`` holds the groups,
the bytes written once and what is out of sync ({tensor, ranks grouped by identical bytes,
max_abs_diff}, at most `LISTED` listed, with the count). Not guaranteed: with more than
`MAX_COMPARED` distinct copies of a role, ranks beyond them are deduplicated only against those
and against their own copy, and listed as ``uncompared``; the parts are on a file system every
rank sees (as for the parts themselves: the rank that adds the top manifest reads them back).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from safetensors import safe_open

from nanbisect import devices
from nanbisect.bundle.format import PER_RANK, SUFFIX
from nanbisect.guard.deadline import all_gather_objects, all_reduce_max, broadcast_object
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import tensor_bytes


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


def any_rank(flag: torch.Tensor, what: str = "the Guard's agreement on a failure"
             ) -> torch.Tensor:
    """All-reduce (MAX) of a one-element flag: did any rank see a failure? Stays on device;
    bounded (`nanbisect.guard.deadline`: `RankTimeout` past ``NANBISECT_RANK_TIMEOUT``)."""
    return all_reduce_max(flag, what)


def ranks_max(v: float) -> float:
    """Under torch.distributed: the largest ``v`` of all ranks (one all-reduce, on the CPU for
    gloo, else on the accelerator the backend runs on; bounded, as `any_rank`)."""
    backend = rank_info().backend
    return any_rank(torch.tensor([float(v)], device=devices.collective_device(backend))).item()


def broadcast_str(value: str, what: str = "the Guard's broadcast of the bundle's name") -> str:
    """Rank 0's ``value`` on every rank (bounded, as `any_rank`)."""
    return broadcast_object(value, what)


def process_groups() -> dict[str, list[int]]:
    """The process groups this rank belongs to: torch's group name -> global ranks."""
    out = {}
    for pg, name, ranks in ti.world_process_groups():
        desc = getattr(pg, "group_desc", None)   # new_group(..., group_desc="tp") names it
        key = desc if desc and desc not in ("undefined", "default_pg") else name
        out[key] = ranks
    return out


def merged_groups(per_rank: list[dict], world_size: int) -> dict[str, list[int]]:
    """One layout from every rank's view (a rank knows only the groups it is in): "world" plus
    every other group (tensor/data-parallel groups, a device mesh's, FSDP's) under torch's name."""
    everyone = list(range(world_size))
    merged: dict[str, list[int]] = {"world": everyone}
    for groups in per_rank:
        for name, ranks in (groups or {}).items():
            if ranks != everyone or name != "0":
                merged.setdefault(name, ranks)
    return merged


# ------------------------------------------------------------------------------------------
# Replicas: state identical on several ranks is written once.
#
# Every rank hashes its tensors (sha256 of the bytes, plus dtype and shape: the tensor's *key*)
# and its groups (a digest of all of a group's names and keys). One all_gather_object of the
# group digests tells each rank, per group, the lowest rank with the same digest (its *rep*):
# in a DDP job in sync every rank's rep is rank 0 and nothing more is exchanged. Only when some
# group differs between ranks do the first `MAX_COMPARED` distinct reps broadcast their
# tensors' keys, so that a replica that differs in one tensor still shares the others. The
# owner of a tensor is the lowest rank holding the same bytes under the same name among those
# reps and the rank's own rep (exactly the lowest rank holding them, as long as there are at
# most MAX_COMPARED distinct copies of a group; beyond, ranks further up may write a copy).

CHECKED = ("model", "optimizer")   # what a data-parallel group keeps identical on every rank
MAX_COMPARED = 32                  # distinct copies of a group compared tensor by tensor
LISTED = 20                        # out-of-sync tensors listed in the top manifest
DIFF_COPIES = 8                    # byte-distinct copies of a tensor measured for max_abs_diff
CHUNK = 1 << 22                    # elements compared at once (float64: 32 MiB)

Key = tuple   # (sha256 hex of the bytes, dtype, shape)


def tensor_key(t: torch.Tensor) -> Key:
    """sha256 of a CPU tensor's bytes, its dtype and its shape: equal keys, equal tensors.

    >>> tensor_key(torch.zeros(2))[1:], tensor_key(torch.zeros(2)) == tensor_key(torch.zeros(1, 2))
    (('float32', (2,)), False)
    """
    return (hashlib.sha256(tensor_bytes(t)).hexdigest(), str(t.dtype).removeprefix("torch."),
            tuple(t.shape))


def tensor_keys(tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Key]]:
    """role -> name -> key for every role that may be shared (all but batch and RNG), hashed on
    a few threads (hashlib releases the GIL)."""
    items = [(g, n, t) for g, ts in tensors.items() if g not in PER_RANK
             for n, t in ts.items()]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        keys = list(ex.map(lambda item: tensor_key(item[2]), items))
    out: dict[str, dict[str, Key]] = {}
    for (g, n, _), k in zip(items, keys):
        out.setdefault(g, {})[n] = k
    return out


def _digest(keys: dict[str, Key]) -> str:
    h = hashlib.sha256()
    for n in sorted(keys):
        h.update(json.dumps([n, keys[n][0], keys[n][1], list(keys[n][2])]).encode() + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class ReplicaPlan:
    """What every rank knows after `exchange`, the same on every rank.

    ``rep[g][r]``: the lowest rank whose group ``g`` has rank r's digest (None: r has no such
    tensors); ``known[g][p]``: the keys of rep p's group g, for the reps that broadcast them;
    ``dp[r]``: rank r's data-parallel group (None: not a DDP model).
    """

    rep: dict[str, list[int | None]]
    known: dict[str, dict[int, dict[str, Key]]]
    dp: list[list[int] | None]

    def keys(self, g: str, r: int) -> dict[str, Key] | None:
        """Rank r's keys of group g when known ({} when it has none)."""
        p = self.rep.get(g, [None] * len(self.dp))[r]
        return {} if p is None else self.known.get(g, {}).get(p)

    def owner(self, g: str, r: int, name: str, key: Key) -> int:
        """The rank that writes rank r's tensor ``name`` of group g (whose key is ``key``)."""
        best = self.rep[g][r]
        for p, ks in self.known.get(g, {}).items():
            if p < best and ks.get(name) == key:
                best = p
        return best

    def written(self, g: str, p: int) -> set[str] | None:
        """The names rank p writes itself in group g, when p's keys are known."""
        ks = self.known.get(g, {}).get(p)
        return None if ks is None else {n for n, k in ks.items() if self.owner(g, p, n, k) == p}

    def groups(self) -> list[list[int]]:
        """The distinct data-parallel groups, by their lowest rank."""
        return [list(d) for d in sorted({tuple(d) for d in self.dp if d})]


def exchange(keys: dict[str, dict[str, Key]], replica_group: list[int] | None) -> ReplicaPlan:
    """One all_gather_object of the group digests, then, only when some group differs between
    ranks, one broadcast of the keys of each of the first `MAX_COMPARED` distinct copies."""
    info = rank_info()
    mine = {"dp": list(replica_group) if replica_group else None,
            "groups": {g: _digest(k) for g, k in keys.items()}}
    everyone = all_gather_objects(mine, "the exchange of what each rank writes")
    rep: dict[str, list[int | None]] = {}
    for g in sorted({g for e in everyone for g in e["groups"]}):
        first: dict[str, int] = {}
        rep[g] = [None if e["groups"].get(g) is None else first.setdefault(e["groups"][g], r)
                  for r, e in enumerate(everyone)]
    known: dict[str, dict[int, dict[str, Key]]] = {}
    if any(len(set(col)) > 1 for col in rep.values()):
        reps = sorted({r for col in rep.values() for r, p in enumerate(col) if p == r})
        for p in reps[:MAX_COMPARED]:
            got = broadcast_object({g: keys[g] for g in keys if rep[g][p] == p}
                                   if info.rank == p else None,
                                   f"the broadcast of rank {p}'s tensor keys", src=p)
            for g, ks in got.items():
                known.setdefault(g, {})[p] = ks
    return ReplicaPlan(rep, known, [e["dp"] for e in everyone])


def share(plan: ReplicaPlan, rank: int, keys: dict[str, dict[str, Key]],
          tensors: dict[str, dict[str, torch.Tensor]]) -> tuple[dict, dict]:
    """(the tensors this rank writes itself, its manifest's ``shared``).

    ``shared[ROLE.safetensors] = {"rank": D, "tensors": N, "bytes": B, "from": {"R": [names]},
    "skip": [names]}``: the part's tensors of that role are its own file's, the ``from`` names
    of rank R's file, and all other tensors of rank D's file (the owner of most of them) except
    ``skip`` (names D holds that this rank does not have); N and B count what other ranks hold.
    A replica in sync is ``{"rank": 0, "tensors": N, "bytes": B}`` whatever the model's size;
    one tensor out of sync is one tensor in the part's own file, nothing more in the manifest.
    """
    kept = {g: dict(ts) for g, ts in tensors.items()}
    shared = {}
    for g, ks in keys.items():
        by_owner: dict[int, list[str]] = {}
        for n, k in ks.items():
            o = plan.owner(g, rank, n, k)
            if o != rank:
                by_owner.setdefault(o, []).append(n)
                del kept[g][n]
        if not by_owner:
            continue
        default = max(by_owner, key=lambda o: (len(by_owner[o]), -o))
        # NB: an owner whose keys were not broadcast is this rank's rep: it has this rank's
        # tensors, and writes exactly those this rank takes from it
        theirs = plan.written(g, default)
        skip = sorted(theirs - set(ks)) if theirs is not None else []
        ref: dict = {"rank": default, "tensors": sum(map(len, by_owner.values())),
                     "bytes": sum(tensors[g][n].numel() * tensors[g][n].element_size()
                                  for names in by_owner.values() for n in names)}
        others = {str(o): names for o, names in sorted(by_owner.items()) if o != default}
        if others:
            ref["from"] = others
        if skip:
            ref["skip"] = skip
        shared[f"{g}{SUFFIX}"] = ref
    return kept, shared


def out_of_sync(plan: ReplicaPlan, labels: dict[str, str]) -> tuple[list[dict], list[int]]:
    """The tensors of `CHECKED` roles that differ between ranks of a data-parallel group, in
    group and file order: {tensor, ranks (grouped by identical bytes, lowest rank first),
    missing (ranks without it)}; and the ranks whose copy could not be compared tensor by
    tensor (beyond `MAX_COMPARED` distinct copies)."""
    rows, uncompared = [], set()
    for group in plan.groups():
        for g in CHECKED:
            if g not in plan.rep or len({plan.rep[g][r] for r in group}) == 1:
                continue
            have = {}
            for r in group:
                ks = plan.keys(g, r)
                if ks is None:
                    uncompared.add(r)
                else:
                    have[r] = ks
            names = list(dict.fromkeys(n for ks in have.values() for n in ks))
            for n in names:
                if labels.get(n) is UNCHECKED:
                    continue      # a buffer: rank-local until DDP broadcasts it (written once
                                  # where equal all the same)
                copies: dict[Key, list[int]] = {}
                for r, ks in have.items():
                    if n in ks:
                        copies.setdefault(ks[n], []).append(r)
                missing = [r for r, ks in have.items() if n not in ks]
                if len(copies) > 1 or missing:
                    row = {"tensor": f"{g}:{labels.get(n, n.removeprefix(g + '/'))}",
                           "ranks": sorted(copies.values())}
                    if missing:
                        row["missing"] = missing
                    row["_read"] = (g, n, [(rs[0], k) for k, rs in sorted(
                        copies.items(), key=lambda c: c[1][0])])
                    rows.append(row)
    return rows, sorted(uncompared)


def measured_or_not(tmp: Path, plan: ReplicaPlan, row: dict) -> dict:
    """`_measured`, or ``row`` with ``max_abs_diff`` None when reading the copies back fails:
    the bundle of a failing step matters more than the size of a difference."""
    try:
        return _measured(tmp, plan, row)
    except Exception:  # noqa: BLE001 - any failure here must not lose the bundle
        return {**{k: v for k, v in row.items() if k != "_read"}, "max_abs_diff": None}


def _measured(tmp: Path, plan: ReplicaPlan, row: dict) -> dict:
    """``row`` with ``max_abs_diff``: the largest |difference| between the first copy and each
    of the next `DIFF_COPIES` (read back from the parts just written; float64, by chunks); None
    when the shapes differ, a string when it is not finite."""
    g, n, copies = row["_read"]
    out = {k: v for k, v in row.items() if k != "_read"}

    def load(r: int, key: Key) -> torch.Tensor:
        o = plan.owner(g, r, n, key)
        with safe_open(str(tmp / f"rank{o}" / f"{g}{SUFFIX}"), framework="pt") as f:
            return f.get_tensor(n).reshape(-1)

    if len(copies) < 2:   # one copy, missing on other ranks: nothing to measure
        return out
    first = load(*copies[0])
    worst: float | None = 0.0
    for r, key in copies[1:1 + DIFF_COPIES]:
        other = load(r, key)
        if key[2] != copies[0][1][2] or first.is_complex() or other.is_complex():
            worst = None
            break
        for i in range(0, first.numel(), CHUNK):
            d = (first[i:i + CHUNK].double() - other[i:i + CHUNK].double()).abs().max().item()
            worst = max(worst, d) if d == d else d    # NB: NaN, once seen, stays
            if worst != worst:
                break
        if worst != worst:
            break
    out["max_abs_diff"] = (worst if worst is None or math.isfinite(worst) else
                           "nan" if worst != worst else "inf")
    return out


UNCHECKED = "<not compared>"


def tensor_labels(model: torch.nn.Module, optimizer) -> dict[str, str]:
    """Readable names of optimizer state tensors: ``optim/state/3/v0`` -> ``fc.weight.exp_avg``
    (the parameter's name in ``model`` and the state's key), as `encode_optimizer` stores them;
    buffers are `UNCHECKED`: before a step they legitimately differ between the ranks of a DDP
    group (BatchNorm's running statistics are updated locally; DDP broadcasts rank 0's at the
    next forward), so they are never reported as replicas out of sync."""
    out = {f"model/{n}": UNCHECKED for n, _ in model.named_buffers()}
    if optimizer is None:
        return out
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for j, k in enumerate(optimizer.state.get(p, {})):
            out[f"optim/state/{i}/v{j}"] = f"{names.get(id(p), f'param {i}')}.{k}"
    return out

