"""What every collective of the failing step gave each rank, recorded at capture and served to a
replay of a few ranks (``nanbisect run --ranks R,...``) that runs without the other ranks.

Capture (`record_step`, called by Guard on every rank when the failure flag trips): the failing
step runs once more from its pre-step snapshot under `TapeRecorder`, a TorchDispatchMode that
sees every dispatched collective (``c10d::*``: a tensor-parallel all-reduce, FSDP2's all-gather
and reduce-scatter, a DTensor reduction in ``clip_grad_norm_``; ``_c10d_functional::*``), waits for
it and keeps what it wrote, in order, with NaN/inf counts and a sha256 of what it read. DDP's
gradient reduction is kept per parameter instead (each parameter's gradient after every
micro-batch's backward, which is what the reduction, the user's comm hook included, left there),
so that a replay's bucket layout, which DDP builds anew, does not have to match the capture's; the
bucket collectives themselves are left out of the tape, as are DDP's bucket rebuilds.

Replay (`TapeServer`, in a process that is rank r of a world of N with torch's fake process group,
which communicates nothing): every collective of a replayed step is served the next recorded
result, checked against the recorded op, group size, shapes and dtypes (a mismatch is a one-line
error: the replay took another path than the capture); DDP buckets are served from the recorded
gradients by the comm hook nanbisect always installs (`multirank.ddp.ReductionObserver`).

What a served replay cannot decide: whether a collective computed its output correctly from its
participants' inputs. It re-runs nothing across ranks; it only knows the inputs of the ranks it
replays, and the NaN/inf counts the other ranks recorded at capture.
"""
from __future__ import annotations

import hashlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanbisect.bundle.state import local
from nanbisect.errors import BadInput
from nanbisect.replay.recorder import collective_writes, is_collective, read_args
from nanbisect.util.tensors import nan_inf_counts as _counts
from nanbisect.util.tensors import tensor_bytes

ROLE = "collectives"          # the tensor group of a part that holds the recorded outputs
SCHEMA = 1
_TORCH = str(Path(torch.__file__).parent) + "/"
_DDP_FILE = _TORCH + "nn/parallel/distributed.py"
_ENGINE = _TORCH + "autograd/graph.py"


def _skip(frame) -> bool:
    """Frames between a collective's caller and the mode: other modes, torch's op plumbing."""
    code = frame.f_code
    return code.co_name == "__torch_dispatch__" or code.co_filename.startswith((
        _TORCH + "_ops.py", _TORCH + "utils/_python_dispatch.py", _TORCH + "_dynamo/",
        _TORCH + "_compile.py", _TORCH + "distributed/c10d_logger",
        _TORCH + "distributed/distributed_c10d.py"))


def _caller():
    """The frame that called ``__torch_dispatch__``; None on a thread with no Python frame
    (CUDA's autograd device threads, where DDP's reducer issues its bucket reductions)."""
    try:
        return sys._getframe(2)
    except ValueError:
        return None


def ddp_internal(frame, ddp: bool = True) -> str | None:
    """Is the collective being dispatched one of DDP's own (only asked for a DDP model)?
    ``"bucket"``: a gradient bucket's reduction (from DDP's reducer: no Python frame but the
    autograd engine's, or none at all on a device thread; or from a comm hook: a frame below the
    autograd engine holds a GradBucket); ``"rebuild"``: DDP rebuilding its buckets (its first
    iterations only); None: anything else (DDP's buffer broadcast included, which every forward
    repeats)."""
    import torch.distributed as dist

    if not ddp:
        return None
    f = frame
    while f is not None and _skip(f):
        f = f.f_back
    if f is None:
        return "bucket"
    if f.f_code.co_filename == _ENGINE:
        return "bucket"                     # the reducer's own all-reduce (no comm hook)
    if f.f_code.co_filename == _DDP_FILE and f.f_code.co_name == "_pre_forward":
        return "rebuild"
    g = f
    while g is not None and g.f_code.co_filename != _ENGINE:
        if any(isinstance(v, dist.GradBucket) for v in g.f_locals.values()):
            return "bucket"                 # inside a comm hook
        g = g.f_back
    return None


