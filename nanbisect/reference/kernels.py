"""Reference implementations for ops the reference device has no kernel for.

Device-only fused ops (``torch_npu`` kernels, vendor custom ops) cannot run on the CPU reference.
Register a plain-PyTorch implementation so such an op can still be isolated and compared:

>>> import nanbisect
>>> @nanbisect.reference_impl("npu::npu_fused_unpermute")
... def unpermute(expert_out, probs):
...     return expert_out * probs[:, None]
>>> lookup("npu.npu_fused_unpermute.default") is unpermute
True

Packages can also publish implementations through the entry point group
``nanbisect.reference_impls`` (each entry point loads a module that registers them on import),
and ``NANBISECT_REFERENCE_IMPLS`` can name Python files that do (separated by ``os.pathsep``).
An op with neither a kernel on the reference device nor a registered implementation is reported
as ``uncomparable``, never silently treated as correct.
"""
from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

_IMPLS: dict[str, Callable] = {}
_loaded_entry_points = False


def _canonical(name: str) -> str:
    """'ns::op' or 'ns.op' or 'ns.op.overload' -> 'ns::op' (overloads share an implementation)."""
    if "::" in name:
        ns, _, rest = name.partition("::")
        return f"{ns}::{rest.split('.')[0]}"
    parts = name.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else name


def reference_impl(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the reference implementation of op ``namespace::op``."""
    def register(fn: Callable) -> Callable:
        _IMPLS[_canonical(name)] = fn
        return fn
    return register


def lookup(op: str) -> Callable | None:
    """The registered implementation for an op name such as 'npu.fused.default', if any."""
    load_plugins()
    return _IMPLS.get(_canonical(op))


def kernel_or_registered(func, name: str, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """``(func(*args, **kwargs), False)``; where this device has no kernel for the op
    (``NotImplementedError``, "Could not run"), ``(its registered implementation's result,
    True)``; the error again when none is registered.

    >>> kernel_or_registered(lambda x: x + 1, "aten.add.Tensor", (1,), {})
    (2, False)
    """
    try:
        return func(*args, **kwargs), False
    except (NotImplementedError, RuntimeError) as e:
        no_kernel = isinstance(e, NotImplementedError) or "Could not run" in str(e)
        impl = lookup(name) if no_kernel else None
        if impl is None:
            raise
        return impl(*args, **kwargs), True


def load_plugins() -> None:
    """Import the entry points and NANBISECT_REFERENCE_IMPLS files once per process."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for ep in entry_points(group="nanbisect.reference_impls"):
        ep.load()
    from nanbisect.task import import_target

    for f in filter(None, os.environ.get("NANBISECT_REFERENCE_IMPLS", "").split(os.pathsep)):
        import_target(str(Path(f)))
