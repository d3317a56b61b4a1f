"""The format of a multi-rank part's recorded collectives (its *tape*): what capture writes and
replay reads.

A part's manifest holds ``collectives``: ``{schema, entries: [Entry...], ddp: {params,
micro_batches, group} | None, rerun_failed}``; its ``collectives.safetensors`` (`ROLE`) holds
entry i's output j as ``c{i}.{j}`` and DDP's reduced gradient of parameter ``name`` after
micro-batch m as ``ddp{m}.{name}``. A receive (`RECEIVE`, a pipeline stage's) is an entry like a
collective's, served in order, its ``group`` [sender, receiver]; a send (`SEND`) is kept as counts
only. Written by `nanbisect.guard.retape`, served by `nanbisect.multirank.served`. Guarantees:
`parse` accepts only what the recorder writes (the schema, every field of every entry with its
type) and otherwise raises `BadInput` naming the first thing wrong; `input_digest` is the one
definition of an entry's ``in_sha256``. Not guaranteed: that the tensors match the entries (the
server checks that when it loads them).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from nanbisect.errors import BadInput
from nanbisect.util.tensors import tensor_bytes

ROLE = "collectives"          # the tensor group of a part that holds the recorded outputs
SCHEMA = 1


def input_digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' dtypes, shapes and bytes (a 0-dim one too: a collective on a
    scalar, e.g. the loss all-reduced for logging).

    >>> one = input_digest([torch.tensor(1.0)])
    >>> one == input_digest([torch.tensor(1.0)]) != input_digest([torch.ones(1)])
    True
    """
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(bytes(tensor_bytes(t)))
    return h.hexdigest()


@dataclass
class Entry:
    """One recorded collective (JSON in the part's manifest under ``collectives.entries``)."""

    op: str
    group_size: int | None
    shapes: list[list[int]]
    dtypes: list[str]
    in_sha256: str
    in_nan: int
    in_inf: int
    out_nan: int
    out_inf: int
    kind: str = "tape"        # "tape": served in order; "ddp-bucket", "p2p": counts only
    # the global ranks of its process group; a send or receive: [sender, receiver]
    group: list[int] | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


class TapeMismatch(BadInput):
    """The replay issued a collective the capture did not (another path through the code)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: the replay takes another path through the code than the "
                         "capture did (other code, other shapes), so the recorded collectives "
                         "do not fit it; replay all ranks (drop --ranks)")


FIX = "re-capture the bundle"
# "p2p": a send of a pipelined step (or a receive from any source), kept as what it sent
# (counts); not served to a replay of some ranks. A receive from a given rank is "tape": served.
KINDS = ("tape", "ddp-bucket", "p2p")
RECEIVE, SEND = "c10d.recv_.default", "c10d.send.default"     # their entries' ``op``
_INTS = ("in_nan", "in_inf", "out_nan", "out_inf")


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def parse(manifest, where: str) -> tuple[list[Entry], dict | None]:
    """A part's ``collectives`` (untrusted JSON) as entries and its DDP record; `BadInput`
    naming the first thing that is not as the recorder writes it."""
    def bad(why: str) -> BadInput:
        return BadInput(f"{where}: the recorded collectives {why}; {FIX}")

    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list):
        raise bad("are not {entries: [...], ...}")
    if manifest.get("schema") != SCHEMA:
        raise bad(f"have schema {manifest.get('schema')!r}, not {SCHEMA} (another nanbisect "
                  "wrote them)")
    out = []
    for i, e in enumerate(manifest["entries"]):
        if not isinstance(e, dict) or set(e) != set(Entry.__dataclass_fields__):
            raise bad(f"entry #{i} does not have the fields of a recorded collective")
        ok = (isinstance(e["op"], str) and (e["group_size"] is None or type(e["group_size"])
                                             is int)
              and isinstance(e["shapes"], list) and all(_ints(x) for x in e["shapes"])
              and isinstance(e["dtypes"], list) and all(isinstance(x, str) for x in e["dtypes"])
              and len(e["dtypes"]) == len(e["shapes"]) and isinstance(e["in_sha256"], str)
              and _ints([e[k] for k in _INTS]) and e["kind"] in KINDS
              and (e["group"] is None or _ints(e["group"])))
        if not ok:
            raise bad(f"entry #{i} has a field of the wrong type")
        out.append(Entry(**e))
    ddp = manifest.get("ddp")
    if ddp is not None and not (isinstance(ddp, dict) and isinstance(ddp.get("params"), list)
                                and all(isinstance(x, str) for x in ddp["params"])
                                and type(ddp.get("micro_batches")) is int
                                and (ddp.get("group") is None or _ints(ddp["group"]))):
        raise bad("have a DDP record that is not {params: [names], micro_batches: N}")
    return out, ddp