def _digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' dtypes, shapes and bytes (a 0-dim one too: a collective on a
    scalar, e.g. the loss all-reduced for logging).

    >>> _digest([torch.tensor(1.0)]) == _digest([torch.tensor(1.0)]) != _digest([torch.ones(1)])
    True
    """
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(bytes(tensor_bytes(t)))
    return h.hexdigest()


def _tensors(vals: list[Any]) -> list[torch.Tensor]:
    return [local(t) for t in torch.utils._pytree.tree_leaves(vals) if isinstance(t, torch.Tensor)]


def _group_size(func, args: tuple, kwargs: dict) -> int | None:
    """The size of the process group a collective runs on (None: not found)."""
    pg = _group(func, args, kwargs)
    return pg.size() if pg is not None else None


def _group(func, args: tuple, kwargs: dict):
    import torch.distributed as dist

    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(v)
            except (RuntimeError, TypeError, AttributeError):
                continue
        if isinstance(v, str) and func.namespace.endswith("c10d_functional"):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group
                return _resolve_process_group(v)
            except (RuntimeError, KeyError, ValueError):
                continue
    return None


def _group_ranks(func, args: tuple, kwargs: dict) -> list[int] | None:
    """The global ranks of the process group a collective runs on (None: not found)."""
    import torch.distributed as dist

    pg = _group(func, args, kwargs)
    try:
        return sorted(dist.get_process_group_ranks(pg)) if pg is not None else None
    except (RuntimeError, ValueError, KeyError):
        return None


def _outputs(func, args: tuple, kwargs: dict, out: Any) -> list[torch.Tensor]:
    """What a collective wrote (c10d: its output arguments; functional: what it returned)."""
    if func.namespace == "c10d":
        return collective_writes(func, args, kwargs)
    return _tensors([out])


def _finish(func, out: Any) -> None:
    """Wait until the collective's output is written."""
    for x in torch.utils._pytree.tree_leaves(out):
        if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
            x.wait()
    if func.namespace.endswith("c10d_functional"):
        for t in _tensors([out]):
            torch.ops._c10d_functional.wait_tensor(t)


def _wanted(func) -> bool:
    name = str(func)
    return is_collective(name) and "wait_tensor" not in name and func._schema.name not in (
        "c10d::barrier", "c10d::monitored_barrier_")


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
    kind: str = "tape"        # "tape": served in order; "ddp-bucket": counts only
    group: list[int] | None = None     # the global ranks of its process group

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Tape:
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


class TapeRecorder(TorchDispatchMode):
    """Capture: keep what every collective of the step wrote, in order (see the module doc)."""

    def __init__(self, tape: Tape, ddp: bool = False) -> None:
        super().__init__()
        self.tape = tape
        self.ddp = ddp
        self.error: str | None = None     # the first thing that went wrong while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _wanted(func) or self.error is not None:
            return func(*args, **kwargs)
        # NB: never raise out of here: the step must go on, with its collectives matched on
        # every rank; a failure to record makes the tape unusable, not the step
        try:
            internal = ddp_internal(_caller(), self.ddp)
            if internal == "rebuild":
                return func(*args, **kwargs)
            reads = _tensors(read_args(func, args, kwargs))
            in_nan, in_inf = _counts(reads)
            digest = _digest(reads) if internal is None else ""
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            _finish(func, out)
            wrote = _outputs(func, args, kwargs, out)
            out_nan, out_inf = _counts(wrote)
            i = len([e for e in self.tape.entries if e.kind == "tape"])
            e = Entry(str(func), _group_size(func, args, kwargs), [list(t.shape) for t in wrote],
                      [str(t.dtype).removeprefix("torch.") for t in wrote], digest, in_nan,
                      in_inf, out_nan, out_inf, "ddp-bucket" if internal else "tape",
                      _group_ranks(func, args, kwargs))
            self.tape.entries.append(e)
            if internal is None:
                for j, t in enumerate(wrote):
                    self.tape.tensors[f"c{i}.{j}"] = t.detach().to("cpu", copy=True).contiguous()
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
        return out


