"""`defer_dynamo`: an eager replay that never compiles does not pay for importing torch._dynamo.

torch wraps a few functions in ``torch._disable_dynamo`` (``torch/_compile.py``): the
optimizer's ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict``, the
``__torch_dispatch__`` of every `TorchDispatchMode` subclass, and the Python references and meta
kernels of ``torch._refs`` and ``torch._prims_common.wrappers``' type promotion (which an op on
``meta`` tensors runs: the remedies' dtype check). The wrapper's first call imports
``torch._dynamo`` (with sympy, torch.fx's symbolic shapes and inductor's registrations: 1.5-3 s
of CPU on the 2-core machine, more than a plain step of bench_culprit's medium GPT) to build
``torch._dynamo.disable(fn)`` and caches it on the wrapped function as ``fn.__dynamo_disable``.
That function only matters while dynamo is compiling a frame; no frame can be compiled before
``torch._dynamo`` is imported. So, while nothing has imported it, `defer_dynamo` puts ``fn``
itself in that cache (the wrapper then calls ``fn`` directly) and takes it out again

* when the block ends, and
* the moment anything starts importing ``torch._dynamo`` (a compiled task's ``torch.compile``,
  a user's own import): an import hook sees the import before it runs; the next call of each
  wrapper then builds torch's own disabled function, exactly as without this module.

NB: this touches torch internals, minimally: the attribute the wrapper itself reads. It applies
only when the wrapper's code is the one this was written against (it reads and writes
``__dynamo_disable`` on its closure's ``fn``: checked on the code object, so another torch's
wrapper is left alone) and ``torch._dynamo`` is not imported yet. The wrappers are found from
the optimizer and dispatch-mode classes and from the functions of torch's reference modules,
following ``__wrapped__`` and closures a few levels down. Wrappers of classes defined inside the
block (a user's own optimizer or dispatch mode), or in a reference module first imported inside
it, are not covered: they import torch._dynamo as usual. Not thread-safe against another thread
compiling at the same time (nanbisect's replay runs on one thread). Fails soft: any error while
finding or patching the wrappers (a torch whose internals differ in a way the checks above do not
see) undoes what was patched and switches the speed-up off for the rest of the process; the block
then runs as without this module.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

from nanbisect.util import torch_internals as ti

_ATTR = ti.DISABLE_CACHE_ATTR
_MODULE = "torch._dynamo"
_off: list[str] = []    # why the speed-up was switched off (empty: it is on)


def _wrapper_code():
    """The code object shared by every ``torch._disable_dynamo`` wrapper, when it follows the
    protocol described above; else None."""
    decorate = ti.disable_dynamo_decorator()
    if decorate is None:
        return None
    code = getattr(decorate(lambda: None), "__code__", None)
    if (code is None or _ATTR not in code.co_consts or _ATTR not in code.co_names
            or "fn" not in code.co_freevars):
        return None
    return code


def _subclasses(cls: type) -> Iterator[type]:
    todo = [cls]
    while todo:
        c = todo.pop()
        yield c
        todo.extend(c.__subclasses__())


# torch's modules of Python references, decompositions and meta kernels, as far as imported
_REFERENCE_MODULES = ("torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations")
_MAX_WRAPS = 6     # a reference is wrapped a few times over (out=, type promotion, the wrapper)


def _closure_fn(wrapper):
    """The function a wrapper reads ``__dynamo_disable`` on: its closure's ``fn`` (its
    ``__wrapped__`` says the same unless another ``functools.wraps`` repointed it, as torch's
    binary references do)."""
    try:
        return wrapper.__closure__[wrapper.__code__.co_freevars.index("fn")].cell_contents
    except (ValueError, IndexError, TypeError):
        return None


def _under(value, code, seen: set) -> Iterator:
    """The functions under a wrapper of ``code`` inside ``value``: the wrappers are found
    through each function's ``__wrapped__`` and the functions its closure holds (torch's
    references end in ``functools.wraps(prim)``, which points ``__wrapped__`` past them).
    ``seen`` (ids of what was walked, shared across calls) keeps each function walked once."""
    todo = [value]
    for _ in range(_MAX_WRAPS):
        step = []
        for v in todo:
            if not callable(v) or id(v) in seen:
                continue
            seen.add(id(v))
            if getattr(v, "__code__", None) is code:
                fn = _closure_fn(v)
                if fn is not None:
                    yield fn
            step.append(getattr(v, "__wrapped__", None))
            for cell in getattr(v, "__closure__", None) or ():
                with contextlib.suppress(ValueError):       # an empty cell
                    step.append(cell.cell_contents)
        todo = step
        if not todo:
            return


def _under_wrappers(code) -> list:
    """Every function under a wrapper of ``code`` on the optimizers' and the dispatch modes'
    classes defined so far and in torch's reference modules imported so far, cached or not."""
    values = [v for base in (torch.optim.Optimizer, ti.TorchDispatchMode)
              for cls in _subclasses(base) for v in vars(cls).values()]
    values += [v for name, module in list(sys.modules.items())
               if name.startswith(_REFERENCE_MODULES) and module is not None
               for v in list(vars(module).values())]
    seen: set = set()
    return [fn for value in values for fn in _under(value, code, seen)]


def _wrapped_functions(code) -> list:
    """The functions under a ``torch._disable_dynamo`` wrapper (`_under_wrappers`) that have
    no disabled version cached yet."""
    out, seen = [], set()
    for fn in _under_wrappers(code):
        if id(fn) not in seen and _ATTR not in vars(fn):
            seen.add(id(fn))
            out.append(fn)
    return out


class _Watch:
    """A `sys.meta_path` entry that undoes the cache entries when torch._dynamo is imported."""

    def __init__(self, patched: list) -> None:
        self.patched = patched

    def undo(self) -> None:
        for fn in self.patched:
            if vars(fn).get(_ATTR) is fn:
                delattr(fn, _ATTR)
        self.patched = []

    def find_spec(self, name, path=None, target=None):
        if name == _MODULE:
            self.undo()
        return None     # never finds anything: the import goes on as usual


@contextlib.contextmanager
def defer_dynamo() -> Iterator[None]:
    """Within the block, torch's ``_disable_dynamo`` wrappers on optimizers and dispatch modes
    call their function directly until something imports torch._dynamo (see the module).

    >>> import sys, torch
    >>> with defer_dynamo():
    ...     opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ...     opt.zero_grad()
    >>> "torch._dynamo" in sys.modules or not hasattr(opt.zero_grad.__wrapped__,
    ...                                               "__dynamo_disable")
    True
    """
    fns = None
    if not _off and _MODULE not in sys.modules:
        try:
            code = _wrapper_code()
            fns = _wrapped_functions(code) if code is not None else None
        except Exception as e:  # noqa: BLE001 - a speed-up never fails the run
            _off.append(f"{type(e).__name__}: {e}")
    if not fns:
        yield
        return
    with _deferred(fns):
        yield


@contextlib.contextmanager
def _deferred(fns: list) -> Iterator[_Watch]:
    """``fns`` (functions under a wrapper) cached as their own disabled version until the block
    ends or torch._dynamo starts being imported. A function that refuses the attribute undoes
    the others and switches the speed-up off (`_off`): the block runs unpatched."""
    watch = _Watch([])
    try:
        for fn in fns:
            setattr(fn, _ATTR, fn)
            watch.patched.append(fn)
    except Exception as e:  # noqa: BLE001 - a speed-up never fails the run
        watch.undo()
        _off.append(f"{type(e).__name__}: {e}")
        yield watch
        return
    sys.meta_path.insert(0, watch)
    try:
        yield watch
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(watch)
        watch.undo()
