"""The one room for torch's internals: every private torch API and version-dependent behaviour
nanbisect relies on, behind a function (or a class) here.

Guarantees: the rest of nanbisect names no ``torch._*`` module, no ``torch.utils._*`` module and
no underscored attribute of a torch object (``_schema``, ``_sequence_nr``, ``_cdata``); it calls
this module. Every entry's docstring says on which torch versions it was checked, so a new torch
release is checked here, once. `check_torch_version` says in one line what needs a newer torch.
Not guaranteed: that a torch older than `CHECKED_ON` works (nothing older has been checked).

The dispatch-mode side is `ObserverMode`: one `TorchDispatchMode` that runs every op once and
calls hook methods around it (`wants`, `before`, `run`, `after`) with an `OpCall` that flattens
the op's arguments and results at most once, as torch's own ``torch.utils._debug_mode``'s
``DebugMode`` does; nanbisect's modes (the op recorder, the input catch, the row tracer, the
upcast, the tapes, ...) are its subclasses and override only the hooks they need.
"""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


# the torch versions every entry below was checked on (the test suite ran on each)
CHECKED_ON = ("2.13.0",)
FLOOR = (2, 13)          # the oldest torch checked: pyproject's floor


# -- versions -------------------------------------------------------------------------------------
def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch's).

    >>> torch_version("2.13.0+cpu"), torch_version("2.4.1")
    ((2, 13), (2, 4))
    """
    parts = re.findall(r"\d+", (version or torch.__version__).split("+")[0])[:2]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, 0)


# feature -> (the module it needs, what it is for)
FEATURES = {
    "compiler": ("torch._inductor.compiler_bisector", "compiler bisection (CompilerBisector)"),
    "fake-process-group": ("torch.testing._internal.distributed.fake_pg",
                           "replaying some ranks alone (--ranks) on the fake process group"),
}


def check_torch_version(feature: str | None = None, version: str | None = None) -> str | None:
    """None when the installed torch (or ``version``) is not older than `FLOOR` and has
    ``feature`` (a `FEATURES` key; asking imports the packages above its module); else one
    line saying what needs a newer torch. Checked on 2.13.0.

    >>> check_torch_version(version="2.13.0") is None
    True
    >>> check_torch_version(version="2.4.0")
    'nanbisect is checked on torch 2.13.0; torch 2.4.0 is older: upgrade torch to 2.13 or later'
    """
    v = version or torch.__version__
    if torch_version(v) < FLOOR:
        return (f"nanbisect is checked on torch {CHECKED_ON[0]}; torch {v} is older: upgrade "
                f"torch to {FLOOR[0]}.{FLOOR[1]} or later")
    if feature is not None:
        module, what = FEATURES[feature]
        try:
            import importlib.util
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{what} needs {module}, which torch {v} does not have: upgrade torch"
    return None


# -- pytrees (``torch.utils._pytree``: torch 2.13 has no public pytree module) -----------------
def tree_leaves(tree: Any) -> list:
    """The leaves of a pytree (tuples, lists, dicts, torch's registered containers), in order.
    Checked on 2.13.0.

    >>> tree_leaves(([1, 2], {"a": 3}))
    [1, 2, 3]
    """
    return _pytree.tree_leaves(tree)


def tree_map(fn: Callable, tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every leaf. Checked on 2.13.0.

    >>> tree_map(lambda x: x * 2, [1, (2, 3)])
    [2, (4, 6)]
    """
    return _pytree.tree_map(fn, tree)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """(leaves, spec) of a pytree; `tree_unflatten` makes it again. Checked on 2.13.0."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    """The pytree ``spec`` describes, with ``leaves``. Checked on 2.13.0."""
    return _pytree.tree_unflatten(leaves, spec)


# -- ops and their schemas ----------------------------------------------------------------------
BUILTIN_NAMESPACES = ("aten", "prims", "quantized")   # ops torch has without any user code


def schema_arguments(func) -> list:
    """An ``OpOverload``'s schema arguments (``.name``, ``.alias_info``: ``is_write``).
    ``OpOverload._schema``: checked on 2.13.0."""
    return func._schema.arguments


def schema_returns(func) -> list:
    """An ``OpOverload``'s schema returns (``.alias_info``: a view of an input when set).
    ``OpOverload._schema``: checked on 2.13.0."""
    return func._schema.returns


def schema_name(func) -> str:
    """An ``OpOverload``'s qualified schema name, e.g. ``"c10d::allreduce_"``. Checked on 2.13.0."""
    return func._schema.name


def written_positions(func, nargs: int) -> list[int]:
    """The positions among the first ``nargs`` arguments that the op writes (alias annotation
    with a write). Checked on 2.13.0."""
    return [i for i, a in enumerate(schema_arguments(func)[:nargs])
            if a.alias_info is not None and a.alias_info.is_write]


def disable_current_modes():
    """A context manager within which no dispatch mode is active (an op runs plainly).
    ``torch.utils._python_dispatch._disable_current_modes``: checked on 2.13.0."""
    return _disable_current_modes()


# -- the replay's private torch reads --------------------------------------------------------
def apply_to_tensors(module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every parameter and buffer of ``module`` (and its children) by ``fn`` of it, as
    ``module.to`` does (``Module._apply``: parameters stay parameters, their gradients follow);
    the replay casts with it, since ``module.to(dtype)`` drops the imaginary part of complex
    parameters. Checked on torch 2.13.0."""
    module._apply(fn)


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``): bumped by every in-place write through
    ``t`` or a view of it, not by a write through ``.data``. Checked on torch 2.13.0.

    >>> t = torch.zeros(2); before = version_counter(t); _ = t.add_(1)
    >>> version_counter(t) - before
    1
    """
    return t._version


# -- the observer dispatch mode -----------------------------------------------------------------
aten = torch.ops.aten
# Pure metadata ops: an observer that counted them would depend on Python-side shape queries.
METADATA_OPS = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                          aten.sym_storage_offset.default, aten.is_contiguous.default,
                          aten.size.default, aten.stride.default})