def record_step(task, batch: Any) -> tuple[Tape | None, str | None]:
    """Run the Task's step once under `TapeRecorder` (the caller restores the pre-step state and
    RNG before and after); keep DDP's reduced gradients per parameter per micro-batch. Returns
    the tape, or (None, why) when it could not be recorded (the step raised, or recording did):
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
                                local(p.grad).detach().to("cpu", copy=True).contiguous())
                    tape.micro_batches += 1
    except Exception as e:  # noqa: BLE001 - the bundle matters more than the tape
        return None, f"re-running the step raised {type(e).__name__}: {str(e)[:200]}"
    if rec.error is not None:
        return None, f"recording a collective failed ({rec.error})"
    loss = last.total if last is not None else None
    finite = [bool(torch.isfinite(local(p.data)).all()) for p in model.parameters()]
    tape.rerun_failed = not (all(finite) and (loss is None or bool(
        torch.isfinite(local(loss).detach()).all())))
    return tape, None


# ------------------------------------------------------------------------------------------
# replay


class TapeMismatch(BadInput):
    """The replay issued a collective the capture did not (another path through the code)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: the replay takes another path through the code than the "
                         "capture did (other code, other shapes), so the recorded collectives "
                         "do not fit it; replay all ranks (drop --ranks)")


class TapeServer(TorchDispatchMode):
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
                                   f"{j} of shape {shape} in {ROLE}.safetensors; {_FIX}")
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _wanted(func):
            return func(*args, **kwargs)
        if ddp_internal(_caller(), self.ddp) == "rebuild":
            return func(*args, **kwargs)
        reads = _tensors(read_args(func, args, kwargs))
        out = func(*args, **kwargs)
        _finish(func, out)
        wrote = _outputs(func, args, kwargs, out)
        if self.i >= len(self.entries):
            raise TapeMismatch(f"the replay issued collective #{self.i} ({func}), the capture "
                               f"recorded only {len(self.entries)}")
        e = self.entries[self.i]
        shapes = [list(t.shape) for t in wrote]
        dtypes = [str(t.dtype).removeprefix("torch.") for t in wrote]
        if (e.op, e.shapes) != (str(func), shapes) or (
                e.group_size is not None and _group_size(func, args, kwargs) not in (
                    None, e.group_size)):
            raise TapeMismatch(f"collective #{self.i}: the replay issued {func} writing "
                               f"{shapes}, the capture recorded {e.op} writing {e.shapes}")
        if self.check_inputs and e.in_sha256 and _digest(reads) != e.in_sha256 and \
                dtypes == e.dtypes:
            self.served_inputs_differ.append(self.i)
        with torch.no_grad():
            for j, t in enumerate(wrote):
                t.copy_(self.tensors[f"c{self.i}.{j}"].to(device=t.device, dtype=t.dtype))
        self.i += 1
        return out

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


_FIX = "re-capture the bundle"
_INTS = ("in_nan", "in_inf", "out_nan", "out_inf")


def _ints(v) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def parse(manifest, where: str) -> tuple[list[Entry], dict | None]:
    """A part's ``collectives`` (untrusted JSON) as entries and its DDP record; `BadInput`
    naming the first thing that is not as the recorder writes it."""
    def bad(why: str) -> BadInput:
        return BadInput(f"{where}: the recorded collectives {why}; {_FIX}")

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
              and _ints([e[k] for k in _INTS]) and e["kind"] in ("tape", "ddp-bucket")
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


def iter_recorded(manifest: dict, where: str = "bundle") -> Iterator[Entry]:
    yield from parse(manifest, where)[0]
