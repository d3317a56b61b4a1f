"""Writing a step's bundle: its manifest and tensors, `capture` on demand, the rescue on failure.

Guarantees: a bundle holds the state *before* its step (parameters, buffers, optimizer state,
the GradScaler's scale and growth tracker, every module's train/eval mode, every parameter's
``requires_grad``, RNG of Python/NumPy/torch CPU/accelerators), the batch, what the step looks
like (`Task.describe`) and the sha256 of the entry file and every user source file the process
imported, and those files themselves under ``code/`` (within the caps of
`nanbisect.bundle.codestore`; what is left out is listed with the reason); with them,
what a Guard adds (the recorded collectives, the history, the lookback).
Under torch.distributed every rank writes its part of one bundle
(`nanbisect.guard.parts.write_all_ranks`). A Guard's failing step is never lost to a write that
fails (`write_or_rescue`), whatever the writer raises (an `OSError`, safetensors' own
``SafetensorError`` on a full disk, anything else): in a single process the bundle goes to a
rescue directory under the system's temporary directory, with a warning; under torch.distributed
a rank that cannot write sends its part there and the bundle is marked partial. When even that
fails, `NonFiniteStep` is raised all the same, with ``bundle`` None and the reasons in its message.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle import codestore
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.format import write_bundle
from nanbisect.bundle.lookback import ROLE as LOOKBACK_ROLE
from nanbisect.bundle.lookback import Lookback
from nanbisect.bundle.state import (RngState, accelerator_types, encode, encode_model,
                                    encode_optimizer)
from nanbisect.bundle.tape import ROLE as TAPE_ROLE
from nanbisect.guard.coord import rank_info, tensor_labels
from nanbisect.guard.deadline import RankTimeout
from nanbisect.guard.parts import rescue_dir, write_all_ranks
from nanbisect.guard.entry import resolve_entry_file, warn_foreign_parts, warn_top_level
from nanbisect.task import Task, refuse_training_at_import
from nanbisect.util.text import exception_line


def _device_of(model: torch.nn.Module) -> str:
    t = next(model.parameters(), None)
    return str(t.device) if t is not None else str(devices.HOST)

def _bundle_parts(task: Task, batch: Any, rng: RngState, *, entry: str, step: int | None,
                  observed: dict | None, path: Path, entry_file: str | None,
                  sources: dict[str, str], scaler_state: dict | None,
                  sections: "Callable[[dict], dict] | None" = None,
                  alone: str | None = None) -> tuple[dict, dict]:
    """(the part's manifest, its tensors by role): the state, the batch and what the step looks
    like, then what ``sections(tensors)`` adds (a Guard's tape, history, lookback); ``alone``
    (why the ranks cannot meet): ``partial`` names the ranks' part as left out."""
    tensors: dict[str, dict] = {"model": {}, "optimizer": {}, "batch": {}, "rng": {}}
    entry_rel = os.path.relpath(entry_file, Path(path).resolve()) if entry_file else None
    model = task.model
    left_out: list[dict] = []     # parts that could not be serialised: manifest.partial
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    meta = encode_model(model, tensors["model"])
    meta["training"] = {n: m.training for n, m in model.named_modules()}
    meta["frozen"] = [n for n, p in model.named_parameters() if not p.requires_grad]
    base = {
        "entry": entry, "entry_file": entry_file, "entry_file_from_bundle": entry_rel,
        "step": step, "world_size": rank_info().world_size, "rank": rank_info().rank,
        "devices": {"captured_on": _device_of(model), "accelerators": accelerator_types()},
        "dtypes": dtypes,
        "observed": observed,
        "task": _or_left_out("task", task.describe, {}, left_out),
        "grad_scaler": scaler_state,
        # the sources' hashes, and the files themselves under code/ (within caps; copied by
        # `write_bundle`, `nanbisect.bundle.codestore`)
        "code": _or_left_out("code", lambda: _code_section(entry_file, sources), {}, left_out),
        "model": meta,
        "optimizer": (_or_left_out("optimizer", lambda: encode_optimizer(
            task.optimizer, tensors["optimizer"]), tensors["optimizer"], left_out,
            f"{type(task.optimizer).__name__}.state_dict() is not in torch's format")
            if task.optimizer is not None else None),
        "batch": _or_left_out("batch", lambda: encode(batch, "batch", tensors["batch"]),
                              tensors["batch"], left_out),
        "rng": rng.encode(tensors["rng"]),
    }
    extra = sections(tensors) if sections is not None else {}
    if alone is None:
        return {**base, **({"partial": left_out} if left_out else {}), **extra}, tensors
    ranks = {"part": "ranks", "why": f"this is rank {rank_info().rank}'s part alone: "
             f"{alone}"[:4000]}
    if left_out:     # the ranks' part listed after what could not be serialised
        return {**base, "partial": [*left_out, ranks], **extra}, tensors
    return {**base, **extra, "partial": [ranks]}, tensors


def _or_left_out(part: str, encode_part: Callable[[], Any], role: dict, left_out: list,
                 what: str = "") -> Any:
    """``encode_part()``, or None with ``{part, why}`` added to ``left_out`` (and what it had
    put in ``role`` taken out) when the writer cannot serialise that part: an optimizer of a
    foreign engine (DeepSpeed's ZeRO keeps its state in its own format), an object it does not
    understand. The rest of the bundle is written all the same (``manifest.partial``)."""
    try:
        return encode_part()
    except Exception as e:  # noqa: BLE001 - the failing step matters more than this part
        role.clear()
        why = f"{type(e).__name__}: {exception_line(e, limit=1000)}"
        left_out.append({"part": part, "why": f"{what} ({why})" if what else why})
        return None


def _code_section(entry_file: str | None, sources: dict[str, str]) -> dict:
    """The manifest's ``code``: the sources' hashes and the plan of the copies `write_bundle`
    stores (`codestore.plan`). Under torch.distributed only rank 0's part stores the copies
    (the ranks run one program; a replay of the ranks imports rank 0's, `code_choice`); the
    other parts keep the hashes and the layout."""
    section = {"entry_file": entry_file, "sources": sources,
               **codestore.plan(entry_file, sources)}
    if rank_info().distributed and rank_info().rank != 0:
        section.update(files={}, left_out={})
    return section


def scaler_state(task: Task) -> dict | None:
    """The scaler's state (scale, growth tracker, factors) as the bundle stores it."""
    s = task.grad_scaler
    if s is None:
        return None
    d = s.state_dict()    # the scale is read back once, here, at capture
    return {k: (float(v) if isinstance(v, float) else v) for k, v in d.items()}


def write_step(task: Task, batch: Any, rng: RngState, path: Path, *, entry: str,
           entry_file: str | None, step: int | None, observed: dict | None,
           sources: dict[str, str], scaler_state: dict | None, unique: bool = False,
           tape=None, history: "hist.HealthLog | None" = None,
           lookback: Lookback | None = None, write_timeout: float | None = None,
           alone: str | None = None) -> Path:
    """Write the bundle (every rank its part, under torch.distributed); return where it went
    (with ``unique``, a taken ``path`` gets the next free ``path-N``). Under torch.distributed,
    state identical on several ranks is written once (`guard.parts.write_all_ranks`, each rank's
    write bounded by ``write_timeout``, default ``NANBISECT_WRITE_TIMEOUT``); for a DDP model
    its process group's replicas are compared and what differs is reported. ``alone`` (why
    the ranks cannot meet): this rank's part is written as a bundle of its own, with no
    collective, its ``partial`` naming the ranks' part as left out."""
    def sections(tensors: dict) -> dict:
        out = {}
        if tape is not None:   # what each collective of the step gave this rank (--ranks)
            out["collectives"] = tape.manifest()
            tensors[TAPE_ROLE] = tape.tensors
        if history is not None:    # the last steps' health, the failing step last
            out["history"] = history.encode(tensors.setdefault(hist.ROLE, {}))
        if lookback is not None:   # a snapshot from up to 2K steps back and every step since
            section = lookback.encode(tensors.setdefault(LOOKBACK_ROLE, {}))
            if section is not None:
                out["lookback"] = section
        return out

    def build(p: Path, alone: str | None = None) -> tuple[dict, dict]:
        return _bundle_parts(task, batch, rng, entry=entry, step=step, observed=observed,
                             path=p, entry_file=entry_file, sources=sources,
                             scaler_state=scaler_state, sections=sections, alone=alone)

    if alone is not None:
        manifest, tensors = build(path, alone)
        return write_bundle(path, manifest, tensors, unique=unique)
    if rank_info().distributed:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        model = task.model
        group = (dist.get_process_group_ranks(model.process_group)
                 if isinstance(model, DistributedDataParallel) else None)
        return write_all_ranks(path, build, {"entry": entry, "step": step}, unique=unique,
                               replica_group=group,
                               labels=tensor_labels(model, task.optimizer),
                               timeout=write_timeout)
    manifest, tensors = build(path)
    return write_bundle(path, manifest, tensors, unique=unique)


def capture(task: Task, batch: Any, path: str | Path, *, entry: str, step: int | None = None
            ) -> Path:
    """Write a bundle of the current model, optimizer and RNG state plus ``batch``.

    Call it *before* running the step it should replay. Under torch.distributed, call it on
    every rank: each writes its part of one bundle.

    >>> import tempfile
    >>> from nanbisect.task import import_target
    >>> tasks = import_target("fixtures/tasks/healthy.py")
    >>> path = capture(tasks.task(), next(tasks.batches()), Path(tempfile.mkdtemp()) / "step1",
    ...                entry="fixtures/tasks/healthy.py:task", step=1)
    >>> (path / "manifest.json").is_file()
    True
    """
    refuse_training_at_import("nanbisect.capture(...)")
    entry_file = resolve_entry_file(entry)
    warn_top_level(entry_file, task, "nanbisect.capture")
    warn_foreign_parts(entry, task, "nanbisect.capture")
    return write_step(task, batch, RngState.get(accelerator_types()), Path(path), entry=entry,
                      entry_file=entry_file, step=step, observed=None,
                      sources=user_sources(entry_file), scaler_state=scaler_state(task))


def free_path(out: Path, step: int, suffix: str = "") -> Path:
    """Where a Guard's bundle of step ``step`` goes: ``out/step{step:06d}{suffix}``, or the first
    of ``-1``, ``-2``, ... beside it that is free."""
    base = out / f"step{step:06d}{suffix}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path


def write_or_rescue(write: Callable[[Path], Path], path: Path, out: Path, *,
                    distributed: bool) -> tuple[Path | None, str | None]:
    """``write(path)``: (where the bundle went, None). When that raises anything (``out`` went
    away or filled up since the Guard checked it; safetensors raises its own error), in a single
    process ``write`` goes into the rescue directory instead, with a warning; under
    torch.distributed each rank already sent its part there (`write_all_ranks`). When no bundle
    could be written anywhere: (None, why)."""
    try:
        return write(path), None
    except RankTimeout:          # the ranks cannot meet: the caller writes this rank's alone
        raise
    except Exception as e:  # noqa: BLE001 - the failing step is what this run exists to keep
        why = exception_line(e, limit=4000)
        if distributed:      # `BundleNotWritten`: why, rank by rank, and where this part went
            return None, why
    rescue = Path(tempfile.gettempdir()) / path.name
    try:
        rescue = rescue_dir() / path.name
        path = write(rescue)
    except Exception as e:  # noqa: BLE001 - NonFiniteStep still tells what happened
        return None, (f"writing it into '{out}' failed ({why}), and into the rescue directory "
                      f"'{rescue.parent}' too ({exception_line(e)})")
    warnings.warn(f"Guard: could not write the bundle into '{out}' ({why}); wrote it to "
                  f"'{path}' instead", RuntimeWarning, stacklevel=5)
    return path, None