class OpCall:
    """One dispatched op as the hooks of an `ObserverMode` see it: ``func``, ``args``,
    ``kwargs``; `leaves` flattens the arguments once, however many hooks ask. Hooks may keep
    their own per-op notes as attributes of it (tests/base/test_torch_internals.py shows one).
    """

    def __init__(self, func, args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self._name: str | None = None
        self._leaves: list | None = None
        self.out: Any = None             # what the op returned (set before `after`)
        self._out_leaves: list | None = None

    @property
    def name(self) -> str:
        """``str()`` of the overload, e.g. "aten.sqrt.default"."""
        if self._name is None:
            self._name = str(self.func)
        return self._name

    def leaves(self) -> list:
        """The leaves of ``(args, kwargs)``, flattened once."""
        if self._leaves is None:
            self._leaves = tree_leaves((self.args, self.kwargs))
        return self._leaves

    def tensors(self) -> list[torch.Tensor]:
        """The tensors among `leaves`."""
        return [t for t in self.leaves() if isinstance(t, torch.Tensor)]

    def out_leaves(self) -> list:
        """The leaves of what the op returned, flattened once (in `after`)."""
        if self._out_leaves is None:
            self._out_leaves = tree_leaves(self.out)
        return self._out_leaves

    def __call__(self) -> Any:
        """Run the op as dispatched."""
        return self.func(*self.args, **self.kwargs)


class ObserverMode(TorchDispatchMode):
    """A dispatch mode that runs every op once and calls hooks around it; subclasses override
    the hooks they need and never ``__torch_dispatch__`` itself.

    - ``wants(func) -> bool``: asked first, for every op (metadata ops too); False: the op
      runs plainly and no other hook sees it. Default: every op but `METADATA_OPS`.
    - ``before(call) -> bool``: before the op runs; False: the op runs plainly, no `after`.
    - ``run(call)``: runs the op (default: as dispatched); override to run something else.
    - ``after(call, out)``: after it ran, with what it returned (``call.out`` too).

    A hook may raise: the exception leaves the mode as it would leave ``__torch_dispatch__``.
    ``torch.utils._python_dispatch.TorchDispatchMode``: checked on 2.13.0 (its subclasses'
    ``__torch_dispatch__`` is wrapped in ``torch._disable_dynamo``: only this one's is).

    >>> class Names(ObserverMode):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.seen = []
    ...     def after(self, call, out):
    ...         self.seen.append(call.name)
    >>> with Names() as m:
    ...     _ = torch.ones(2).exp()
    >>> m.seen
    ['aten.ones.default', 'aten.exp.default']
    """

    def wants(self, func) -> bool:
        return func not in METADATA_OPS

    def before(self, call: OpCall) -> bool:
        return True

    def run(self, call: OpCall) -> Any:
        return call.func(*call.args, **call.kwargs)

    def after(self, call: OpCall, out: Any) -> None:
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.wants(func):
            return func(*args, **kwargs)
        call = OpCall(func, args, kwargs)
        if self.before(call) is False:
            return func(*args, **kwargs)
        out = call.out = self.run(call)
        self.after(call, out)
        return out


# -- autograd -----------------------------------------------------------------------------------
def current_autograd_node():
    """The autograd node whose backward is running on this thread (None outside backward).
    ``torch._C._current_autograd_node``: checked on 2.13.0."""
    return torch._C._current_autograd_node()


def in_backward() -> bool:
    """Is the autograd engine running a backward on this thread (a node, a hook)?
    ``torch._C._current_graph_task_id``: checked on 2.13.0 (-1 outside backward)."""
    return torch._C._current_graph_task_id() != -1


def node_sequence_nr(node) -> int:
    """An autograd node's sequence number (the order forward made the nodes in).
    ``Node._sequence_nr()``: checked on 2.13.0."""
    return node._sequence_nr()


def is_custom_function_node(node) -> bool:
    """Is ``node`` a custom ``autograd.Function``'s (not a built-in formula's)?
    ``torch.autograd.function.BackwardCFunction``: checked on 2.13.0."""
    from torch.autograd.function import BackwardCFunction
    return isinstance(node, BackwardCFunction)


def anomaly_traceback(node) -> list[str]:
    """The forward stack (lines of text) anomaly mode kept on ``node``; [] without one.
    The ``"traceback_"`` metadata key: checked on 2.13.0."""
    return (node.metadata or {}).get("traceback_") or []


# -- storages -----------------------------------------------------------------------------------
def storage_ref(storage):
    """A weak reference to an untyped storage (``.expired()``; `same_storage` compares it).
    ``torch.multiprocessing.reductions.StorageWeakRef``: checked on 2.13.0."""
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(storage)


def same_storage(ref, storage) -> bool:
    """Does the live weak reference ``ref`` (`storage_ref`) name ``storage``? The reference
    pins the storage object, so its ``cdata`` names no other one. ``_cdata``: checked on
    2.13.0."""
    return ref.cdata == storage._cdata


# -- collectives --------------------------------------------------------------------------------
def wait_tensor(t: torch.Tensor) -> Any:
    """Wait for a functional collective's output. ``torch.ops._c10d_functional.wait_tensor``:
    checked on 2.13.0."""
    return torch.ops._c10d_functional.wait_tensor(t)


def group_timeout() -> float | None:
    """Seconds the default process group waits for a collective (the job's own
    ``init_process_group(timeout=...)``, else the backend's default); None when unknown.
    ``ProcessGroup._get_backend(device).options._timeout`` and ``_device_types``: checked on
    2.13.0."""
    try:
        import torch.distributed as dist
        pg = dist.group.WORLD
        for dev in getattr(pg, "_device_types", []) or []:
            t = pg._get_backend(torch.device(dev)).options._timeout
            return t.total_seconds()
    except Exception:  # noqa: BLE001 - a backend without these: unknown
        return None
    return None


def op_process_group(func, args: tuple, kwargs: dict):
    """The process group a dispatched c10d or functional collective runs on (None: not found):
    a boxed ``ProcessGroup`` argument, or a functional collective's group name.
    ``ProcessGroup.unbox``: checked on 2.13.0."""
    import torch.distributed as dist

    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(v)
            except (RuntimeError, TypeError, AttributeError):
                continue
        if isinstance(v, str) and func.namespace.endswith("c10d_functional"):
            try:
                return resolve_process_group(v)
            except (RuntimeError, KeyError, ValueError):
                continue
    return None


def work_of(x: Any):
    """The pybind ``Work`` behind a collective's result (a dispatched c10d op returns a boxed
    ``ScriptObject``; ``dist.*(async_op=True)`` the pybind one), whose ``wait`` takes a
    timeout. None when ``x`` is no work. ``torch._C._distributed_c10d.Work.unbox``: checked on
    2.13.0."""
    from torch._C._distributed_c10d import Work
    if isinstance(x, Work):
        return x
    if isinstance(x, torch.ScriptObject) and hasattr(x, "wait"):
        try:
            return Work.unbox(x)
        except (RuntimeError, TypeError):
            return None
    return None


def work_of_future(fut: "torch.futures.Future") -> Any:
    """A boxed c10d work that completes with ``fut`` (its ``wait`` waits for the future and
    raises the future's error): what a c10d op can hand back in place of its own work.
    ``_create_work_from_future`` and ``Work.boxed``: checked on 2.13.0."""
    from torch._C._distributed_c10d import _create_work_from_future
    return _create_work_from_future(fut).boxed()


def object_to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    """``obj`` as a uint8 tensor on ``device``, as ``broadcast_object_list`` sends it (within
    the job's own ranks, never from a bundle). ``distributed_c10d._object_to_tensor``: checked
    on 2.13.0."""
    from torch.distributed import distributed_c10d as c10d
    t, _ = c10d._object_to_tensor(obj, device, None)
    return t


def bytes_to_object(t: torch.Tensor) -> Any:
    """`object_to_bytes`'s inverse, of a tensor in host memory.
    ``distributed_c10d._tensor_to_object``: checked on 2.13.0."""
    from torch.distributed import distributed_c10d as c10d
    return c10d._tensor_to_object(t, t.numel(), None)


def resolve_process_group(name: str):
    """The process group a functional collective names by string.
    ``torch.distributed.distributed_c10d._resolve_process_group``: checked on 2.13.0."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def fake_store():
    """A store for torch's fake process group (``init_process_group("fake", store=...)``), which
    communicates nothing. ``torch.testing._internal.distributed.fake_pg.FakeStore``: checked on
    2.13.0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


def every_group_fake() -> None:
    """In a process whose default group is torch's fake one: every group made after it is fake
    too, whatever backend its maker asks for (a job's gloo side groups: megatron-core's
    ``create_gloo_process_groups``), without backend options (NCCL's): a group of another
    backend cannot be made on the fake store. Idempotent.
    ``distributed_c10d._new_group_with_tag`` (what ``new_group`` calls, positional ``ranks,
    timeout, backend, backend_options``): checked on 2.13.0."""
    from torch.distributed import distributed_c10d as c10d

    made = c10d._new_group_with_tag
    if getattr(made, "nanbisect_fake", False):
        return

    def fake(ranks=None, timeout=None, backend=None, backend_options=None, *args, **kwargs):
        return made(ranks, timeout, None, None, *args, **kwargs)

    fake.nanbisect_fake = True
    c10d._new_group_with_tag = fake


# -- frames: who issued a dispatched op ---------------------------------------------------------
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DDP_FILE = TORCH_DIR + "nn/parallel/distributed.py"
_ENGINE = TORCH_DIR + "autograd/graph.py"
# torch's frames between the code that issued an op and the dispatch modes that see it
PLUMBING = tuple(TORCH_DIR + p for p in (
    "_ops.py", "utils/_python_dispatch.py", "_dynamo/", "_compile.py",
    "distributed/c10d_logger", "distributed/distributed_c10d.py"))
_HERE = os.path.abspath(__file__)


def dispatch_caller():
    """The frame that called the running mode's ``__torch_dispatch__`` (from a hook of an
    `ObserverMode`, or from ``__torch_dispatch__`` itself); None on a thread with no Python
    frame below it (CUDA's autograd device threads). ``sys._getframe``: checked on 2.13.0."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name != "__torch_dispatch__":
        f = f.f_back
    return f.f_back if f is not None else None


_HOOKS = ("wants", "before", "run", "after")


def _plumbing(frame) -> bool:
    """Frames between a collective's caller and the mode: other modes (their
    ``__torch_dispatch__``, this module's, an `ObserverMode`'s hooks), torch's op plumbing."""
    code = frame.f_code
    if code.co_name == "__torch_dispatch__" or code.co_filename == _HERE or \
            code.co_filename.startswith(PLUMBING):
        return True
    return code.co_name in _HOOKS and isinstance(frame.f_locals.get("self"), ObserverMode)


