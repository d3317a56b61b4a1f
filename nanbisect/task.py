"""`Task` and entry strings: how nanbisect reaches the user's model, optimizer and loss.

An entry is ``pkg.module:function`` or ``path/to/file.py:function``; calling ``function()``
returns a `Task`. A file is imported once per resolved path, under a module name derived from
that path, so two entries naming the same file share one module. Importing an entry runs user
code: only `load_task` does that, never `nanbisect inspect`. An entry that starts training while
it is imported (a loop at module level, outside ``if __name__ == "__main__":``, let run with
``run_top_level``) is stopped before its first step with a one-line `BadInput` naming the line
(`_no_training`); not caught: a loop that trains without ``backward``, ``Optimizer.step``,
`Guard` or `capture` (a forward-only loop).

Before `load_task` imports an entry file (or the file of a dotted entry), its top level is read
as an AST (`nanbisect.util.toplevel`, never executed): an entry whose module-level statements do
more than define (a call such as ``parser.parse_args()``, a loop, a ``with``) is refused with one
line naming the statement and the fix, unless the run opts in (``run_top_level``: the
``--run-top-level`` flag, or ``Task(run_top_level=True)`` recorded in the bundle). While an entry
file is imported and while its task function runs, ``sys.argv`` is ``[that file]`` alone
(restored after).

Fresh code (`_evict_stale`): before `load_task` imports an entry, the user modules (not the
standard library's, installed packages', torch's or nanbisect's) whose file changed on disk since
nanbisect first saw them imported, and those that a module of the entry's directory (or of an
``import_roots`` directory) of the same name shadows, leave ``sys.modules`` with their packages,
so that a fix on disk, or a second tree with a same-named sibling, is what the next run of one
process imports. A module whose file is unchanged is kept (its registrations, e.g. a
``torch.library`` op, run once). `kept_path` restores ``sys.path`` around a whole run.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nanbisect.errors import BadInput
from nanbisect.util import frames
from nanbisect.util.compiled import captured_args, compile_model, is_compiled, recorded
from nanbisect.util.spec import split_entry
from nanbisect.util.text import raised_at
from nanbisect.util.toplevel import check_file
from nanbisect.util.torch_internals import compiled_original, schedule_ends


@dataclass
class Task:
    """What one training step is: the whole of it, so that a replay computes what the loop did.

    ``loss_fn(model, batch)`` returns a scalar loss tensor (put autocast inside it); the model is
    built on CPU. The step (`nanbisect.step.run_step`) is the AMP recipe: per micro-batch,
    forward and backward of the loss divided by ``accumulate`` (scaled by ``grad_scaler``); then
    ``unscale_``, ``clip_grad_norm_`` of the model's parameters to ``clip_grad_norm``, and the
    optimizer step (through the scaler, which skips steps whose gradients are not finite).
    With ``accumulate=K`` a step's batch is a list of K micro-batches.

    >>> task = Task(model=torch.nn.Linear(2, 1), optimizer=None, loss_fn=lambda m, b: m(b).sum())
    >>> task.loss_fn(task.model, torch.ones(3, 2)).shape
    torch.Size([])
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    grad_scaler: Any = None              # torch.amp.GradScaler (or torch.cuda.amp's)
    clip_grad_norm: float | None = None  # max norm for torch.nn.utils.clip_grad_norm_
    accumulate: int = 1                  # micro-batches per optimizer step
    # extensions (docs/guide/tasks.md): loss_fn already averages over the whole accumulated
    # batch, so each micro-batch's loss is not divided by `accumulate` (HF Trainer with
    # num_items_in_batch)
    loss_normalized: bool = False
    # forward under torch.autocast at this dtype ("bfloat16", "float16"), as a precision plugin
    # does around loss_fn; None: loss_fn handles precision itself
    autocast: str | None = None
    # the step runs the model under torch.compile with these ({"backend", "mode", "options"});
    # filled from the model when it is what torch.compile returned (docs/guide/compiled.md);
    # declare it when the loop compiles the model some other way
    compiled: dict | None = None
    # a replay may run the entry file's module-level statements when it imports it (else an
    # entry whose top level acts at import is refused: docs/guide/tasks.md); recorded
    # in the bundle, so every replay of it honours it
    run_top_level: bool = False
    # a pipeline stage (docs/guide/multirank.md, "Pipeline parallelism"): the step is this
    # stage's part of a schedule over micro-batches, which runs forward and backward itself.
    # ``schedule``: a torch.distributed.pipelining schedule built on `model` (each step's batch
    # a dict with "inputs" for the first stage and "target" for the last); ``step_fn(model,
    # batch)``: a stage's hand-written step (its sends, receives and backward), returning the
    # loss on the last stage, None on the others. The loss, where there is one, is the mean of
    # the micro-batches'.
    schedule: Any = None
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        self._check_step()
        # what the step calls: the compiled model; `model` is always the eager module, so every
        # name (parameters, modules) is the one the user's code has, without `_orig_mod.`
        self.runner: torch.nn.Module | None = None
        # options the training compiles with that a bundle does not record (not ones a replay
        # applies: `nanbisect.util.compiled.REPLAYED`); the manifest names them
        self.compiled_dropped: list[str] = []
        given = None
        if self.compiled is not None:
            if not isinstance(self.compiled, dict) or not isinstance(
                    self.compiled.get("backend", "inductor"), str) or not isinstance(
                    self.compiled.get("options") or {}, dict):
                raise ValueError(f"Task(compiled={self.compiled!r}): give a dict such as "
                                 "{'backend': 'inductor', 'mode': None, 'options': None}, or None")
            given = {"backend": self.compiled.get("backend", "inductor"),
                     "mode": self.compiled.get("mode"), "options": self.compiled.get("options")}
        if is_compiled(self.model):
            given = captured_args(self.model) if given is None else given
            self.runner, self.model = self.model, compiled_original(self.model)
        elif given is not None:
            # the training compiles with every option given (the user's to choose)
            self.runner = compile_model(self.model, given)
        if given is not None:
            self.compiled, self.compiled_dropped = recorded(given)
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) \
                or self.accumulate < 1:
            raise ValueError(f"Task(accumulate={self.accumulate!r}): give the number of "
                             "micro-batches per optimizer step, an int >= 1")
        if self.clip_grad_norm is not None and not (
                isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0):
            raise ValueError(f"Task(clip_grad_norm={self.clip_grad_norm!r}): give the max norm, "
                             "a number > 0, or None")
        if self.grad_scaler is not None and not all(
                hasattr(self.grad_scaler, a) for a in ("scale", "unscale_", "step", "update")):
            raise ValueError(f"Task(grad_scaler=...) got a {type(self.grad_scaler).__name__}; "
                             "pass a torch.amp.GradScaler")
        if self.grad_scaler is not None and self.optimizer is None:
            raise ValueError("Task(grad_scaler=...) needs an optimizer to step")
        if self.autocast is not None and not isinstance(getattr(torch, str(self.autocast), None),
                                                        torch.dtype):
            raise ValueError(f"Task(autocast={self.autocast!r}): give a dtype name such as "
                             "'bfloat16' or 'float16', or None")
        if not isinstance(self.run_top_level, bool):
            raise ValueError(f"Task(run_top_level={self.run_top_level!r}): give True or False")

    def _check_step(self) -> None:
        """At most one way to run the step: ``loss_fn``, ``step_fn`` or ``schedule`` (none: a
        loop of the user's under `Guard.watch`; a replay needs one); a pipelined one takes no
        accumulation (its schedule has the micro-batches), scaler or compilation."""
        given = [n for n in ("loss_fn", "step_fn", "schedule") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"Task({', '.join(given)}): give one of loss_fn (a plain step), "
                             "step_fn or schedule (a pipeline stage)")
        if self.schedule is not None and not callable(getattr(self.schedule, "step", None)):
            raise ValueError(f"Task(schedule=...) got a {type(self.schedule).__name__}; pass a "
                             "torch.distributed.pipelining schedule (ScheduleGPipe, "
                             "Schedule1F1B, ...) built on the model's stage")
        if self.pipelined and (self.accumulate != 1 or self.grad_scaler is not None
                               or self.compiled is not None or is_compiled(self.model)):
            raise ValueError("Task(schedule=/step_fn=) runs the stage's micro-batches itself: "
                             "leave out accumulate, grad_scaler and compiled")

    @property
    def pipelined(self) -> str | None:
        """"schedule" or "step_fn" for a pipeline stage's step, else None."""
        return "schedule" if self.schedule is not None else (
            "step_fn" if self.step_fn is not None else None)

    def stage_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor | None:
        """A pipeline stage's step (forward and backward of its micro-batches): the loss on the
        last stage (the mean over micro-batches), None elsewhere."""
        if self.step_fn is not None:
            return self.step_fn(model, batch)
        return schedule_step(self.schedule, batch)

    def describe(self) -> dict:
        """The step's shape as the bundle records it (JSON); a replay applies it to the entry's
        Task (an integration fills it from the trainer's settings, which the entry cannot know).
        ``run_top_level`` only when true (a replay then lets the entry's top level run).
        """
        return {"accumulate": self.accumulate, "clip_grad_norm": self.clip_grad_norm,
                "grad_scaler": self.grad_scaler is not None and self.grad_scaler.is_enabled(),
                "loss_normalized": self.loss_normalized, "autocast": self.autocast,
                "compiled": self.compiled,
                **({"run_top_level": True} if self.run_top_level else {}),
                **({"pipelined": self.pipelined} if self.pipelined else {}),
                **({"compiled_dropped": self.compiled_dropped} if self.compiled_dropped else {}),
                **({"parts": parts} if (parts := self.parts()) else {})}

    def parts(self) -> dict:
        """The code this Task is made of (`nanbisect.util.fingerprint.of_task`: names and code
        hashes of its model's class, loss or step function and optimizer's class); {} when it
        cannot be read (never a failed capture)."""
        from nanbisect.util import fingerprint

        try:
            return fingerprint.of_task(self)
        except Exception:  # noqa: BLE001 - a record for a comparison, not worth a capture
            return {}

    def step_model(self) -> torch.nn.Module:
        """The module the step hands ``loss_fn``: the compiled one while `runner` is set (the
        Guard, a compiled replay), else the eager `model`."""
        return self.runner if self.runner is not None else self.model


