"""The multi-rank decisions, the same on every rank: which phase and rank to bisect after the
first pass, and which rank computed the failure once every rank has traced it to a root op.

Pure functions over what the ranks exchanged; no torch.distributed, no tensors.
"""
from __future__ import annotations


def decide(summaries: list[dict]) -> dict:
    """The same plan on every rank, from every rank's first-pass summary."""
    fwd = [s["rank"] for s in summaries if s["phase"] == "forward"]
    if fwd:
        return {"rank": min(fwd), "phase": "forward"}
    local_bwd = [s["rank"] for s in summaries if s["reduce_in_bad"] or (
        s["phase"] == "backward" and not s["buckets"])]
    if local_bwd:
        return {"rank": min(local_bwd), "phase": "backward"}
    if any(s["reduce_out_bad"] for s in summaries):
        return {"rank": None, "phase": "grad-reduce"}
    opt = [s["rank"] for s in summaries if s["phase"] == "optimizer"]
    if opt:
        return {"rank": min(opt), "phase": "optimizer"}
    return {"rank": None, "phase": None}


def choose_rank(roots: list[dict | None], planned: int) -> tuple[int, bool]:
    """(culprit rank, whether the failure only came out of a collective), the same on every rank.

    A rank whose failure traces back to a computation (not to a collective's output) computed it
    locally; the first such rank is the culprit. When every rank that failed traces it to a
    collective whose inputs were finite, no rank computed it: the collective is at fault.
    """
    local = [r for r, root in enumerate(roots) if root is not None and not root["collective"]]
    if local:
        return local[0], False
    received = [r for r, root in enumerate(roots) if root is not None]
    if received:
        return received[0], True
    return planned, False
