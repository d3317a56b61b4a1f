"""Rebuild a bundle's step on a device and run it, as often as the bisection needs.

Guarantees: every `Replayer.run` starts from the bundle's pre-step state (parameters, buffers,
optimizer state, RNG), so on the capture device with the same versions the loss equals the
original bit for bit, dropout and other random ops included. A run stops at the first phase whose
values are non-finite and says which phase that was. Not guaranteed: bit-exactness across devices,
thread counts or library versions (that is what the reference comparison is for).
"""
from __future__ import annotations

import copy
import importlib
import math
import sys
from contextlib import ExitStack, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.bundle import codestore
from nanbisect.bundle.code import changed_sources, relocation
from nanbisect.bundle.format import MANIFEST, Bundle
from nanbisect.bundle.manifest import Manifest
from nanbisect.bundle.schema import parts_missing
from nanbisect.errors import BadInput
from nanbisect.records import BadValue, StepOutcome
from nanbisect.bundle.state import (RngState, decode, iter_tensors, local, model_entries,
                                    restore_model, restore_modes, restore_optimizer)
from nanbisect.step import micro_batches, run_step
from nanbisect.task import Task, load_task
from nanbisect.util import fingerprint, memory
from nanbisect.util import torch_internals as ti
from nanbisect.util.compiled import compile_model
from nanbisect.util.tensors import (cast_floating, floating, fused_finite, nonfinite,
                                    surely_finite)

PHASES = ("input", "forward", "backward", "optimizer")


def _scan(where: str, named, summed: bool = False, fused: bool = False) -> list[BadValue]:
    """The non-finite values among ``named`` tensors, counted. ``summed``: one sum per tensor
    first decides which need counting (`surely_finite`: a finite sum is exact, the rest are
    counted); for the scans before the step only. ``fused``: one fused norm per tensor first
    (`fused_finite`, one host read), and a count of those whose norm is not finite; for the
    gradients and updated parameters inside the step (its ops count into the step's op
    indices: the same in every pass, which replays the same values).

    >>> big, bad = torch.full((2,), 3e38), torch.tensor([1.0, float("nan"), float("-inf")])
    >>> _scan("parameter", [("big", big), ("bad", bad)], summed=True)   # big's sum overflows
    [BadValue(where='parameter', name='bad', nan=1, posinf=0, neginf=1)]
    """
    items = [(name, local(t).detach()) for name, t in named if isinstance(t, torch.Tensor)]
    tensors = [t for _, t in items]
    fine = fused_finite(tensors) if fused else \
        surely_finite(tensors) if summed else [False] * len(items)
    out = []
    for (name, t), fine in zip(items, fine):
        if not fine:
            n, p, m = nonfinite(t)
            if n or p or m:
                out.append(BadValue(where, name, n, p, m))
    return out


def _buffer_nans(model: torch.nn.Module, **how) -> list[BadValue]:
    """The model's floating buffers that hold NaN (`_scan` with ``how``). Only NaN: a buffer may
    hold inf by design (an attention mask of -inf, an observer's running minimum of +inf)."""
    return [b for b in _scan("buffer", ((n, t) for n, t in model.named_buffers()
                                        if floating(t)), **how) if b.nan]