def schedule_step(schedule: Any, batch: Any) -> torch.Tensor | None:
    """One step of a torch.distributed.pipelining ``schedule`` on this rank's stage, as
    ``Task(schedule=...)`` runs it (a ``step_fn`` that does more around it, e.g. a data-parallel
    gradient average, calls it too): ``batch`` is a dict with "inputs" (a tensor or a tuple of
    tensors: the first stage's arguments) and "target" (the last stage's), or the inputs alone;
    each stage takes what it uses. Returns the mean of the micro-batches' losses on the last
    stage (detached), None on the others."""
    first, last = schedule_ends(schedule)
    inputs, target = (batch.get("inputs"), batch.get("target")) if isinstance(
        batch, dict) else (batch, None)
    args = () if inputs is None or not first else (
        tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
    losses: list = []
    if last:
        schedule.step(*args, target=target, losses=losses)
    else:
        schedule.step(*args)
    if not losses:
        return None
    return torch.stack([v.detach().float().reshape(()) for v in losses]).mean()


def _user_frame(exc: BaseException) -> str:
    """'file:line' of the innermost traceback frame, for one-line error messages."""
    return f" at {at}" if (at := raised_at(exc)) else ""


class _TrainedAtImport(BaseException):
    """Raised where an entry starts training while nanbisect imports it. A BaseException, so a
    loop's ``except Exception`` does not swallow it; every later attempt raises it again."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(what, where)
        self.what, self.where = what, where


# the thread importing an entry under `_no_training` (None: no import going on), and how deep
_trap = threading.local()


def _training_line() -> str:
    """'file:line' where the user's code started the training call: the innermost frame outside
    torch, nanbisect, the standard library and installed packages (a Trainer's own frames), else
    the innermost outside torch and nanbisect."""
    stack = [(f.filename, f.lineno, frames.kind(f.filename))
             for f in traceback.extract_stack()]
    outside = [(f, n, k) for f, n, k in stack
               if not f.startswith("<") and k not in ("nanbisect", "torch")]
    user = [(f, n, k) for f, n, k in outside if k == "user"]
    f, n, _ = (user or outside or stack)[-1]
    return f"{os.path.relpath(f) if not os.path.relpath(f).startswith('..') else f}:{n}"


def refuse_training_at_import(what: str) -> None:
    """Raise (`_TrainedAtImport`) when this thread is importing an entry: `Guard` and `capture`
    call it first, so an entry file that guards its loop at import writes nothing."""
    if getattr(_trap, "depth", 0):
        raise _TrainedAtImport(what, _training_line())


@contextmanager
def _no_training() -> Iterator[None]:
    """While an entry is imported, ``Tensor.backward``, ``torch.autograd.backward``, every
    ``Optimizer.step`` (a global step pre-hook) and `refuse_training_at_import` raise
    `_TrainedAtImport` in this thread. Everything is restored on exit, also on error.

    >>> with _no_training():
    ...     try:
    ...         torch.ones(1, requires_grad=True).sum().backward()
    ...     except _TrainedAtImport as e:
    ...         print(e.what)
    Tensor.backward
    >>> torch.Tensor.backward is _saved[0]
    True
    """
    depth = getattr(_trap, "depth", 0)
    if depth:                          # an import inside an import: already armed
        _trap.depth += 1
        try:
            yield
        finally:
            _trap.depth -= 1
        return
    me = threading.get_ident()
    tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward

    def armed() -> bool:
        return threading.get_ident() == me and getattr(_trap, "depth", 0) > 0

    def backward(self, *args, **kwargs):
        if armed():
            raise _TrainedAtImport("Tensor.backward", _training_line())
        return tensor_backward(self, *args, **kwargs)

    def autograd(*args, **kwargs):
        if armed():
            raise _TrainedAtImport("torch.autograd.backward", _training_line())
        return autograd_backward(*args, **kwargs)

    def step_pre_hook(optimizer, args, kwargs):
        if armed():
            raise _TrainedAtImport(f"{type(optimizer).__name__}.step", _training_line())

    torch.Tensor.backward, torch.autograd.backward = backward, autograd
    handle = register_optimizer_step_pre_hook(step_pre_hook)
    _trap.depth = 1
    try:
        yield
    finally:
        _trap.depth = 0
        handle.remove()
        # NB: a library the entry imported may have wrapped these in turn (a profiler's patch):
        # keep its wrapper then (ours, inside it, passes every call through once disarmed)
        if torch.Tensor.backward is backward:
            torch.Tensor.backward = tensor_backward
        if torch.autograd.backward is autograd:
            torch.autograd.backward = autograd_backward


_saved = (torch.Tensor.backward, torch.autograd.backward)   # as torch defines them (doctest)


def _trained(e: _TrainedAtImport, shown: str) -> BadInput:
    return BadInput(f"'{shown}' starts training when imported ({e.what} at {e.where}) and "
                    "nanbisect imports it to rebuild the model: put the training loop under "
                    "`if __name__ == \"__main__\":` so that importing the file only defines the "
                    "entry function")


def _shown_path(path: Path) -> str:
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def gate(path: Path, shown: str | None = None) -> None:
    """`BadInput` (one line: the file, the line, the statement and the fix) when the top level
    of the entry file ``path`` acts at import (`nanbisect.util.toplevel`); reads the
    file as an AST, runs none of it."""
    found = check_file(path)
    if found is None:
        return
    said = "" if found.what.split(" ")[-1].rstrip(")") in found.text else f" ({found.what})"
    raise BadInput(f"entry '{shown or _shown_path(path)}' line {found.line} runs "
                   f"`{found.text}`{said} at import, which a replay must not do; move it under "
                   "`if __name__ == \"__main__\":` (or into the task function), or pass "
                   "--run-top-level (nanbisect.run: run_top_level=True; or build "
                   "Task(run_top_level=True)) to let it run")


_ARGV_LOCK = threading.Lock()
_argv_state: list = [0, None]      # [blocks inside, the sys.argv the first of them found]


@contextmanager
def _argv(path: Path) -> Iterator[None]:
    """``sys.argv`` is ``[path]`` alone while an entry file is imported and while its task
    function runs (a ``parse_args()`` there must not read nanbisect's own arguments); the
    ``sys.argv`` found before is put back when the last such block ends, whatever threads run
    them at once (two `nanbisect.run` calls on two threads: each saving and restoring its own
    would leave one's entry file behind)."""
    with _ARGV_LOCK:
        if _argv_state[0] == 0:
            _argv_state[1] = sys.argv
        _argv_state[0] += 1
        sys.argv = [str(path)]
    try:
        yield
    finally:
        with _ARGV_LOCK:
            _argv_state[0] -= 1
            if _argv_state[0] == 0:
                sys.argv, _argv_state[1] = _argv_state[1], None


@contextmanager
def kept_path() -> Iterator[None]:
    """``sys.path`` as it was on entry, restored on exit, also on error (a run puts the entry's
    directory and a stored copy's roots first while it replays: the task's code may import
    lazily at step time).

    >>> with kept_path():
    ...     sys.path.insert(0, "/nowhere")
    >>> "/nowhere" in sys.path
    False
    """
    saved = list(sys.path)
    try:
        yield
    finally:
        if sys.path != saved:
            sys.path[:] = saved
            importlib.invalidate_caches()


# the user modules' files as nanbisect first saw them (resolved path -> (mtime_ns, size)): a
# module whose file no longer matches was imported from an older version of it
_seen: dict[str, tuple[int, int]] = {}


def _stamp(f: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _user_modules() -> list[tuple[str, str]]:
    """(name, resolved file) of every imported module whose ``.py`` file is the user's
    (`nanbisect.util.frames.kind`)."""
    out = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and f.endswith(".py") and frames.kind(f) == "user":
            out.append((name, os.path.realpath(f)))
    return out


def _remember() -> None:
    """Note the file of each user module not seen yet, as it is now."""
    for _, f in _user_modules():
        if f not in _seen and (st := _stamp(f)) is not None:
            _seen[f] = st


def _names_in(d: Path) -> dict[str, str]:
    """{module name: resolved file} of the modules and packages directly in ``d``."""
    out = {}
    try:
        entries = list(os.scandir(d))
    except OSError:
        return out
    for e in entries:
        if e.name.endswith(".py") and e.is_file() and e.name[:-3].isidentifier():
            out.setdefault(e.name[:-3], os.path.realpath(e.path))
        elif e.is_dir() and e.name.isidentifier() and os.path.isfile(
                os.path.join(e.path, "__init__.py")):
            out[e.name] = os.path.realpath(os.path.join(e.path, "__init__.py"))
    return out


def _top(name: str) -> str:
    """The package ``name`` leaves ``sys.modules`` with: its top-level one when that is the
    user's too (not torch's when a user file registered a ``torch.*`` name), else itself."""
    top = name.split(".")[0]
    f = getattr(sys.modules.get(top), "__file__", None)
    return top if isinstance(f, str) and frames.kind(f) == "user" else name


def _evict_stale(dirs: list[Path]) -> list[str]:
    """Take out of ``sys.modules`` (each with its top-level package and that package's
    submodules, when the package is the user's) every user module whose file changed since first
    seen, or that a module of the same top-level name in one of ``dirs`` (the entry's directory,
    a stored copy's roots) shadows; and when it takes any, also every user module under ``dirs``,
    as those may hold what the stale ones defined (``from layers import Act``). Returns the
    names taken out. User modules only: never the standard library, installed packages, torch
    or nanbisect.

    >>> import types, tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "nb_doc_sib.py").write_text("X = 1")
    >>> sys.modules["nb_doc_sib"] = m = types.ModuleType("nb_doc_sib")
    >>> m.__file__ = "/elsewhere/nb_doc_sib.py"
    >>> _evict_stale([d]), "nb_doc_sib" in sys.modules
    (['nb_doc_sib'], False)
    """
    shadows: dict[str, str] = {}
    for d in reversed(dirs):            # the first directory wins, as on sys.path
        shadows.update(_names_in(d))
    keys = set()
    for name, f in _user_modules():
        seen = _seen.get(f)
        if (seen is not None and _stamp(f) != seen) or (
                "." not in name and name in shadows and shadows[name] != f):
            keys.add(_top(name))
    if keys:
        under = tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
        keys.update(_top(name) for name, f in _user_modules() if f.startswith(under))
    gone = sorted(n for n in list(sys.modules)
                  if n in keys or any(n.startswith(k + ".") for k in keys))
    for n in gone:
        mod = sys.modules.pop(n)
        f = getattr(mod, "__file__", None)
        if isinstance(f, str):
            _seen.pop(os.path.realpath(f), None)
    if gone:
        importlib.invalidate_caches()
    return gone


def _imported(path: Path) -> Any:
    """The module already imported from ``path`` (resolved), or None."""
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        # (the name first: resolving the path of each of torch's 2,000 modules took 0.3 s)
        if f and os.path.basename(f) == path.name and Path(f).resolve() == path:
            return mod
    return None


class _SourceOnly(importlib.machinery.SourceFileLoader):
    """Loads a user file from its source: no cached bytecode is read (a ``.pyc`` planted beside
    it, or stale) or written (into a bundle's ``code/``, a read-only checkout)."""

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _UserSources:
    """On ``sys.meta_path``, first: a module found under one of the user's directories (an
    entry file's, a stored copy's import roots) is loaded by `_SourceOnly`; a module there that
    exists only as cached bytecode is refused. Elsewhere it finds nothing (Python's own
    finders go on)."""

    def __init__(self) -> None:
        self.dirs: set[str] = set()

    def add(self, d: Path) -> None:
        self.dirs.add(os.path.abspath(d))
        if self not in sys.meta_path:    # just before Python's path finder: builtins first
            at = next((i for i, f in enumerate(sys.meta_path)
                       if f is importlib.machinery.PathFinder), len(sys.meta_path))
            sys.meta_path.insert(at, self)

    def find_spec(self, name: str, path=None, target=None):
        dirs = tuple(self.dirs)
        if not dirs:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = getattr(spec, "origin", None)
        # (the user's own files only: not an environment that lives under their directory)
        if not origin or not any(os.path.abspath(origin).startswith(d + os.sep)
                                 for d in dirs) or frames.kind(origin) != "user":
            return None
        if origin.endswith((".pyc", ".pyo")):
            raise ImportError(f"'{origin}' is cached bytecode without its source; a replay "
                              "imports the user's code from source only")
        if not origin.endswith(".py"):
            return None
        spec.loader = _SourceOnly(name, origin)
        spec.cached = None
        return spec


USER_SOURCES = _UserSources()


def _import_file(path: Path, shown: str, check: bool = False) -> Any:
    """Import ``path`` once per process, under its own stem when that name is free (so a task
    file and an inject file that both ``import moe`` share one ``moe``), else a derived name.
    ``check``: `gate` it first (a module already imported runs nothing again: not checked)."""
    mod = _imported(path)
    if mod is not None:
        return mod
    if check:
        gate(path, shown)
    name = path.stem
    if name in sys.modules or not name.isidentifier():
        name = "nanbisect_entry_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    USER_SOURCES.add(path.parent)     # its siblings too: from source, never from bytecode
    spec = importlib.util.spec_from_file_location(name, path, loader=_SourceOnly(name, str(path)))
    spec.cached = None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if sys.path[:1] != [str(path.parent)]:   # let the file import its neighbours first
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
        sys.path.insert(0, str(path.parent))
    try:
        with _no_training(), _argv(path):
            spec.loader.exec_module(module)
    except _TrainedAtImport as e:
        del sys.modules[name]
        raise _trained(e, shown) from None
    except KeyboardInterrupt:
        del sys.modules[name]
        raise       # Ctrl-C while the entry imports: the user's, not a bad entry
    except BaseException as e:
        del sys.modules[name]
        raise BadInput(f"entry file '{shown}' failed to import: {type(e).__name__}: {e}"
                       f"{_user_frame(e)}; fix that file or pass another --entry") from None
    _remember()
    return module


def _from_working_directory(target: str) -> None:
    """Let the dotted ``target`` (``pkg.module``) be found in the working directory, as
    ``python -m`` and ``python script.py`` users expect: when its top-level package or module
    is there, the working directory goes first on sys.path (as a file entry's directory does).
    ``python -m nanbisect`` took it off before importing its own dependencies (a ``json.py``
    in a bundle directory must not replace json), so here it is put back explicitly, for the
    entry only, the same for ``python -m nanbisect`` and for the ``nanbisect`` command."""
    top = target.split(".")[0]
    if top in sys.modules or not top.isidentifier():
        return
    try:
        cwd = os.getcwd()
        found = importlib.machinery.PathFinder.find_spec(top, [cwd]) is not None
    except (OSError, ImportError, ValueError):
        return
    if found and cwd not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def _module_file(target: str) -> Path | None:
    """The ``.py`` file the dotted ``target`` would be imported from, found on ``sys.path`` and
    the ``__path__`` of parent packages already imported, running no code; else (a package
    that only an import hook finds) `importlib.util.find_spec`, which imports the parent
    packages, under `_no_training`. None: already imported, not found, or not Python source."""
    if target in sys.modules:
        return None
    spec, path = None, None
    parts = target.split(".")
    try:
        for i in range(len(parts)):
            name = ".".join(parts[:i + 1])
            parent = sys.modules.get(name)
            if parent is not None and i < len(parts) - 1:
                path = getattr(parent, "__path__", None)
                spec = None
                if path is None:
                    break
                continue
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or i == len(parts) - 1:
                break
            path = spec.submodule_search_locations
            if not path:
                spec = None
                break
        if spec is None:
            with _no_training():
                spec = importlib.util.find_spec(target)
    except (ImportError, ValueError, OSError):
        return None
    origin = getattr(spec, "origin", None) if spec is not None else None
    return Path(origin).resolve() if origin and origin.endswith(".py") else None


def import_target(target: str, search: list[Path] = (), *, check: bool = False) -> Any:
    """Import a module by dotted name or by file path (tried as given, then under ``search``).
    ``check``: an entry's import, refused by `gate` when the file's top level does more than
    define (before any of it runs); ``sys.argv`` is the file alone while it is imported."""
    if target.endswith(".py"):
        candidates = [Path(target)] + [Path(d) / target for d in search]
        path = next((c.resolve() for c in candidates if c.is_file()), None)
        if path is None:
            raise BadInput(f"entry file '{target}' not found (looked in the working directory"
                           f"{' and ' + ', '.join(map(str, search)) if search else ''}); run from "
                           "the directory the entry is relative to, or pass --entry with its path")
        return _import_file(path, target, check)
    _from_working_directory(target)
    try:
        file = _module_file(target)
        _user_module(target, file)
        if check and file is not None:
            gate(file, f"{target} ({_shown_path(file)})")
        with _no_training(), _argv(file) if file is not None else nullcontext():
            return importlib.import_module(target)
    except BadInput:
        raise
    except _TrainedAtImport as e:
        raise _trained(e, f"entry module {target}") from None
    except ModuleNotFoundError as e:
        raise BadInput(f"entry module '{target}' cannot be imported ({e}); install it, add its "
                       "directory to PYTHONPATH, or pass --entry") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise BadInput(f"entry module '{target}' failed to import: {type(e).__name__}: {e}"
                       f"{_user_frame(e)}; fix that module or pass --entry") from None


def _user_module(target: str, file: Path | None) -> None:
    """`BadInput` unless the dotted ``target`` (``file``: its source as `_module_file` found
    it) is the user's code (or nanbisect's own self-test tasks): an entry never resolves to the
    standard library, torch or an installed package (``os:abort`` would be called). Runs no code
    of it (an imported module's file, or where its spec says it lives)."""
    mod = sys.modules.get(target)
    origin = getattr(mod, "__file__", None) if mod is not None else \
        (str(file) if file is not None else None)
    if origin is None and mod is None and "." not in target:
        try:        # a top-level module that is no source file (an extension, a frozen one)
            origin = getattr(importlib.machinery.PathFinder.find_spec(target), "origin", None)
        except (ImportError, ValueError, OSError):
            pass
    if origin is None and (target in sys.builtin_module_names or mod is not None):
        origin = "<built-in>"
    if origin is None:
        return      # not found: the import says so
    owner = frames.kind(origin)
    if owner not in ("user", "nanbisect"):
        where = {"stdlib": "the standard library", "torch": "torch",
                 "installed": "an installed package"}.get(owner, owner)
        raise BadInput(f"entry module '{target}' is {where}'s, not your code: an entry names the "
                       "function of your training code that returns a nanbisect.Task "
                       "(path/to/train.py:make_task or your.module:make_task)")


def check_entry(entry: str, search: list[Path] = ()) -> None:
    """`gate` the file ``entry`` names (as `load_task` would find it), importing nothing of it:
    a run calls it before it replays or writes anything. An entry whose file is not found, or
    a module already imported, is left to `load_task`.

    >>> check_entry("fixtures/tasks/healthy.py:task")    # defines only
    """
    target, _ = split_entry(entry)
    if target.endswith(".py"):
        found = next((c.resolve() for c in [Path(target)] + [Path(d) / target for d in search]
                      if c.is_file()), None)
        if found is not None and _imported(found) is None:
            gate(found, target)
        return
    _from_working_directory(target)
    try:
        file = _module_file(target)
        _user_module(target, file)
    except _TrainedAtImport as e:       # a parent package that trains, found by an import hook
        raise _trained(e, f"entry module {target}") from None
    if file is not None:
        gate(file, f"{target} ({_shown_path(file)})")


def load_task(entry: str, search: list[Path] = (), *, run_top_level: bool = False,
              roots: list[Path] = ()) -> Task:
    """Import the entry and call it; check that it returned a usable `Task`. Unless
    ``run_top_level``, an entry file whose top level acts at import is refused before it
    is imported (`gate`). Stale user modules leave ``sys.modules`` first (`_evict_stale`: those
    changed on disk, those shadowed by a module of the entry file's directory or of ``roots``,
    the import roots a caller put first on sys.path; with them the user modules under those
    directories). ``sys.argv`` is the entry's file alone
    while it is imported and while the task function runs. When it fails, ``sys.path`` is as it
    was; when it succeeds, the entry's directory stays first (the task may import at step time:
    `kept_path` around a run restores it).

    >>> type(load_task("fixtures/tasks/healthy.py:task").model).__name__
    'TinyGPT'
    """
    target, func = split_entry(entry)
    dirs = list(roots)
    for r in roots:       # a stored copy's modules: from source only
        USER_SOURCES.add(Path(r))
    if target.endswith(".py"):
        found = next((c.resolve() for c in [Path(target)] + [Path(d) / target for d in search]
                      if c.is_file()), None)
        dirs = ([found.parent] if found is not None else []) + dirs
    saved = list(sys.path)
    try:
        _evict_stale(dirs)
        module = import_target(target, list(search), check=not run_top_level)
        fn = getattr(module, func, None)
        if not callable(fn):
            raise BadInput(f"entry '{entry}': '{func}' is not a function in {target}; pass "
                           "--entry naming the function that returns nanbisect.Task")
        file = getattr(module, "__file__", None)
        try:
            with _argv(Path(file)) if isinstance(file, str) else nullcontext():
                task = fn()
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise BadInput(f"entry '{entry}' raised {type(e).__name__}: {e}{_user_frame(e)}; "
                           "fix the entry function or pass --entry") from None
    except BaseException:
        sys.path[:] = saved
        raise
    finally:
        _remember()
    if not isinstance(task, Task):
        raise BadInput(f"entry '{entry}' returned {type(task).__name__}, not nanbisect.Task; "
                       "return Task(model=..., optimizer=..., loss_fn=...) or pass --entry")
    if not isinstance(task.model, torch.nn.Module) or not callable(
            task.loss_fn or task.step_fn or getattr(task.schedule, "step", None)):
        raise BadInput(f"entry '{entry}': Task.model must be an nn.Module and its step "
                       "(loss_fn, step_fn or schedule) callable; fix the entry function or pass "
                       "--entry")
    return task


def load_inject(spec: str) -> Callable[[], ContextManager]:
    """``FILE.py:FUNC`` -> FUNC, a factory of the context manager wrapped around target runs."""
    target, func = split_entry(spec)
    fn = getattr(import_target(target), func, None)
    if not callable(fn):
        raise BadInput(f"--inject '{spec}': '{func}' is not a function in {target}; name a "
                       "function that returns a context manager")
    return fn
