"""Freeze a training step into a bundle: `capture` on demand, `Guard` on failure.

Guarantees: a bundle holds the state *before* its step (parameters, buffers, optimizer state,
the GradScaler's scale and growth tracker, every module's train/eval mode, every parameter's
``requires_grad``, RNG of Python/NumPy/torch CPU/accelerators), the batch, what the step looks
like (`Task.describe`) and the sha256 of the entry file and every user source file the process
imported. `Guard.step` runs the Task's whole step (`nanbisect.step.run_step`: micro-batches,
scaler, clipping), the same code every replay runs. A healthy step costs one snapshot copy of the
parameters, buffers and optimizer state (kept on their device), one norm per parameter (and per
gradient, for the history) and one host synchronisation; exact checks run only when that screen
trips. Every bundle holds the last ``history`` steps' health (`nanbisect.history`); with
``lookback`` it holds the steps since a snapshot up to 2K steps back
(`nanbisect.bundle.lookback`); with ``spike`` a loss far above its recent history writes a bundle
and training goes on. Gradients are not screened on
their own: a non-finite gradient becomes a non-finite parameter through the update (so it is
caught, and classified as a gradient fault by the exact check). A step the GradScaler skips is
normal; ``max_scaler_skips`` skips in a row is a failure (the scaler has stalled), bundled as the
last skipped step. With ``clip_grad_norm``, the gradients' kind (NaN or inf) is the one the total
norm had before clipping turned it into NaN. Not guaranteed: custom loops (`Guard.watch`) are
replayed through the Task, not through the loop: what the loop does beyond the Task's fields is
not in the bundle.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch

from nanbisect import devices
from nanbisect import history as hist
from nanbisect.bundle.code import user_sources
from nanbisect.bundle.format import write_bundle
from nanbisect.bundle.lookback import ROLE as LOOKBACK_ROLE
from nanbisect.bundle.lookback import Lookback
from nanbisect.bundle.state import (RngState, accelerator_types, encode, encode_model,
                                    encode_optimizer, local)
from nanbisect.errors import BadInput, NonFiniteStep
from nanbisect.multirank.coord import (any_rank, broadcast_str, rank_info, tensor_labels,
                                      write_all_ranks)
from nanbisect.multirank.tape import ROLE as TAPE_ROLE
from nanbisect.multirank.tape import record_step
from nanbisect.step import run_step
from nanbisect.task import Task, split_entry

LISTED = 20     # names listed per kind in `observed`; the counts say how many there were


def _device_of(model: torch.nn.Module) -> str:
    t = next(model.parameters(), None)
    return str(t.device) if t is not None else "cpu"


def resolve_entry_file(entry: str) -> str | None:
    """Check that ``entry`` names a function that exists, without running any code; return the
    absolute path of a file entry. Raises `BadInput` naming the fix."""
    target, func = split_entry(entry)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise BadInput(f"entry '{entry}': {target} does not exist (from {os.getcwd()}); "
                           "give the path of the file that defines the entry function")
        source = path
    else:
        mod = sys.modules.get(target)
        if mod is not None:
            if not callable(getattr(mod, func, None)):
                raise BadInput(f"entry '{entry}': module {target} has no function '{func}'; "
                               "name the function that returns nanbisect.Task")
            return None
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise BadInput(f"entry '{entry}': module {target} cannot be found; install it, add "
                           "its directory to PYTHONPATH, or give the entry as path/to/file.py:func")
        if not spec.origin or not spec.origin.endswith(".py"):
            return None
        source = Path(spec.origin)
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError) as e:
        raise BadInput(f"entry '{entry}': {source} cannot be read as Python ({e}); fix it")
    # every name the module could bind, at any depth (a def inside `if`/`try` at the top level
    # counts; a star import could bind anything): only a name bound nowhere is refused
    names, star = set(), False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            star = star or any(a.name == "*" for a in node.names)
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if func not in names and not star:
        raise BadInput(f"entry '{entry}': {source} defines no '{func}'; name the function that "
                       "returns nanbisect.Task")
    return str(source.resolve()) if target.endswith(".py") else None


def _check_out(out: Path) -> None:
    """Bundles can be written into ``out``: create it and write (then remove) a probe file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".nanbisect-probe-"):
            pass
    except OSError as e:
        raise BadInput(f"Guard(out='{out}'): bundles cannot be written there ({e.strerror}); "
                       "pass a directory you can write to") from None