class Replayer:
    """A bundle's task, built once and restored to the pre-step state before each run.

    >>> from nanbisect.bundle.format import read_bundle
    >>> r = Replayer(read_bundle("fixtures/bundles/healthy"), torch.device("cpu"))
    >>> r.run().loss == r.run().loss     # each run from the same pre-step state and RNG
    True
    """

    def __init__(self, bundle: Bundle, device: torch.device, dtype: torch.dtype | None = None,
                 task: Task | None = None, entry: str | None = None,
                 run_top_level: bool = False) -> None:
        self.bundle, self.device, self.dtype = bundle, device, dtype
        view = Manifest.of(bundle)
        self.entry = entry or resolve_entry(bundle)
        # the entry file's top level may run on import: asked for (--run-top-level) or
        # recorded (Task(run_top_level=True)); else a top level that acts at import is
        # refused before the import (`nanbisect.task.gate`)
        self.run_top_level = run_top_level or view.runs_top_level
        self.check_batch(bundle)     # before the entry is imported
        self.task = task or load_entry(self.entry, bundle, self.run_top_level)
        # the model's and optimizer's read from their files at each restore, never held twice
        self.tensors = bundle.state_tensors()
        self.restores = 0       # how often `restore` reset the state (the first builds it)
        self.restore_counts: list[int] = []   # the tensors each restore wrote
        self.stepped = False    # a run's optimizer stepped since the last restore
        self._marks: dict[int, tuple[torch.Tensor, tuple]] = {}
        # NB: under torch.distributed every rank must run every collective of the step, so a
        # lockstep replay never stops early; it runs the whole step and reports its first failure
        self.lockstep = False
        # the step runs even though only the model's buffers were non-finite before it (a
        # lockstep rank: whether a collective hands them to another rank, as DDP's buffer
        # broadcast does, is what the run is for)
        self.carry_buffers = False
        # called at the end of every `restore` (a replay of some ranks rewinds its served
        # collectives there: each run of the step gets them from the first)
        self.restored: list[Callable[[], None]] = []
        # applied in order to the batch each run starts from (a remedy replays the step without
        # some rows, or with another batch; the row tracer marks the batch's tensors)
        self.batch_edits: list[Callable[[Any], Any]] = []
        self.rng = RngState.decode(view.rng, self.tensors)
        where = f"bundle '{bundle.path}'"
        left_out = {e["part"]: e["why"] for e in parts_missing(bundle.manifest)}
        # the optimizer's state was not written (a foreign engine's format): the Task's
        # optimizer replays as the entry builds it (said in the notes), never refused
        self.optimizer_left_out = left_out.get("optimizer") if view.optimizer is None and \
            self.task.optimizer is not None else None
        self._built_optimizer: dict | None = None   # its state as the entry built it
        self._optimizer_resets = True                # False: it could not be put back
        if (view.optimizer is None) != (self.task.optimizer is None) and \
                self.optimizer_left_out is None:
            has = "has no" if view.optimizer is None else "has"
            raise BadInput(f"{where}: the bundle {has} optimizer state but the entry's Task "
                           f"{'has' if self.task.optimizer is not None else 'has no'} optimizer; "
                           "replay with the code that captured it")
        self.task.model.to(device)
        if dtype is not None:
            # NB: not model.to(dtype), which drops the imaginary part of complex parameters
            ti.apply_to_tensors(self.task.model, lambda t: cast_floating(t, dtype))
        self._where = where
        # large state blocks as mappings of their own, before the first restore makes the
        # optimizer's (`util.memory`: no heap holes left between them)
        memory.map_large_state(local(t).numel() * t.element_size()
                               for _, t, _ in model_entries(self.task.model)
                               if devices.on_host(t.device))
        self.notes = apply_step_shape(self.task, view.task, device, dtype)
        # the code the entry built against the code the capture recorded (a notebook's Task
        # captured with an entry file that builds another one): said, never refused
        drifted = fingerprint.drift_note((view.task or {}).get("parts"), self.task.parts())
        if drifted is not None:
            self.notes.append(drifted)
        if self.optimizer_left_out is not None:
            self.notes.append("the bundle holds no optimizer state (the capture could not write "
                              f"it: {self.optimizer_left_out[:200]}); the optimizer phase replays "
                              "from the optimizer as the entry builds it, not as it was")
        # a compiled capture ({backend, mode, options}, manifest task.compiled): every run is
        # eager unless `compile` made the next ones compiled
        self.compiled_spec = view.compiled
        self.task.runner = None
        # with a GradScaler, gradients that overflow are normal (the scaler skips the step);
        # they are the failure only in the bundle of a stall (the scaler kept skipping)
        scaler = self.task.grad_scaler
        self.grads_fail = (scaler is None or not scaler.is_enabled()
                           or bool(view.scaler_skips))

    @staticmethod
    def check_batch(bundle: Bundle) -> None:
        """`BadInput` when the bundle holds no batch (its capture could not store it:
        ``partial``), in one line naming why and the fix."""
        why = next((e["why"] for e in parts_missing(bundle.manifest) if e["part"] == "batch"),
                   None)
        if why is not None:
            raise BadInput(f"bundle '{bundle.path}' holds no batch: the capture could not store "
                           f"it ({why[:300]}); give the Guard batches of tensors and plain "
                           "values (dicts, lists), then capture the step again")

    def compile(self, backend: str | None = None) -> None:
        """Make the following runs compiled as captured (``backend`` replaces the captured one),
        from a clean slate: dynamo's caches reset, the model compiled afresh (so that a
        `CompilerBisector` in this process chooses the backend of each compile)."""
        ti.dynamo_reset()
        self.task.runner = compile_model(self.task.model, self.compiled_spec or {}, backend)

    def eager(self) -> None:
        """Make the following runs eager again."""
        self.task.runner = None

    def restore(self) -> Any:
        """Reset model, optimizer, scaler, train/eval modes, ``requires_grad`` and RNG to the
        pre-step state; return the batch on the device.

        The state is loaded once, in place: the first restore writes every parameter, buffer
        and optimizer state tensor from the bundle's files; a later one writes only those a
        run since may have changed (all of them after a run whose optimizer stepped; else those
        whose version counter, storage, dtype or device moved: an in-place op, a ``.to()``),
        never cloning. ``restore_counts`` lists how many tensors each restore wrote. NB: a
        write through ``.data`` bumps no version counter: user code that writes parameters
        that way in forward or backward (not the optimizer) is not undone between passes."""
        view = Manifest.of(self.bundle)
        keep = self._unchanged if self.restores > 0 and not self.stepped else None
        written = restore_model(self.task.model, view.model, self.tensors, self._where, keep)
        restore_modes(self.task.model, view.model, self._where)
        if self.task.grad_scaler is not None and view.grad_scaler:
            self.task.grad_scaler.load_state_dict(dict(view.grad_scaler))
        if self.optimizer_left_out is not None:     # as the entry built it, every run
            if self._optimizer_resets:
                try:
                    if self._built_optimizer is None:
                        self._built_optimizer = copy.deepcopy(self.task.optimizer.state_dict())
                    self.task.optimizer.load_state_dict(copy.deepcopy(self._built_optimizer))
                except Exception as e:  # noqa: BLE001 - a foreign optimizer: said once
                    self._optimizer_resets = False
                    self.notes.append(f"the optimizer could not be reset between runs "
                                      f"({type(e).__name__}); each run starts from the last")
        elif self.task.optimizer is not None:
            written += restore_optimizer(self.task.optimizer,
                                         view.optimizer, self.tensors,
                                         self._where, in_place=self.restores > 0, keep=keep)
        self.restores += 1
        self.restore_counts.append(written)
        self._mark_restored()
        memory.trim()       # what the last run freed, back to the system (`util.memory`)
        return self.inputs()

    def _state_tensors(self) -> list[torch.Tensor]:
        model, opt = self.task.model, self.task.optimizer
        out = [local(t) for _, t, _ in model_entries(model)]
        if opt is not None:
            out += [local(v) for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        return out

    def _mark_restored(self) -> None:
        """Remember how every state tensor stands right after a restore (`_unchanged`)."""
        self._marks = {id(t): (t, _mark(t)) for t in self._state_tensors()}
        self.stepped = False

    def _unchanged(self, t: torch.Tensor) -> bool:
        got = self._marks.get(id(t))
        return got is not None and got[0] is t and got[1] == _mark(t)

    def next_step(self, bundle: Bundle) -> None:
        """Make the next `run` (``keep_state=True``) the step of ``bundle`` (a step of a window:
        its batch, RNG and hyper-parameters) from the state the last run left behind."""
        self.bundle, self.tensors = bundle, bundle.state_tensors()
        self.rng = RngState.decode(Manifest.of(bundle).rng, self.tensors)

    def inputs(self) -> Any:
        """The step's batch on the device, its RNG and its optimizer hyper-parameters set,
        gradients cleared; the model's state is left as it is."""
        view = Manifest.of(self.bundle)
        if self.task.optimizer is not None:
            groups = view.lookback_groups
            if groups is not None:
                saved = decode(groups, self.tensors)
                if not isinstance(saved, list) or len(saved) != len(
                        self.task.optimizer.param_groups) or not all(
                        isinstance(g, dict) for g in saved):
                    raise BadInput(f"{self._where}: the lookback's parameter groups do not fit "
                                   "the entry's optimizer; replay with the code that captured it")
                for g, h in zip(self.task.optimizer.param_groups, saved):
                    g.update({k: v for k, v in h.items() if k != "params"})
            self.task.optimizer.zero_grad(set_to_none=True)
        batch = decode(view.batch, self.tensors, self.device)
        if self.dtype is not None:
            batch = ti.tree_map(
                lambda t: cast_floating(t, self.dtype) if isinstance(t, torch.Tensor) else t,
                batch)
        for edit in self.batch_edits:
            batch = edit(batch)
        self.task.model.zero_grad(set_to_none=True)
        self.rng.set()
        for hook in self.restored:
            hook()
        return batch

    def input_faults(self, batch: Any) -> list[BadValue]:
        """Non-finite values present before the step runs (``-inf`` in a batch is allowed:
        masks; in a buffer only NaN counts: an attention mask of -inf, an observer's minimum of
        +inf are buffers by design)."""
        model, opt = self.task.model, self.task.optimizer
        bad = [b for b in _scan("batch", iter_tensors(batch), True) if b.nan or b.posinf]
        bad += _scan("parameter", model.named_parameters(), True)
        bad += _buffer_nans(model, summed=True)
        if opt is not None:
            names = {p: n for n, p in model.named_parameters()}
            bad += _scan("optimizer", ((f"{names.get(p, '?')}.{k}", v) for p, st in
                                       opt.state.items() for k, v in st.items()
                                       if isinstance(v, torch.Tensor) and floating(v)),
                         True)
        return bad

    def _prepare(self, keep_state: bool) -> tuple[Any, int, list]:
        """(the step's batch, its last micro-batch's index, the batch's faults): the state
        restored first unless ``keep_state``."""
        batch = self.inputs() if keep_state else self.restore()
        try:
            mbs = micro_batches(self.task, batch)
        except BadInput as e:
            raise BadInput(f"bundle '{self.bundle.path}': {e}") from None
        return batch, len(mbs) - 1, self.input_faults(batch)

    def run(self, *, phase: Callable[[str], ContextManager] = lambda name: nullcontext(),
            wrap: Callable[[], ContextManager] = nullcontext, stop_after: str = "optimizer",
            micro: int | None = None, keep_state: bool = False) -> StepOutcome:
        """Replay the step (`nanbisect.step.run_step`: the Task's micro-batches, scaler,
        clipping, optimizer) after the input checks; stop at the first non-finite value.

        ``phase(name)`` gives a context manager around each "forward", "backward" and
        "optimizer" (probes, recorders); ``wrap()`` one around the whole step (fault injection,
        op counting); ``stop_after`` ends the run after that phase of micro-batch ``micro``
        (default: the last). A failure in backward lets the remaining micro-batches run, so
        the step's loss is complete; a failure in forward ends the run there. ``keep_state``
        runs from the state the last run left (a window's next step, `next_step`).
        """
        batch, last, bad = self._prepare(keep_state)
        if bad and not (self.carry_buffers and all(b.where == "buffer" for b in bad)):
            return StepOutcome(None, "input", bad)
        task = self.task
        stop_micro = last if micro is None else micro
        failed: StepOutcome | None = None   # the first failure
        total = kept = None
        skipped = False
        with wrap():
            try:
                for ev in run_step(task, batch, self._noting_steps(phase)):
                    total = ev.total if ev.total is not None else total
                    if ev.phase == "forward" and ev.loss is not None:
                        kept = ev.loss.detach()
                        loss_v = float(local(kept).float().item())
                        if not math.isfinite(loss_v) and failed is None:
                            failed = StepOutcome(loss_v, "forward", _scan("loss", [("loss", kept)]),
                                                 kept, micro_batch=ev.micro)
                            if not self.lockstep:
                                return failed
                        elif failed is None:
                            # a finite loss, and a buffer the forward made NaN (a moving
                            # average's 0/0): the step failed there, in forward
                            bufs = _buffer_nans(task.model, fused=True)
                            if bufs:
                                failed = StepOutcome(loss_v, "forward", bufs, kept,
                                                     micro_batch=ev.micro)
                                if not self.lockstep:
                                    return failed
                    elif ev.phase == "backward" and failed is None and self.grads_fail:
                        grads = _scan("grad", ((n, p.grad) for n, p in
                                               task.model.named_parameters()
                                               if p.grad is not None), fused=True)
                        if grads:
                            failed = StepOutcome(None, "backward", grads, kept,
                                                 micro_batch=ev.micro)
                    if ev.phase == "backward" and failed is not None and ev.micro == last \
                            and not self.lockstep:
                        break       # the step's loss is complete; the optimizer cannot help
                    if (ev.phase == stop_after != "optimizer" and ev.micro == stop_micro
                            and failed is None and not self.lockstep):
                        return StepOutcome(self._value(total), None, loss_tensor=kept,
                                           micro_batch=ev.micro)
                    if ev.phase == "optimizer" and ev.skipped is not None:
                        skipped = bool(ev.skipped.item() > 0)
            except BadInput as e:
                raise BadInput(f"entry '{self.entry}': {e}") from None
        loss_v = self._value(total)
        if failed is not None:
            return replace(failed, loss=loss_v if failed.phase != "forward" else failed.loss)
        params = _scan("parameter", task.model.named_parameters(), fused=True)
        return StepOutcome(loss_v, "optimizer" if params else None, params, kept,
                           scaler_skipped=skipped)

    def _noting_steps(self, phase: Callable[[str], ContextManager]
                      ) -> Callable[[str], ContextManager]:
        """``phase``, noting when the optimizer phase starts (`restore` writes everything
        back after it, whatever happened in it)."""
        def noted(name: str) -> ContextManager:
            if name == "optimizer":
                self.stepped = True
            return phase(name)
        return noted

    @staticmethod
    def _value(total: torch.Tensor | None) -> float | None:
        """The step's loss as Guard records it (a float of the unscaled total)."""
        return None if total is None else float(local(total).detach().float().item())


def apply_step_shape(task: Task, shape: dict | None, device: torch.device,
                     dtype: torch.dtype | None) -> list[str]:
    """Make the entry's Task run the step the bundle recorded (accumulation, clipping, scaler,
    loss normalisation, autocast): the recording is the step that failed, and an integration
    filled it from trainer settings the entry cannot know. Returns notes on what it changed. A
    replay at float32 or wider (a ``cpu:float64`` reference) runs without autocast: it is there
    to compute wide."""
    changed = []
    for key in ("accumulate", "clip_grad_norm", "loss_normalized", "autocast"):
        if shape and key in shape and getattr(task, key) != shape[key]:
            changed.append(f"{key}={shape[key]!r} (the entry's Task says {getattr(task, key)!r})")
            setattr(task, key, shape[key])
    scaler = task.grad_scaler
    if shape and "grad_scaler" in shape and not shape["grad_scaler"] and scaler is not None:
        task.grad_scaler = None
        if scaler.is_enabled():
            changed.append("no GradScaler (the entry's Task has one)")
    elif shape and shape.get("grad_scaler") and scaler is None:
        task.grad_scaler = torch.amp.GradScaler(device.type)
        changed.append("a GradScaler (the entry's Task has none)")
    elif scaler is not None and (not scaler.is_enabled() or
                                 getattr(scaler, "_device", device.type) != device.type):
        # made for another device (torch disables a cuda scaler on a CPU-only machine): one
        # for this device; the bundle's state, loaded at each restore, sets scale and factors
        task.grad_scaler = (torch.amp.GradScaler(device.type) if shape and
                            shape.get("grad_scaler") else None)
    if dtype is not None and dtype.itemsize >= 4:
        task.autocast = None
    return ([f"the step is replayed as the bundle recorded it: {'; '.join(changed)}"]
            if changed else [])


def _mark(t: torch.Tensor) -> tuple:
    """What moves when a tensor is written or replaced: its version counter, storage, dtype,
    device."""
    return (ti.version_counter(t), t.data_ptr(), t.dtype, t.device)


def stacked(*cms: ContextManager) -> ExitStack:
    """Enter ``cms`` in order (the last entered is innermost) as one context manager."""
    es = ExitStack()
    for cm in cms:
        es.enter_context(cm)
    return es


def _local_entry(bundle: Bundle, beside: bool = True) -> Path | None:
    """The entry file found next to the bundle (``beside``: through the manifest's
    ``entry_file_from_bundle``), here, or where it was (None: nowhere); never a file inside the
    bundle (its stored copies are ``--code bundle``'s, verified)."""
    view = Manifest.of(bundle)
    target = view.entry_target
    rel = view.entry_file_from_bundle if beside else None
    inside = bundle.path.resolve()
    then = view.capture_entry_file
    for cand in ([bundle.path / rel] if rel else []) + [Path(target)] + (
            [Path(then)] if then else []):
        if cand.is_file() and not cand.resolve().is_relative_to(inside):
            return cand.resolve()
    return None


CODE_MODES = ("local", "bundle")


def code_choice(bundle: Bundle, code: str | None = None) -> tuple[str, str | None]:
    """(the entry a replay imports, a note saying which copy of the code that is and why, or
    None for a bundle that carries no copy of its code and was not asked for one).

    ``code``: "local" (the files here, found as they always were: next to the bundle, from the
    working directory, or where they were captured), "bundle" (the copies the bundle stores
    under ``code/``, `nanbisect.bundle.codestore`; `BadInput` when it has none), or None: the
    local files when the entry file is here and every recorded source is unchanged, else the
    bundle's copies when it has them all (when it left some out, the local files, if the entry
    file is here), else the local files (a bundle of an older nanbisect).
    A stored copy is offered for file entries (``path/to/file.py:func``) only.

    >>> from nanbisect.bundle.format import read_bundle
    >>> code_choice(read_bundle("fixtures/bundles/healthy"))[0].endswith("tasks/healthy.py:task")
    True
    """
    if code not in (None, *CODE_MODES):
        raise BadInput(f"--code {code}: give 'local' or 'bundle'")
    view = Manifest.of(bundle)
    target, func = view.entry_target, view.entry_function
    # --code local: the files here, found from the working directory or where they were, never
    # through a path the manifest gives relative to the bundle (beside an unpacked ticket, that
    # is the ticket's file, unlisted); by default one found beside the bundle is used only when
    # every captured source is unchanged (`_local_differs`: the same bytes the bundle lists)
    local = _local_entry(bundle, beside=code != "local") if target.endswith(".py") else None
    stored = (codestore.stored_copy(bundle.path, bundle.manifest, view.code_entry_file)
              if target.endswith(".py") else None)
    here = f"{local}:{func}" if local is not None else view.entry
    if code == "local":
        if local is None and target.endswith(".py"):
            raise BadInput(f"--code local: the entry file {target} is not here (looked in the "
                           "working directory and where it was captured, never inside or beside "
                           f"the bundle); run from the directory it is relative to, pass --entry "
                           "with its path, or replay the bundle's copy with --code bundle")
        return here, ("the code ran from the files here (--code local)"
                      if codestore.carries_code(bundle.manifest) else None)
    if code == "bundle":
        if stored is None:
            if not target.endswith(".py"):
                why = "its entry is a module, and stored copies replay file entries only"
            elif view.code_left_out or codestore.carries_code(bundle.manifest):
                why = codestore.left_out_text(bundle.manifest) or "its entry file was not stored"
            else:
                why = "it was captured by an older nanbisect"
            raise BadInput(f"--code bundle: bundle '{bundle.path}' holds no copy of its entry "
                           f"file ({why}); replay with --code local")
        return f"{stored}:{func}", "the bundle's copy of the code ran (--code bundle)"
    if stored is None:
        return here, None
    why = _local_differs(bundle, local)
    if why is None:
        return here, ("the code ran from the files here: they are the captured ones (same "
                      "sha256); --code bundle runs the bundle's copies")
    left = codestore.left_out_text(bundle.manifest)
    mine = _local_entry(bundle, beside=False)      # not a file beside the bundle: the user's
    if left is not None and mine is not None:      # an incomplete copy: not on its own
        return f"{mine}:{func}", (f"the code ran from the files here although {why}: the "
                                  f"bundle's copy is incomplete ({left}); --code bundle runs "
                                  "it anyway")
    return f"{stored}:{func}", f"the bundle's copy of the code ran: {why}"


def _local_differs(bundle: Bundle, local: Path | None) -> str | None:
    """Why the local files are not the captured code (None: they are)."""
    view = Manifest.of(bundle)
    if local is None:
        return "the entry file is not here"
    changed, missing = changed_sources(view.sources, relocation(view.entry_file, str(local)))
    if changed:
        return (f"{len(changed)} file(s) here differ from the captured ones (e.g. "
                f"{changed[0]}); --code local runs them")
    if missing:
        return f"{len(missing)} captured source file(s) are not here (e.g. {missing[0]})"
    return None


def resolve_entry(bundle: Bundle, code: str | None = None) -> str:
    """The entry a replay of ``bundle`` imports (`code_choice`)."""
    return code_choice(bundle, code)[0]


def _stored_roots(entry: str) -> list[Path]:
    """When ``entry``'s file is a stored copy (under the ``code/`` of a bundle or rank's part),
    that bundle's import roots (`codestore.import_roots`); else []."""
    target = entry.rpartition(":")[0]
    if not target.endswith(".py"):
        return []
    f = Path(target).resolve()
    for d in f.parents:
        if d.name == codestore.CODE_DIR and (d.parent / MANIFEST).is_file():
            try:
                view = Manifest.read(d.parent)
            except BadInput:
                return []
            files = view.code_files
            own = {d.parent.joinpath(*i["path"].split("/")).resolve() for i in files.values()
                   if isinstance(i, dict) and codestore.stored_path_ok(i.get("path"))}
            return codestore.import_roots(d.parent, view.data) if f in own else []
    return []


def top_level_recorded(manifest: dict) -> bool:
    """Did the capture's Task say its entry's top level may run (``run_top_level=True``)?"""
    return Manifest.of(manifest).runs_top_level


def load_entry(entry: str, bundle: Bundle, run_top_level: bool = False) -> Task:
    """`load_task` of ``entry``; a stored copy (`code_choice`) with its bundle's import roots
    first on sys.path, so its siblings are the stored ones (a module of the same name imported
    before, from the local files or another tree, is taken out of ``sys.modules`` first:
    `nanbisect.task.load_task`), and no bytecode written into the bundle. ``run_top_level``:
    `load_task`'s (else the entry's top level is checked first). ``sys.path`` keeps the roots
    (the task may import at step time) until the `nanbisect.task.kept_path` around the run
    restores it; it is restored at once when the load fails."""
    roots = _stored_roots(entry)
    if not roots:
        return load_task(entry, [bundle.path], run_top_level=run_top_level)
    saved_path = list(sys.path)
    for r in reversed(roots):
        if str(r) in sys.path:
            sys.path.remove(str(r))
        sys.path.insert(0, str(r))
    importlib.invalidate_caches()
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        return load_task(entry, [bundle.path], run_top_level=run_top_level, roots=roots)
    except BaseException:
        sys.path[:] = saved_path
        raise
    finally:
        sys.dont_write_bytecode = saved