def ddp_origin(frame) -> str | None:
    """Where a collective dispatched under a DDP model comes from, from the frame that issued
    it (`dispatch_caller`): ``"bucket"`` (DDP's reducer: no Python frame but the autograd
    engine's, or none at all; or a comm hook: a frame below the engine holds a ``GradBucket``),
    ``"rebuild"`` (DDP's ``_pre_forward`` rebuilding its buckets) or None (anything else).
    Recognised by torch's file paths (``nn/parallel/distributed.py``, ``autograd/graph.py``):
    checked on 2.13.0."""
    import torch.distributed as dist

    f = frame
    while f is not None and _plumbing(f):
        f = f.f_back
    if f is None or f.f_code.co_filename == _ENGINE:
        return "bucket"
    if f.f_code.co_filename == _DDP_FILE and f.f_code.co_name == "_pre_forward":
        return "rebuild"
    g = f
    while g is not None and g.f_code.co_filename != _ENGINE:
        if any(isinstance(v, dist.GradBucket) for v in g.f_locals.values()):
            return "bucket"
        g = g.f_back
    return None


@contextmanager
def observing_fsdp_reductions(around: Callable[[list[str], list[int], list], Any]):
    """While active, every FSDP2 gradient reduction of this process (``foreach_reduce``: the
    cast into the reduce dtype, the divisions, the reduce-scatter, the all-reduce) runs inside
    ``around(names, sizes, modules)``: the reduced parameters' names from the root
    (``FSDPParam._param_fqn``), their padded shard sizes (``padded_sharded_param_size``, the
    layout of the reduce-scatter's output and of each rank's chunk of its input) and the
    modules of the FSDP unit (the calling ``FSDPParamGroup.modules``). Replaces the name
    ``_fsdp_param_group.foreach_reduce`` (what ``post_backward`` calls) while active: checked on
    2.13.0; nothing happens where FSDP2 is absent."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    except ImportError:
        yield
        return
    original = group_module.foreach_reduce

    def foreach_reduce(fsdp_params, *args, **kwargs):
        group = sys._getframe(1).f_locals.get("self")
        try:
            names = [str(p._param_fqn) for p in fsdp_params]
            sizes = [int(p.padded_sharded_param_size.numel()) for p in fsdp_params]
        except (AttributeError, TypeError):
            names, sizes = [], []
        with around(names, sizes, list(getattr(group, "modules", ()) or ())):
            return original(fsdp_params, *args, **kwargs)

    group_module.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        group_module.foreach_reduce = original


def issuing_frame(frame):
    """The first frame below ``frame`` that is not torch's op plumbing, a mode or nanbisect's
    (the code that issued the op: the user's, a comm hook's, FSDP's)."""
    f = frame
    while f is not None and (_plumbing(f) or f.f_code.co_filename.startswith(_OWN)):
        f = f.f_back
    return f


_OWN = os.path.dirname(os.path.dirname(_HERE)) + os.sep


def reduce_op_name(func, args: tuple, kwargs: dict) -> str | None:
    """The reduction a collective applies ("sum", "avg", "max", ...; None: none or unknown):
    a c10d op's ``ReduceOp`` script object (its ``op()`` is torch's ``RedOpType`` value), a
    functional collective's string. Checked on 2.13.0."""
    import torch.distributed as dist

    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.ScriptObject) and "ReduceOp" in str(v._type()):
            try:
                return dist.ReduceOp.RedOpType(v.op()).name.lower()
            except (RuntimeError, ValueError, TypeError, AttributeError):
                return None
    if func.namespace.endswith("c10d_functional"):
        for v in list(args[1:]) + list(kwargs.values()):
            if isinstance(v, str) and v.lower() in ("sum", "avg", "product", "min", "max",
                                                     "premul_sum"):
                return v.lower()
    return None