def _bundle_parts(task: Task, batch: Any, rng: RngState, *, entry: str, step: int | None,
                  observed: dict | None, path: Path, entry_file: str | None,
                  sources: dict[str, str], scaler_state: dict | None) -> tuple[dict, dict]:
    tensors: dict[str, dict] = {"model": {}, "optimizer": {}, "batch": {}, "rng": {}}
    entry_rel = os.path.relpath(entry_file, Path(path).resolve()) if entry_file else None
    model = task.model
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    meta = encode_model(model, tensors["model"])
    meta["training"] = {n: m.training for n, m in model.named_modules()}
    meta["frozen"] = [n for n, p in model.named_parameters() if not p.requires_grad]
    manifest = {
        "entry": entry, "entry_file": entry_file, "entry_file_from_bundle": entry_rel,
        "step": step, "world_size": rank_info().world_size, "rank": rank_info().rank,
        "devices": {"captured_on": _device_of(model), "accelerators": accelerator_types()},
        "dtypes": dtypes,
        "observed": observed,
        "task": task.describe(),
        "grad_scaler": scaler_state,
        "code": {"entry_file": entry_file, "sources": sources},
        "model": meta,
        "optimizer": (encode_optimizer(task.optimizer, tensors["optimizer"])
                      if task.optimizer is not None else None),
        "batch": encode(batch, "batch", tensors["batch"]),
        "rng": rng.encode(tensors["rng"]),
    }
    return manifest, tensors


def _scaler_state(task: Task) -> dict | None:
    """The scaler's state (scale, growth tracker, factors) as the bundle stores it."""
    s = task.grad_scaler
    if s is None:
        return None
    d = s.state_dict()    # the scale is read back once, here, at capture
    return {k: (float(v) if isinstance(v, float) else v) for k, v in d.items()}


def _write(task: Task, batch: Any, rng: RngState, path: Path, *, entry: str,
           entry_file: str | None, step: int | None, observed: dict | None,
           sources: dict[str, str], scaler_state: dict | None, unique: bool = False,
           tape=None, history: "hist.HealthLog | None" = None,
           lookback: Lookback | None = None) -> Path:
    """Write the bundle (every rank its part, under torch.distributed); return where it went
    (with ``unique``, a taken ``path`` gets the next free ``path-N``). Under torch.distributed,
    state identical on several ranks is written once (`multirank.coord.write_all_ranks`); for a
    DDP model its process group's replicas are compared and what differs is reported."""
    def build(p: Path) -> tuple[dict, dict]:
        manifest, tensors = _bundle_parts(task, batch, rng, entry=entry, step=step,
                                          observed=observed, path=p, entry_file=entry_file,
                                          sources=sources, scaler_state=scaler_state)
        if tape is not None:   # what each collective of the step gave this rank (--ranks)
            manifest["collectives"] = tape.manifest()
            tensors[TAPE_ROLE] = tape.tensors
        if history is not None:    # the last steps' health, the failing step last
            manifest["history"] = history.encode(tensors.setdefault(hist.ROLE, {}))
        if lookback is not None:   # a snapshot from up to 2K steps back and every step since
            section = lookback.encode(tensors.setdefault(LOOKBACK_ROLE, {}))
            if section is not None:
                manifest["lookback"] = section
        return manifest, tensors

    if rank_info().distributed:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        model = task.model
        group = (dist.get_process_group_ranks(model.process_group)
                 if isinstance(model, DistributedDataParallel) else None)
        return write_all_ranks(path, build, {"entry": entry, "step": step}, unique=unique,
                               replica_group=group,
                               labels=tensor_labels(model, task.optimizer))
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
    entry_file = resolve_entry_file(entry)
    return _write(task, batch, RngState.get(accelerator_types()), Path(path), entry=entry,
                  entry_file=entry_file, step=step, observed=None,
                  sources=user_sources(entry_file), scaler_state=_scaler_state(task))


