"""Catch what a culprit started from, in one more narrow replay: the op's arguments (and the RNG
state and user source line at that moment), or the whole module call's inputs and state.

`InputCatcher` replays the step and, at the culprit (the same op, at the same occurrence among
calls of that op in its phase: an `OpSite`), clones the op's arguments, the RNG state (for
dropout, ``rand_like``, ...) and the user source line: the innermost frame outside torch and
nanbisect; for a backward formula, the line in forward that created its autograd node (anomaly
mode records it during this pass only). Python stacks are taken here only, and only for the
culprit op.
"""
from __future__ import annotations

import inspect
import os
import re
import traceback
import weakref
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.bundle.state import local
from nanbisect.locate.rows import RowTracer
from nanbisect.records import CallId, Caught, ModuleCaught, Node, OpSite, RowTrace
from nanbisect.replay.recorder import SKIP, made_node
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.step import op_phase
from nanbisect.util import frames
from nanbisect.util import torch_internals as ti

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nanbisect/
_FRAME = re.compile(r'File "(.+)", line (\d+)')
# a dispatch mode that rides along the catch (`RowTracer`) is not on the op's way from the user,
# nor is the observer mode's own dispatch (`torch_internals`) that runs the catcher's hooks, nor
# a function mode the user's step opts into (megatron-core's CPU shims)
_RIDERS = {os.path.join(_OWN_DIR, "locate", "rows.py"),
           os.path.join(_OWN_DIR, "util", "torch_internals.py"),
           os.path.join(_OWN_DIR, "integrations", "megatron.py")}


def _where(path: str) -> str:
    """Whose a frame is: "own" (nanbisect), "torch", "lib" (the standard library, frozen and
    generated code) or "user" (anything else: the user's files and installed model code)."""
    return {"nanbisect": "own", "stdlib": "lib", "installed": "user"}.get(
        k := frames.kind(path), k)


def _is_user(path: str) -> bool:
    return _where(path) == "user"


# where an optimizer-phase op's own code lives (unscale_, clip_grad_norm_, the update)
_OPTIMIZER_CODE = tuple(os.path.join(_TORCH_DIR, d) for d in ("optim", "amp",
                                                              os.path.join("nn", "utils")))


def short_path(path: str, line: int) -> str:
    """"path:line", the path relative to the working directory when it lies under it."""
    rel = os.path.relpath(path)
    return f"{rel if not rel.startswith('..') else path}:{line}"


def user_frame(frames: list[tuple[str, int]]) -> str | None:
    """'file:line' of the innermost frame outside torch, nanbisect and the standard library.

    >>> user_frame([("/srv/train.py", 10), (torch.__file__, 3)])
    '/srv/train.py:10'
    """
    for path, line in reversed(frames):
        if _is_user(path):
            return short_path(path, line)
    return None


def calling_frame(frames: list[tuple[str, int]]) -> str | None:
    """The user line that called the running op, from the stack at the op (outermost first):
    the innermost user frame *before the stack leaves the user's code* back into nanbisect's
    (the replay that called ``loss.backward()`` or ``optimizer.step()``). None when no user
    code is between them (a built-in backward formula, an optimizer kernel): the frames beyond
    are the tool's own callers (its CLI), never the op's source.

    >>> T, OWN = torch.__file__, __file__
    >>> calling_frame([("/srv/cli.py", 1), (OWN, 2), ("/srv/model.py", 3), (T, 4), (OWN, 5)])
    '/srv/model.py:3'
    >>> calling_frame([("/srv/cli.py", 1), (OWN, 2), (T, 3), (OWN, 4)]) is None
    True
    """
    left_own = False
    for path, line in reversed(frames):
        where = _where(path)
        if where == "user":
            return short_path(path, line)
        if where == "own" and left_own:
            return None
        left_own = left_own or where != "own"
    return None