# -- modules ------------------------------------------------------------------------------------
def reparametrize_module(module: torch.nn.Module, state: dict):
    """A context manager within which ``module``'s parameters and buffers are ``state``'s.
    ``torch.nn.utils.stateless._reparametrize_module`` (in torch since 2.0): checked on
    2.13.0."""
    from torch.nn.utils.stateless import _reparametrize_module
    return _reparametrize_module(module, state)


# -- foreach kernels ----------------------------------------------------------------------------
def foreach_norm(tensors: list[torch.Tensor], ord: float = 2, dtype=None) -> list[torch.Tensor]:
    """Each tensor's norm, in one kernel launch per device and dtype. ``torch._foreach_norm``
    (its ``dtype`` argument): checked on 2.13.0."""
    if dtype is None:
        return torch._foreach_norm(tensors, ord)
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, in few kernel launches. ``torch._foreach_copy_``:
    checked on 2.13.0."""
    torch._foreach_copy_(dst, src)


# -- the compiler -------------------------------------------------------------------------------
def preload_dynamo() -> None:
    """Import ``torch._dynamo`` now (building an optimizer imports it; a process that forks
    replays imports it once, before forking). Checked on 2.13.0."""
    import torch._dynamo  # noqa: F401


def dynamo_reset() -> None:
    """Forget everything dynamo compiled. ``torch._dynamo.reset``: checked on 2.13.0."""
    import torch._dynamo
    torch._dynamo.reset()


def compiler_bisector():
    """torch's ``CompilerBisector`` (``do_bisect``, ``get_backend``, ``get_subsystem``).
    ``torch._inductor.compiler_bisector``: checked on 2.13.0."""
    from torch._inductor.compiler_bisector import CompilerBisector
    return CompilerBisector


def bisector_config_change(backend: str, subsystem: str | None) -> str | None:
    """"section.field=value" when the bisector's ``subsystem`` of ``backend`` is a config
    change, else None. ``compiler_bisector.BACKENDS`` and ``ConfigChange``: checked on 2.13.0."""
    from torch._inductor.compiler_bisector import BACKENDS, ConfigChange

    sub = next((s for s in BACKENDS.get(backend, []) if s.name == subsystem), None)
    if isinstance(sub, ConfigChange):
        return f"{sub.config_name}.{sub.config_field}={sub.config_value}"
    return None


_OVERLOAD_REPR = re.compile(r"op='([\w.:]+)', overload='(\w+)'")


def op_of(debug_info: str | None) -> str | None:
    """The op a bisector debug info names (a decomposition's), as ``str()`` of the overload;
    read from the ``repr`` of an ``OpOverload`` (``<OpOverload(op='aten.x', overload='y')>``):
    checked on 2.13.0.

    >>> op_of("<OpOverload(op='aten._softmax', overload='default')>")
    'aten._softmax.default'
    >>> op_of("add_2") is None
    True
    """
    m = _OVERLOAD_REPR.search(debug_info or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def set_compile_threads(n: int) -> None:
    """inductor's compile worker count. ``torch._inductor.config.compile_threads``: checked on
    2.13.0."""
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = n


def inductor_cache_dir() -> str:
    """inductor's kernel cache directory. ``torch._inductor.runtime.cache_dir_utils.cache_dir``:
    checked on 2.13.0."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


def dynamo_debug_dir(root: str | None = None) -> str:
    """dynamo's debug directory root (``torch._dynamo.config.debug_dir_root``); with ``root``,
    set it first. Returns the value before. Checked on 2.13.0."""
    import torch._dynamo.config as dynamo_config
    before = dynamo_config.debug_dir_root
    if root is not None:
        dynamo_config.debug_dir_root = root
    return before


def trace_log_handler():
    """The handler of ``TORCH_COMPILE_DEBUG=1``'s structured trace (``root_dir``, ``stream``,
    ``acquire``/``release``), None when torch has none. ``torch._logging._internal.
    LOG_TRACE_HANDLER``: checked on 2.13.0."""
    try:
        from torch._logging import _internal as logging_internal
    except ImportError:
        return None
    return getattr(logging_internal, "LOG_TRACE_HANDLER", None)


def schedule_ends(schedule: Any) -> tuple[bool, bool]:
    """(is the first stage, is the last) of a torch.distributed.pipelining single-stage
    schedule; a multi-stage (interleaved) one: whether any of its stages is. ``_stage``,
    ``_stages``, ``is_first``, ``is_last``: checked on 2.13.0."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    stages = [s for s in stages if s is not None]
    return (any(bool(getattr(s, "is_first", False)) for s in stages),
            any(bool(getattr(s, "is_last", False)) for s in stages))


def compiled_original(model: Any) -> torch.nn.Module | None:
    """The module ``torch.compile(module)`` wrapped, when ``model`` is such an
    ``OptimizedModule``; else None. ``OptimizedModule._orig_mod``: checked on 2.13.0.

    >>> compiled_original(torch.nn.Linear(1, 1)) is None
    True
    """
    if type(model).__name__ != "OptimizedModule":
        return None
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def compiled_backend(model: Any):
    """The backend an ``OptimizedModule`` compiles with (may raise on a torch whose internals
    moved). ``dynamo_ctx.callback`` and ``torch._dynamo.eval_frame.innermost_backend``:
    checked on 2.13.0."""
    from torch._dynamo.eval_frame import innermost_backend
    return innermost_backend(model.dynamo_ctx.callback)


def inductor_mode_options(mode: str) -> dict:
    """The inductor options a ``torch.compile`` ``mode`` stands for.
    ``torch._inductor.list_mode_options``: checked on 2.13.0."""
    from torch._inductor import list_mode_options
    return list_mode_options(mode)


# where ``torch._disable_dynamo``'s wrapper caches the disabled version of its function
DISABLE_CACHE_ATTR = "__dynamo_disable"


def disable_dynamo_decorator():
    """``torch._disable_dynamo`` (via ``torch._compile``), which wraps a function so that dynamo
    never traces it, caching the disabled version as ``fn.__dynamo_disable``; None when torch
    has none. Checked on 2.13.0."""
    return getattr(getattr(torch, "_compile", None), "_disable_dynamo", None)


# -- the Guard's and the step's private torch reads (GradScaler, Module, c10d) --
def scaler_tensors(scaler) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A GradScaler's live (scale, growth tracker) tensors, on the device; (None, None) before
    its first step (it makes them then, from its initial scale). ``GradScaler._scale`` and
    ``._growth_tracker``: checked on 2.13.0."""
    return getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)