def _live_scale(scaler) -> torch.Tensor | None:
    """The scaler's scale tensor, on the device; None without an enabled scaler, or before its
    first step (it makes the tensor then, from its initial scale)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return getattr(scaler, "_scale", None)     # NB: private, stable since torch 1.6


class _Snapshot:
    """Pre-step copies of everything an optimizer step or a forward pass may change in place.

    On an accelerator (CUDA, NPU) with an optimizer, the copies of parameters and optimizer
    state (only the optimizer step writes them) are made on a side stream, so they overlap the
    forward and backward passes; the optimizer's step waits for them (a step pre-hook makes the
    current stream wait on the copies' event), and so does every use of the copies (`wait`).
    Buffers (a forward pass may update them: BatchNorm's running statistics) and the
    GradScaler's scale are copied on the current stream before the step, as on the CPU.
    """

    def __init__(self, side_stream: bool = True) -> None:
        self._copies: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []
        self._opt_state: dict = {}
        self._groups: list[dict] = []
        self.scale: torch.Tensor | None = None    # the scaler's scale before the step
        self.side_stream = side_stream
        self._stream = None        # the side stream, made on first use
        self._done = None          # its event: reached when the side copies are complete
        self._hooked: tuple | None = None   # (optimizer, hook handle) that waits for them

    def wait(self) -> None:
        """Make the current stream wait for the side copies (no-op without them)."""
        done, self._done = self._done, None
        if done is not None:
            devices.entry(self._stream.device).wait_event(self._stream.device, done)

    def take(self, model: torch.nn.Module, opt: torch.optim.Optimizer | None,
             scaler=None) -> None:
        self.wait()
        params = [local(p.data) for p in model.parameters()]
        buffers = [local(b) for b in model.buffers()]
        state: list[torch.Tensor] = []
        self._opt_state = {}
        if opt is not None:
            for p, st in opt.state.items():
                self._opt_state[p] = {k: v for k, v in st.items()}
                state += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
            self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        live = params + buffers + state
        scale = _live_scale(scaler)
        if scale is not None:
            live += [scale, scaler._growth_tracker]   # two 1-element tensors
        if [t.shape for t in live] != [t.shape for t in self._copies] or any(
                a.dtype != b.dtype or a.device != b.device for a, b in zip(live, self._copies)):
            self._copies = [torch.empty_like(t) for t in live]
        self._live = live
        # the scale before the step; None: the step is the scaler's first
        self.scale = self._copies[-2] if scale is not None else None
        if not live:
            return
        dev = live[0].device
        dt = devices.entry(dev)
        streams = self.side_stream and opt is not None and dt.has_streams()
        side = list(range(len(params))) + [len(params) + len(buffers) + i
                                           for i in range(len(state))]
        side = [i for i in side if live[i].device == dev]
        if not streams or not side:
            torch._foreach_copy_(self._copies, live)
            return
        if self._stream is None or self._stream.device != dev:
            self._stream = dt.new_stream(dev)
        self._done = dt.side_copy(self._stream, [self._copies[i] for i in side],
                                  [live[i] for i in side])
        chosen = set(side)
        rest = [i for i in range(len(live)) if i not in chosen]
        if rest:
            torch._foreach_copy_([self._copies[i] for i in rest], [live[i] for i in rest])
        if self._hooked is None or self._hooked[0] is not opt:
            if self._hooked is not None:
                self._hooked[1].remove()
            self._hooked = (opt, opt.register_step_pre_hook(lambda *_: self.wait()))

    @torch.no_grad()
    def swap(self, opt: torch.optim.Optimizer | None) -> None:
        """Exchange the live state with the copies (twice: back as it was), one tensor's worth
        of extra memory at a time; the optimizer's state entries and groups too."""
        self.wait()
        for live, copy in zip(self._live, self._copies):
            tmp = live.clone()
            live.copy_(copy)
            copy.copy_(tmp)
        if opt is None:
            return
        state = {p: dict(st) for p, st in opt.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        for p in list(opt.state):
            if p not in self._opt_state:
                del opt.state[p]
        for p, st in self._opt_state.items():
            opt.state[p] = dict(st)
        for g, saved in zip(opt.param_groups, self._groups):
            g.update(saved)
        self._opt_state, self._groups = state, groups

    @torch.no_grad()
    def restore(self, opt: torch.optim.Optimizer | None) -> None:
        self.wait()
        for dst, src in zip(self._live, self._copies):
            dst.copy_(src)
        if opt is not None:
            for p in list(opt.state):
                if p not in self._opt_state:
                    del opt.state[p]  # state created by the failing step itself
            for p, st in self._opt_state.items():
                opt.state[p] = dict(st)
            for g, saved in zip(opt.param_groups, self._groups):
                g.update(saved)


@dataclass
class StepWatch:
    """Handle yielded by `Guard.watch`; set ``loss`` so the guard can check and record it.
    ``batch`` is what the bundle stores as the step's batch (the one given to ``watch``; a loop
    that learns its micro-batches as it goes may set it before the block ends)."""

    loss: torch.Tensor | None = None
    value: float | None = None
    batch: Any = None


def _norms(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The float32 L2 norm of each tensor (0 for None), on ``device``: non-finite iff some element
    is (or the sum of squares overflows float32: an exact check then clears it)."""
    if not tensors:
        return torch.zeros(0, device=device)
    ts = [local(t) for t in tensors if t is not None]
    if len(ts) == len(tensors) and all(t.device == device for t in ts):
        try:
            return torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32))
        except (RuntimeError, TypeError):   # a dtype foreach has no kernel for: one at a time
            pass
    zero = torch.zeros((), device=device)
    return torch.stack([torch.linalg.vector_norm(local(t).detach().abs().float()).to(device)
                        if t is not None else zero for t in tensors])


def _screen(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The screen of a step: the sum of the parameters' norms (`_norms`), non-finite iff some
    element is."""
    return _norms(tensors, device).sum()


@dataclass(frozen=True)
class Spike:
    """`Guard(spike=...)`: write a bundle (and go on training) when a step's loss lies
    ``threshold`` robust standard deviations above the median of the ``window`` steps before it
    (`nanbisect.history.jump_score`; at least 8 of them), at most ``max_bundles`` per run and
    not again until the loss has come back below the threshold."""

    threshold: float = 6.0
    window: int = hist.JUMP_WINDOW
    max_bundles: int = 3


def _bad_names(named: list[tuple[str, torch.Tensor]]) -> dict:
    # NB: not util.tensors' counts: a name is bad or not, and .any() is all it needs
    out = {"nan": [], "inf": []}
    for name, t in named:
        t = local(t)
        if torch.isnan(t).any():
            out["nan"].append(name)
        elif torch.isinf(t).any():
            out["inf"].append(name)
    return out


def _kind(x: float) -> str:
    return "nan" if x != x else ("inf" if abs(x) == float("inf") else "finite")


def _listed(names: dict) -> dict:
    """Names per kind, at most `LISTED` each, with the full counts."""
    return {**{k: v[:LISTED] for k, v in names.items()},
            **{f"{k}_count": len(v) for k, v in names.items()}}


class Guard:
    """Run training steps and freeze the first non-finite one into a bundle.

    >>> import tempfile
    >>> from nanbisect.task import import_target
    >>> adam_eps0 = import_target("fixtures/tasks/optimizer_adam_eps0.py")
    >>> guard = Guard(adam_eps0.task(), entry="fixtures/tasks/optimizer_adam_eps0.py:task",
    ...               out=tempfile.mkdtemp())
    >>> try:
    ...     for batch in adam_eps0.batches():
    ...         loss = guard.step(batch)
    ... except NonFiniteStep as e:
    ...     print(e.bundle.name, e.observed["first"])
    step000000 param
    """

    def __init__(self, task: Task, *, entry: str, out: str | Path, start_step: int = 0,
                 max_scaler_skips: int = 10, history: int | None = hist.DEFAULT_N,
                 lookback: int | None = None, lookback_on: str = "device",
                 spike: "float | Spike | None" = None, snapshot_stream: bool = True) -> None:
        if not isinstance(task, Task):
            raise BadInput(f"Guard: got a {type(task).__name__}, not a nanbisect.Task; pass "
                           "Task(model=..., optimizer=..., loss_fn=...)")
        self._entry_file = resolve_entry_file(entry)
        self.task, self.entry, self.out = task, entry, Path(out)
        _check_out(self.out)
        if max_scaler_skips < 1:
            raise BadInput(f"Guard(max_scaler_skips={max_scaler_skips}): give a count >= 1")
        self.max_scaler_skips = max_scaler_skips
        self.step_index = start_step
        self.scaler_skips = 0               # steps in a row the scaler skipped
        self._accel = accelerator_types()
        if not isinstance(snapshot_stream, bool):
            raise BadInput(f"Guard(snapshot_stream={snapshot_stream!r}): give True or False")
        self._snapshot = _Snapshot(side_stream=snapshot_stream)
        self._rank = rank_info()
        self._sources = user_sources(self._entry_file)   # the code as training started
        if history is not None and (type(history) is not int or history < 0):
            raise BadInput(f"Guard(history={history!r}): give a number of steps (0 or None: "
                           "no history)")
        names = [n for n, _ in task.model.named_parameters()]
        self._history = hist.HealthLog(history, names) if history else None
        if self._rank.distributed and (lookback or spike):
            raise BadInput(f"Guard({'lookback' if lookback else 'spike'}=...) is not supported "
                           "under torch.distributed yet; drop it for a multi-rank job")
        self._lookback = Lookback(lookback, lookback_on) if lookback else None
        if spike is not None and not isinstance(spike, Spike):
            if isinstance(spike, bool) or not isinstance(spike, (int, float)) or spike <= 0:
                raise BadInput(f"Guard(spike={spike!r}): give a threshold > 0 (robust standard "
                               "deviations above the recent median) or nanbisect.Spike(...)")
            spike = Spike(threshold=float(spike))
        if spike is not None and self._history is None:
            raise BadInput("Guard(spike=...) needs the history it compares with; keep history "
                           "on (history=N)")
        self.spike = spike
        self.spikes: list[Path] = []        # the spike bundles written, oldest first
        self._in_spike = False
        self._lr: Any = None

    def step(self, batch: Any) -> float:
        """Run the Task's step (micro-batches, scaler, clipping, optimizer); return its loss
        (unscaled: the mean over micro-batches)."""
        task = self.task
        rng = self._begin()
        if task.optimizer is not None:
            task.optimizer.zero_grad(set_to_none=True)
        last = None
        for last in run_step(task, batch):
            pass
        self._end(batch, rng, last.total if last is not None else None,
                  grad_norm=last.grad_norm, skipped=last.skipped)
        return self._value

    @contextmanager
    def watch(self, batch: Any) -> Iterator[StepWatch]:
        """Guard a step that your own loop runs (forward, backward, optimizer step inside).

        The bundle replays through the Task (its loss_fn, scaler, clipping and accumulation),
        not through your loop: a loop that does more than the Task describes replays as
        ``replay-mismatch``.

        >>> import tempfile
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = Guard(Task(model, opt, lambda m, b: m(b).sum()),
        ...               entry="fixtures/tasks/healthy.py:task", out=tempfile.mkdtemp())
        >>> with guard.watch(torch.ones(3, 2)) as w:
        ...     opt.zero_grad(); w.loss = model(torch.ones(3, 2)).sum(); w.loss.backward()
        ...     opt.step()
        >>> isinstance(w.value, float)
        True
        """
        rng = self._begin()
        w = StepWatch(batch=batch)
        yield w
        self._value = None
        try:
            self._end(w.batch, rng, w.loss)
        finally:
            w.value = self._value

    # -- the step's two halves -----------------------------------------------------------
    def _begin(self) -> RngState:
        rng = RngState.get(self._accel)
        task = self.task
        self._snapshot.take(task.model, task.optimizer, task.grad_scaler)
        if self._lookback is not None:
            self._lookback.begin(self.step_index, task.model, task.optimizer, task.grad_scaler)
        # the learning rate this step uses (a scheduler changes it after the step)
        self._lr = task.optimizer.param_groups[0].get("lr") if task.optimizer is not None and \
            task.optimizer.param_groups else None
        return rng

    def _end(self, batch: Any, rng: RngState, loss: torch.Tensor | None,
             grad_norm: torch.Tensor | None = None, skipped: torch.Tensor | None = None) -> None:
        self._snapshot.wait()     # a step without the Task's optimizer: its copies, before all
        params = [local(p.data) for p in self.task.model.parameters()]
        dev = params[0].device if params else torch.device("cpu")
        scaler, scale = self.task.grad_scaler, _live_scale(self.task.grad_scaler)
        if skipped is None and scale is not None:
            # a loop of its own (watch): the scaler skipped when it backed its scale off
            before = (self._snapshot.scale if self._snapshot.scale is not None else
                      torch.full_like(scale, scaler._init_scale))
            skipped = (scale < before).float()
        loss_t = (local(loss).detach().float().reshape(-1).sum().to(dev) if loss is not None
                  else torch.zeros((), device=dev))
        norms = _norms(params, dev)
        slots = {"loss": loss_t, "screen": norms.sum()}
        for key, t in (("grad_norm", grad_norm), ("skipped", skipped)):
            if t is not None:
                slots[key] = t.detach().float().reshape(()).to(dev)
        if self._history is not None:
            # per parameter: its norm after the update (the screen) and its gradient's, kept on
            # the device; the global gradient norm (clipping's, when it clips) read with the rest
            grads = _norms([p.grad for p in self.task.model.parameters()], dev)
            self._history.record_norms(self.step_index, norms, grads, lambda: [
                n for n, _ in self.task.model.named_parameters()])
            if grad_norm is None:
                slots["history_grad_norm"] = torch.linalg.vector_norm(grads)
            if isinstance(self._lr, torch.Tensor):
                slots["lr"] = self._lr.detach().float().reshape(()).to(dev)
        # NB: gradients are not screened: a non-finite gradient reaches the parameters through
        # any update with lr > 0, and a step the GradScaler skips must not trip the guard.
        # The one host synchronisation of a healthy step (under torch.distributed, after one
        # all-reduce of a one-element flag, so that all ranks agree on a failure):
        vals = torch.stack(list(slots.values()))
        stall_next = self.scaler_skips + 1 >= self.max_scaler_skips
        if self._rank.distributed:
            flag = (~torch.isfinite(vals[:2])).any()
            if skipped is not None and stall_next:
                flag = flag | (skipped.reshape(()).to(dev) > 0)
            flag = any_rank(flag.float().reshape(1).cpu() if self._rank.backend == "gloo"
                            else flag.float().reshape(1))
            vals = torch.cat([vals, flag.to(dev)])
        got = vals.tolist()
        read = dict(zip(slots, got))
        loss_v, param_v = read["loss"], read["screen"]
        norm_v, skip_v = read.get("grad_norm"), read.get("skipped")
        self._value = loss_v if loss is not None else None
        if self._history is not None:
            lr = read.get("lr", self._lr)
            self._history.add({
                "step": self.step_index, "loss": self._value,
                "grad_norm": norm_v if norm_v is not None else read.get("history_grad_norm"),
                "skipped": bool(skip_v > 0) if skip_v is not None else False,
                "lr": float(lr) if isinstance(lr, (int, float)) else None})
        if self._lookback is not None:
            self._lookback.end(self.step_index, rng, batch)
        if skip_v is not None:
            self.scaler_skips = self.scaler_skips + 1 if skip_v > 0 else 0
        stalled = self.scaler_skips >= self.max_scaler_skips
        tripped = (got[-1] > 0 if self._rank.distributed else
                   _kind(param_v) != "finite" or _kind(loss_v) != "finite" or stalled)
        if not tripped:
            self._check_spike(batch, rng, loss_v if loss is not None else None)
            self.step_index += 1
            return
        observed = self._observe(loss_v if loss is not None else None, norm_v, stalled)
        if self._rank.distributed:  # does any rank confirm it with the exact check?
            confirmed = any_rank(torch.tensor(
                [float(observed is not None)],
                device="cpu" if self._rank.backend == "gloo" else dev))
            if confirmed.item() == 0:
                self.step_index += 1
                return
            observed = observed or {"step": self.step_index, "first": "other-rank",
                                    "loss": loss_v, "summary": {"local": "finite"}}
        elif observed is None:  # the screen overflowed on finite values
            self.step_index += 1
            return
        self._restore(scale)
        tape = None
        if self._rank.distributed:
            # every rank runs the failing step once more, from the same pre-step state and RNG,
            # keeping what each collective gave it: a replay of a few ranks serves it to them
            rng.set()
            tape, why = record_step(self.task, batch)
            self._restore(scale)
            lost = any_rank(torch.tensor([float(tape is None)], device=(
                "cpu" if self._rank.backend == "gloo" else dev)))
            if lost.item() > 0:   # every rank agrees: a bundle without a tape, never none
                if why:
                    warnings.warn(f"Guard: the failing step's collectives could not be recorded "
                                  f"({why}); the bundle replays all ranks only (no --ranks)",
                                  RuntimeWarning, stacklevel=3)
                tape = None
        path = self._free_path()
        if self._rank.distributed:
            path = Path(broadcast_str(str(path)))
            observed["rank"] = self._rank.rank
        # the hashes read when training started win: a file edited since is not what ran
        sources = {**user_sources(self._entry_file), **self._sources}
        write = partial(_write, self.task, batch, rng, entry=self.entry,
                        entry_file=self._entry_file, step=self.step_index, observed=observed,
                        sources=sources, scaler_state=_scaler_state(self.task), unique=True,
                        tape=tape, history=self._history, lookback=self._lookback)
        try:
            path = write(path)
        except OSError as e:
            if self._rank.distributed:   # the ranks would have to agree on another place
                raise
            # `out` went away or filled up since the Guard checked it: the failing step is
            # what this run exists to keep, so keep it somewhere
            rescue = Path(tempfile.gettempdir()) / f"nanbisect-rescue-{os.getuid()}" / path.name
            path = write(rescue)
            warnings.warn(f"Guard: could not write the bundle into '{self.out}' ({e.strerror or e}"
                          f"); wrote it to '{path}' instead", RuntimeWarning, stacklevel=3)
        raise NonFiniteStep(path, observed)

    def _check_spike(self, batch: Any, rng: RngState, loss: float | None) -> None:
        """A loss far above its recent history: write a bundle of the step, go on training."""
        if self.spike is None or loss is None or self._history is None:
            return
        before = self._history.losses_before(self.spike.window)
        score = hist.jump_score(loss, before)
        if score is None or score[0] < self.spike.threshold:
            self._in_spike = False
            return
        if self._in_spike or len(self.spikes) >= self.spike.max_bundles:
            return
        self._in_spike = True
        z, med, scale = score
        observed = {"step": self.step_index, "first": "spike", "loss": loss,
                    "summary": {"loss": "finite", "grads": "finite", "params": "finite"},
                    "spike": {"median": med, "scale": scale, "z": round(z, 2),
                              "threshold": self.spike.threshold, "window": len(before)}}
        sources = {**user_sources(self._entry_file), **self._sources}
        opt = self.task.optimizer
        self._snapshot.swap(opt)     # the live tensors hold the pre-step state while it writes
        try:
            path = _write(self.task, batch, rng, self._free_path("-spike"), entry=self.entry,
                          entry_file=self._entry_file, step=self.step_index, observed=observed,
                          sources=sources, scaler_state=_scaler_state(self.task), unique=True,
                          history=self._history, lookback=self._lookback)
        except OSError as e:
            warnings.warn(f"Guard: could not write the spike bundle of step {self.step_index} "
                          f"into '{self.out}' ({e.strerror or e}); training goes on",
                          RuntimeWarning, stacklevel=4)
            return
        finally:
            self._snapshot.swap(opt)
        self.spikes.append(path)
        warnings.warn(f"Guard: loss spike at step {self.step_index} ({loss:.4g} against a median "
                      f"of {med:.4g}): wrote {path} (replay it with --reference); training goes "
                      "on", RuntimeWarning, stacklevel=4)

    def _restore(self, scale: torch.Tensor | None) -> None:
        """Back to the pre-step state (the scaler's too, on its first step)."""
        self._snapshot.restore(self.task.optimizer)
        scaler = self.task.grad_scaler
        if scale is not None and self._snapshot.scale is None:   # the scaler's first step
            scale.fill_(scaler._init_scale)
            scaler._growth_tracker.zero_()

    def _observe(self, loss: float | None, grad_norm: float | None,
                 stalled: bool = False) -> dict | None:
        named = list(self.task.model.named_parameters())
        grads = _bad_names([(n, p.grad) for n, p in named if p.grad is not None])
        params = _bad_names([(n, p.data) for n, p in named])
        loss_kind = _kind(loss) if loss is not None else "unknown"
        if loss_kind not in ("nan", "inf") and not any(params.values()) and not stalled:
            return None  # only loss and parameters decide; gradients say where it came from
        grads_kind = "nan" if grads["nan"] else "inf" if grads["inf"] else "finite"
        if grad_norm is not None and _kind(grad_norm) != "finite":
            # clipping multiplied the gradients by max_norm / norm: an inf gradient became NaN.
            # The norm before clipping has the kind the gradients had after backward.
            grads_kind = _kind(grad_norm)
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if grads_kind != "finite" else "scaler" if stalled else "param")
        summary = {"loss": loss_kind, "grads": grads_kind,
                   "params": "nan" if params["nan"] else "inf" if params["inf"] else "finite"}
        out = {"step": self.step_index, "first": first,
               "loss": loss if loss_kind not in ("nan", "inf") else loss_kind,
               "summary": summary, "nonfinite_grads": _listed(grads),
               "nonfinite_params": _listed(params)}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm if _kind(grad_norm) == "finite" else _kind(grad_norm)
        if stalled:
            out["scaler_skips"] = self.scaler_skips
        return out

    def _free_path(self, suffix: str = "") -> Path:
        base = self.out / f"step{self.step_index:06d}{suffix}"
        path, i = base, 1
        while path.exists():
            path, i = base.with_name(f"{base.name}-{i}"), i + 1
        return path
