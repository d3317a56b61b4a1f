"""A replay of some ranks (``nanbisect run --ranks R,...``) served what every collective of the
failing step gave each rank at capture (`nanbisect.guard.retape` records it; the format is
`nanbisect.bundle.tape`'s).

`TapeServer`, in a process that is rank r of a world of N with torch's fake process group,
which communicates nothing: every collective of a replayed step is served the next recorded
result, checked against the recorded op, group size, shapes and dtypes (a mismatch is a one-line
error: the replay took another path than the capture); a receive is served what arrived at
capture and a send goes nowhere (a pipeline stage alone); DDP buckets are served from the recorded
gradients by the comm hook nanbisect always installs (`multirank.ddp.ReductionObserver`).

What a served replay cannot decide: whether a collective computed its output correctly from its
participants' inputs. It re-runs nothing across ranks; it only knows the inputs of the ranks it
replays, and the NaN/inf counts the other ranks recorded at capture.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from nanbisect.bundle.tape import FIX, ROLE, TapeMismatch, input_digest, parse
from nanbisect.errors import BadInput
from nanbisect.replay.p2p import is_p2p, is_receive, pipeline_setup
from nanbisect.replay.collectives import (caller, collective_outputs, ddp_internal, group_size,
                                          leaf_tensors, taped, wait_collective)
from nanbisect.replay.recorder import read_args
from nanbisect.util import torch_internals as ti


class TapeServer(ti.ObserverMode):
    """Replay of some ranks: serve each collective of the step what the capture recorded.

    ``rewind()`` before each replay of the step (`Replayer.restored`); outside a step the fake
    process group answers (model construction: DDP's parameter broadcast, FSDP2's mesh)."""

    def __init__(self, manifest: dict, tensors: dict[str, torch.Tensor],
                 where: str = "bundle") -> None:
        super().__init__()
        entries, ddp = parse(manifest, where)
        self.entries = [e for e in entries if e.kind == "tape"]
        self.where = where
        self.tensors = tensors
        self.ddp_params = set(ddp["params"]) if ddp else set()
        self.ddp = ddp is not None
        self.check_inputs = True     # off while the reference side replays (its inputs differ)
        for i, e in enumerate(self.entries):    # every served output is there, as recorded
            for j, shape in enumerate(e.shapes):
                t = tensors.get(f"c{i}.{j}")
                if t is None or list(t.shape) != shape:
                    raise BadInput(f"{where}: recorded collective #{i} ({e.op}) has no output "
                                   f"{j} of shape {shape} in {ROLE}.safetensors; {FIX}")
        self.i = 0
        self.ddp_count: dict[str, int] = {}
        self.served_inputs_differ: list[int] = []    # entries whose inputs were not the capture's

    def rewind(self) -> None:
        self.i = 0
        self.ddp_count = {}

    @contextmanager
    def unchecked(self) -> Iterator[None]:
        """Serve without checking the inputs against the capture's (the reference side's
        inputs differ by design)."""
        self.check_inputs = False
        try:
            yield
        finally:
            self.check_inputs = True

    def wants(self, func) -> bool:
        return taped(func)

    def before(self, call: ti.OpCall) -> bool:
        """DDP's bucket rebuilds and sends run as they are (the fake process group sends
        nothing); a receive is served what it got at capture, like any other collective; a
        pipeline stage's first-step vote is answered (see `_vote`)."""
        frame = caller()
        if ddp_internal(frame, self.ddp) == "rebuild":
            return False
        call.vote = False
        if is_p2p(call.func):
            setup = pipeline_setup(frame)
            if setup == "shapes":
                _unserved(SHAPES)
            if not is_receive(call.func):
                if ti.schema_name(call.func) != "c10d::send":
                    _unserved("it receives from any source (the capture recorded from whom, a "
                              "replay of some ranks cannot tell its code)")
                return False
            call.vote = setup == "vote"
            if call.vote:
                return True
        call.reads = leaf_tensors(read_args(call.func, call.args, call.kwargs))
        return True

    def after(self, call: ti.OpCall, out) -> None:
        """Check the collective against the capture's and overwrite what it wrote with what
        the capture recorded (a mismatch raises `TapeMismatch`)."""
        func, args, kwargs = call.func, call.args, call.kwargs
        wait_collective(func, out)
        wrote = collective_outputs(func, args, kwargs, out)
        if call.vote:
            _vote(wrote)
            return
        reads = call.reads
        if self.i >= len(self.entries):
            raise TapeMismatch(f"the replay issued collective #{self.i} ({func}), the capture "
                               f"recorded only {len(self.entries)}")
        e = self.entries[self.i]
        shapes = [list(t.shape) for t in wrote]
        dtypes = [str(t.dtype).removeprefix("torch.") for t in wrote]
        if (e.op, e.shapes) != (str(func), shapes) or (
                e.group_size is not None and group_size(func, args, kwargs) not in (
                    None, e.group_size)):
            raise TapeMismatch(f"collective #{self.i}: the replay issued {func} writing "
                               f"{shapes}, the capture recorded {e.op} writing {e.shapes}")
        if self.check_inputs and e.in_sha256 and input_digest(reads) != e.in_sha256 and \
                dtypes == e.dtypes:
            self.served_inputs_differ.append(self.i)
        with torch.no_grad():
            for j, t in enumerate(wrote):
                t.copy_(self.tensors[f"c{self.i}.{j}"].to(device=t.device, dtype=t.dtype))
        self.i += 1

    def ddp_bucket(self, names: list[str], like: torch.Tensor,
                   sizes: list[int] | None = None) -> torch.Tensor:
        """A DDP bucket's reduced gradients (flat, in the bucket's parameter order), as the
        capture's reduction left them in this micro-batch. A parameter that had no gradient on
        any rank at capture (unused, with ``find_unused_parameters``) gets zeros, as DDP's
        reduction gives it."""
        parts = []
        for j, name in enumerate(names):
            if name not in self.ddp_params and sizes is not None:
                parts.append(torch.zeros(sizes[j], dtype=like.dtype))
                continue
            k = self.ddp_count.get(name, 0)
            key = f"ddp{k}.{name}"
            if key not in self.tensors:
                raise TapeMismatch(f"DDP reduced parameter {name} more often ({k + 1} times) "
                                   "than the capture recorded")
            self.ddp_count[name] = k + 1
            parts.append(self.tensors[key].reshape(-1))
        flat = torch.cat(parts) if parts else like.new_zeros(0)
        if flat.numel() != like.numel():
            raise TapeMismatch(f"a DDP bucket of {like.numel()} gradient values got "
                               f"{flat.numel()} recorded ones")
        return flat.to(device=like.device, dtype=like.dtype)


SHAPES = ("its pipeline stage learns its shapes from its neighbours at its first step (a "
          "PipelineStage built without input_args and output_args), which a replay of some "
          "ranks cannot serve: build the stage with input_args= and output_args=")


def _unserved(why: str):
    raise BadInput(f"--ranks: this rank's step cannot be replayed alone: {why}; or replay all "
                   "ranks (drop --ranks)")


def _vote(wrote: list[torch.Tensor]) -> None:
    """A pipeline stage's first-step vote, answered "every stage knows its shapes" (1): a stage
    that knows its own, as the stage replayed alone must (`SHAPES`), needs nothing else from
    the others; the capture's re-run of the step held no vote (its stages had voted before)."""
    with torch.no_grad():
        for t in wrote:
            t.fill_(1)