def scaler_settings(scaler) -> dict:
    """A GradScaler's constructor settings: ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``init_scale`` (read from its private attributes: its ``state_dict``
    holds the scale, which is read back from the device). Checked on 2.13.0."""
    return {"growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval, "init_scale": scaler._init_scale}


def set_scaler_scale(scaler, scale: torch.Tensor) -> None:
    """Copy ``scale`` into a GradScaler's live scale tensor (nothing before its first step).
    ``GradScaler._scale``: checked on 2.13.0."""
    if getattr(scaler, "_scale", None) is not None:
        scaler._scale.copy_(scale)


def reset_scaler_to_first_step(scaler, scale: torch.Tensor) -> None:
    """Put a GradScaler's live ``scale`` tensor back to its initial scale and its growth tracker
    to 0 (as before its first step). ``GradScaler._init_scale``, ``._growth_tracker``: checked
    on 2.13.0."""
    scale.fill_(scaler._init_scale)
    scaler._growth_tracker.zero_()


def reset_scaler_optimizer_states(scaler) -> None:
    """Forget what a GradScaler recorded of this step's optimizers (``unscale_`` ran: the next
    ``unscale_`` would refuse). ``GradScaler._per_optimizer_states`` and
    ``torch.amp.grad_scaler._refresh_per_optimizer_state``: checked on 2.13.0."""
    if hasattr(scaler, "_per_optimizer_states"):
        from collections import defaultdict

        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def scaler_found_inf_per_device(scaler, optimizer) -> dict:
    """A GradScaler's found-inf flags of ``optimizer``'s gradients, device -> tensor (after
    ``unscale_``). ``GradScaler._found_inf_per_device``: checked on 2.13.0."""
    return scaler._found_inf_per_device(optimizer)


# the Module methods that list its tensors: a class overriding one lists them its own way
_MODULE_WALKS = ("parameters", "named_parameters", "buffers", "named_buffers", "named_modules",
                 "modules", "_named_members")


def lists_tensors_its_own_way(cls: type) -> bool:
    """Does a Module subclass override how its parameters, buffers or submodules are listed
    (``Module._named_members`` included)? Checked on 2.13.0."""
    return any(getattr(cls, m) is not getattr(torch.nn.Module, m) for m in _MODULE_WALKS)


def module_dicts(module: torch.nn.Module) -> tuple[dict, dict, dict]:
    """A module's own (children, parameters, buffers) dicts, name -> value (a value may be
    None), without the walk of ``named_*``. ``Module._modules``, ``._parameters``,
    ``._buffers``: checked on 2.13.0."""
    return module._modules, module._parameters, module._buffers


def world_process_groups() -> list[tuple[Any, str, list[int]]]:
    """The process groups this rank knows of: (group, torch's name for it, its global ranks).
    ``torch.distributed.distributed_c10d._world`` (``pg_names``, ``pg_group_ranks``): checked
    on 2.13.0."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return [(pg, name, sorted(int(g) for g in world.pg_group_ranks.get(pg, {})))
            for pg, name in list(world.pg_names.items())]


def default_store():
    """The default process group's store. ``distributed_c10d._get_default_store``: checked on
    2.13.0."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()