def optimizer_frame(frames: list[tuple[str, int]], extra: tuple[str, ...] = ()) -> str | None:
    """The innermost frame in optimizer code (torch.optim, torch.amp, clip_grad, or the files in
    ``extra``: a custom optimizer's), for an op of the optimizer phase."""
    for path, line in reversed(frames):
        p = os.path.abspath(path)
        if p.startswith(_OPTIMIZER_CODE) or p in extra:
            return short_path(p, line)
    return None


def _clone(x):
    if isinstance(x, torch.Tensor):
        return local(x).detach().clone()   # a DTensor's shard: what the kernel ran on
    return None if isinstance(x, torch.Generator) else x


class _Caught(BaseException):
    """Raised by `InputCatcher` right after the catch to end a forward replay there: what
    follows the culprit is not needed. A BaseException, so that a model's ``except Exception``
    does not swallow it."""


_OP_KEY = "nanbisect.forward_op"      # in an autograd node's metadata: the op that made it


def _tag_nodes(made: list) -> None:
    """Tag the autograd node each recorded forward op made with that op (``_OP_KEY``)."""
    for op, refs in made:
        fn = made_node(refs)
        # NB: a custom Function's node is made by its apply, not by the last op of its forward
        if fn is not None and not ti.is_custom_function_node(fn) and \
                _OP_KEY not in fn.metadata:
            fn.metadata[_OP_KEY] = op
    made.clear()


class NodeTagger(ti.ObserverMode):
    """Tag the autograd node each forward op makes with that op (``_OP_KEY``), so that a catch
    in backward names the forward op behind its node; set ``.phase`` as the step moves on.
    Follows forward ops only (autograd sets ``grad_fn`` after the op returns: the outputs of
    one op are read at the next)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self._made: list = []

    def wants(self, func) -> bool:
        if self._made:
            _tag_nodes(self._made)
        return func not in SKIP

    def before(self, call: ti.OpCall) -> bool:
        return op_phase(self.phase) == "forward"

    def after(self, call: ti.OpCall, out) -> None:
        self._made = [(call.name, [weakref.ref(t) for t in call.out_leaves()
                                   if isinstance(t, torch.Tensor)])]


class InputCatcher(NodeTagger):
    """Clone the arguments of the op at ``site``; set ``.phase`` as the step moves on.

    NB: matched by op and occurrence within the phase, not by the step-wide op index: a wrapper
    with per-iteration state (DDP rebuilds its buckets on its second iteration) adds ops between
    replays, which shifts global indices but not the culprit's place among its own kind.
    """

    def __init__(self, site: OpSite, optimizer_files: tuple[str, ...] = (),
                 stop: bool = False) -> None:
        super().__init__()
        self.site = site
        self.optimizer_files = optimizer_files
        self.stop = stop      # raise _Caught once caught (forward only: see catch_inputs)
        self.seen = 0
        self.caught: Caught | None = None

    def before(self, call: ti.OpCall) -> bool:
        """A forward op before a backward site: follow it (`after` keeps its outputs). At the
        site: catch (and, with ``stop``, end the replay)."""
        phase = op_phase(self.phase)     # a pipeline stage's backward runs inside its step
        if self.site.phase == "backward" and phase == "forward":
            return True
        if self.caught is None and phase == self.site.phase and call.name == self.site.op:
            if self.seen == self.site.occurrence:
                self.caught = self._catch(call.func, call.args, call.kwargs, phase,
                                          self.optimizer_files)
                if self.stop:
                    raise _Caught()
            self.seen += 1
        return False

    @staticmethod
    def _catch(func, args, kwargs, phase: str, optimizer_files: tuple[str, ...]) -> Caught:
        rng = {"rng/cpu": torch.get_rng_state()}
        for t in ti.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not devices.on_host(t.device) \
                    and devices.holds_values(t.device):
                state = devices.entry(t.device).get_device_rng(t.device)
                if state is not None:
                    rng[f"rng/{t.device.type}"] = state
                break
        stack = [(f.filename, f.lineno) for f in traceback.extract_stack()
                 if os.path.abspath(f.filename) not in _RIDERS]
        source = calling_frame(stack)
        if source is None and phase == "optimizer":    # the optimizer's own code
            source = optimizer_frame(stack, optimizer_files)
        node = ti.current_autograd_node()
        made = None
        if node is not None:
            tb = ti.anomaly_traceback(node)
            made = user_frame([(m.group(1), int(m.group(2))) for line in tb
                               for m in [_FRAME.search(line)] if m])
            if source is None:      # a backward formula: where forward made it
                source = made
        return Caught(op=str(func), args=ti.tree_map(_clone, list(args)),
                      kwargs=ti.tree_map(_clone, dict(kwargs)),
                      mutated=ti.written_positions(func, len(args)),
                      rng=rng, source=source,
                      node=Node(node.name(), (node.metadata or {}).get(_OP_KEY), made)
                      if node is not None else None)


class AheadCatch:
    """Pass 3 folded into pass 2, for a forward or backward culprit on the CPU: while the
    op-recording pass runs, catch what `InputCatcher` would catch (arguments, RNG state, source
    line, the autograd node and the forward line that made it, and with ``rows`` the batch
    rows) at every op the recorder sees make the failure's kind from clean inputs
    (`OpRecorder`'s ``born``): the root provenance finds afterwards is one of them, so `caught`
    hands its catch over and the narrow replay of `catch_inputs` is not needed.

    Only ops that wrote none of their arguments and drew no random numbers are offered (their
    arguments are, after the op, what it read; the RNG state is the one it started from), and
    clones stop at ``max_bytes`` (a mask filled with -inf in every layer, under an inf
    failure, offers one candidate per layer): `caught` is None for a root not caught this way,
    and the caller replays to catch it (`catch_inputs`).

    With ``backward`` (the failure is in backward), forward runs in anomaly mode (each autograd
    node keeps the forward line that made it, as `catch_inputs` does for a backward site) under
    a `NodeTagger` (each node names the op that made it): what a backward catch reports.

    Hand `start` to the replayer's ``batch_edits``, `on_born` to the recorder and `phase` to
    the replay's phase callback; enter `riders` above the recorder (the row tracer, so that it
    follows every op, and the tagger).
    """

    def __init__(self, rep: Replayer, rows: RowTracer | None = None,
                 max_bytes: int = 256 << 20, backward: bool = False) -> None:
        opt = rep.task.optimizer
        self.files = ()
        if opt is not None:
            try:
                self.files = (os.path.abspath(inspect.getsourcefile(type(opt)) or ""),)
            except TypeError:
                pass
        self.rows, self.max_bytes = rows, max_bytes
        self.tagger = NodeTagger() if backward else None
        self.kept: dict[int, tuple[Caught, RowTrace | None]] = {}
        self.bytes = 0
        self.now = "forward"

    @property
    def riders(self) -> list[ti.ObserverMode]:
        return [m for m in (self.rows, self.tagger) if m is not None]

    def start(self, batch):
        """A new run of the step (a `Replayer.batch_edits` entry): forget the last one's."""
        self.kept.clear()
        self.bytes = 0
        return self.rows.start(batch) if self.rows is not None else batch

    def phase(self, name: str) -> ContextManager:
        """The step enters phase ``name``: the context to run it in (anomaly mode for a
        forward whose backward is caught)."""
        self.now = name
        for m in self.riders:
            m.phase = name
        if self.tagger is not None and op_phase(name) == "forward":
            return torch.autograd.set_detect_anomaly(True, check_nan=False)
        return nullcontext()

    def on_born(self, index: int, func, args: tuple, kwargs: dict) -> None:
        size = sum(t.numel() * t.element_size() for t in
                   ti.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if self.bytes + size > self.max_bytes:
            return
        self.bytes += size
        caught = InputCatcher._catch(func, args, kwargs, op_phase(self.now), self.files)
        rows = None
        if self.rows is not None:
            rows = self.rows.trace_at(func, args, kwargs)
            self.rows.seed(index)       # and follow its bad rows on from there
        self.kept[index] = (caught, rows)

    def caught(self, op: str, op_index: int) -> tuple[Caught, RowTrace | None] | None:
        """The catch at the root op (its name and index in the step), None when not caught."""
        got = self.kept.get(op_index)
        if got is None or got[0].op != op:
            return None
        caught, rows = got
        if rows is not None and self.rows is not None:
            rows = self.rows.reached_by(rows, op_index)
        return caught, rows


def catch_inputs(rep: Replayer, site: OpSite,
                 wrap: Callable[[], ContextManager] = nullcontext,
                 rows: RowTracer | None = None) -> Caught | None:
    """Last pass: replay up to the culprit op and clone its arguments. A forward culprit ends the
    replay right there (in a lockstep multi-rank replay it does not: the other ranks wait in the
    collectives that follow, nor under torch.distributed, whose wrappers keep per-forward state:
    FSDP2's unsharded parameters); a later one runs to the end of its phase (an exception thrown
    through the autograd engine or an optimizer is not ours to rely on). With ``rows`` (for the
    same site) the pass also traces the batch rows the culprit's bad value depends on
    (`RowTracer.result`), at no extra replay."""
    opt = rep.task.optimizer
    files = ()
    if opt is not None:
        try:
            files = (os.path.abspath(inspect.getsourcefile(type(opt)) or ""),)
        except TypeError:
            pass
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    catcher = InputCatcher(site, files, stop=site.phase == "forward" and not rep.lockstep
                           and not distributed)

    def phase(name: str) -> ContextManager:
        catcher.phase = name
        if rows is not None:
            rows.phase = name
        # anomaly mode makes every autograd node remember the forward line that created it
        if name == "forward" and site.phase == "backward":
            return torch.autograd.set_detect_anomaly(True, check_nan=False)
        return nullcontext()

    modes = [catcher] if rows is None else [catcher, rows]   # the tracer sees each op first
    if rows is not None:
        rep.batch_edits.append(rows.start)
    try:
        rep.run(phase=phase, wrap=lambda: stacked(wrap(), *modes), stop_after=site.phase)
    except _Caught:
        pass
    finally:
        if rows is not None:
            rep.batch_edits.remove(rows.start)
    return catcher.caught


def catch_module_call(rep: Replayer, target: CallId,
                      wrap: Callable[[], ContextManager] = nullcontext,
                      backward: bool = False) -> ModuleCaught | None:
    """Replay and clone what module call ``target`` started from (for ``backward``, replay
    backward too and clone the gradients arriving at the call's outputs)."""
    out: list[dict] = []
    grads: list = []

    def enter(call, mod, args, kwargs):
        if call == target:
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa
            out.append(dict(call=call, args=ti.tree_map(clone, list(args)),
                            kwargs=ti.tree_map(clone, dict(kwargs)),
                            state={k: v.detach().clone()
                                   for k, v in mod.state_dict(keep_vars=True).items()},
                            rng={"rng/cpu": torch.get_rng_state()}))

    def leave(call, mod, args, kwargs, output):
        if call != target or not backward:
            return
        leaves = [t for t in ti.tree_leaves(output) if isinstance(t, torch.Tensor)]
        grads.extend([None] * len(leaves))
        for i, t in enumerate(leaves):
            if (t.is_floating_point() or t.is_complex()) and t.requires_grad:
                def keep(g, i=i):
                    grads[i] = g.detach().clone()
                t.register_hook(keep)

    tracker = ModuleTracker(rep.task.model).listen(enter, leave)
    rep.run(wrap=lambda: stacked(wrap(), tracker),
            stop_after="backward" if backward else "forward")
    if not out:
        return None
    return ModuleCaught(**out[0], grad_out=grads if backward else None)
