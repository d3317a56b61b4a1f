"""Part of the step computed in a wider dtype: one op at dispatch level (`UpcastOp`), or one module
call from its inputs to its outputs (`upcast_module`).

`UpcastOp` runs the op at one site (op, phase, occurrence, as `nanbisect.locate` names it) on
copies of its floating inputs in the wider dtype and casts its results back to the dtypes the op
gives at the original ones (an in-place op writes its wider result back into its own
arguments), so autograd and every later op see what they expect: only that op's arithmetic
changes. A result that does not fit the narrow dtype (exp(12) in float16) is inf again after
the cast back: computing one op wider helps only where its own arithmetic overflows or loses
the value. `upcast_module` keeps the values inside one module call wide (its inputs, parameters
and buffers cast with differentiable casts, its outputs cast back, and the module's own casts to
a narrower floating dtype, ``x.half()`` or ``x.to(torch.float16)``, kept wide: `KeepWide`), so a
float16 range problem inside the module goes away there when it is one, and backward flows
through the casts.

Not changed: ops outside the site or the module call; a module call's in-place updates of its
buffers (running statistics) go to the wide copies and are dropped.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from nanbisect import devices
from nanbisect.records import OpSite
from nanbisect.replay.recorder import SKIP
from nanbisect.util import torch_internals as ti

# the dtype one step wider than the widest floating input
WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
         torch.float32: torch.float64}


def wider(dtype_names: list[str]) -> tuple[torch.dtype, torch.dtype] | None:
    """(the widest floating dtype among ``dtype_names``, the dtype to compute in instead);
    None when there is no floating one, or it is already float64.

    >>> wider(["float16", "int64"]), wider(["float64"])
    ((torch.float16, torch.float32), None)
    """
    floats = [getattr(torch, n) for n in dtype_names
              if isinstance(getattr(torch, n, None), torch.dtype)
              and getattr(torch, n).is_floating_point]
    if not floats:
        return None
    narrow = max(floats, key=lambda d: d.itemsize)
    return (narrow, WIDER[narrow]) if narrow in WIDER else None


def _up(wide: torch.dtype | None, device: torch.device | None = None):
    """A tensor's copy in ``wide`` (floating ones narrower than it) and on ``device``; other
    values, and tensors neither changes, as they are."""
    def cast(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtype = wide if wide is not None and x.is_floating_point() and \
            x.dtype.itemsize < wide.itemsize else None
        if dtype is None and (device is None or x.device == device):
            return x
        return x.to(device=device if device is not None else x.device, dtype=dtype)
    return cast


def _leaves(x: Any) -> list:
    return ti.tree_leaves(x)


def widened(func, args: tuple, kwargs: dict, wide: torch.dtype | None,
            device: torch.device | None = None, kernel: Callable | None = None) -> Any:
    """``func(*args, **kwargs)`` computed with its floating inputs in ``wide`` (None: as they
    are) and, with ``device``, on that device (``kernel``: what runs instead of ``func`` there),
    its results in the dtypes it gives at the original ones, on the inputs' device; arguments it
    writes get the result.

    >>> x = torch.tensor([300.0], dtype=torch.float16)
    >>> widened(torch.ops.aten.linalg_vector_norm.default, (x,), {}, torch.float32).dtype
    torch.float16
    """
    cast = _up(wide, device)
    # where the results go back to: the op's device (an accelerator's, where a host scalar
    # tensor comes along), else the host
    placed = [t.device for t in _leaves((list(args), dict(kwargs))) if isinstance(t, torch.Tensor)]
    home = next((d for d in placed if not devices.on_host(d)), placed[0] if placed else None)
    wargs = ti.tree_map(cast, list(args))
    wkwargs = ti.tree_map(cast, dict(kwargs))
    result = (kernel or func)(*wargs, **wkwargs)
    schema = ti.schema_arguments(func)
    for i, a in enumerate(schema):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        orig = args[i] if i < len(args) else kwargs.get(a.name)
        new = wargs[i] if i < len(args) else wkwargs.get(a.name)
        for o, w in zip(_leaves(orig), _leaves(new)):
            if isinstance(o, torch.Tensor) and o is not w:
                if o.shape != w.shape:        # an out= argument the op resized
                    o.resize_(w.shape)
                o.copy_(w)
    same = {id(w): o for o, w in zip(_leaves((list(args), dict(kwargs))),
                                     _leaves((wargs, wkwargs))) if isinstance(o, torch.Tensor)}
    try:
        with ti.disable_current_modes():
            meta = ti.tree_map(
                lambda x: x.to(devices.SHAPES) if isinstance(x, torch.Tensor) else x, (list(args),
                                                                                dict(kwargs)))
            dtypes = [t.dtype if isinstance(t, torch.Tensor) else None
                      for t in _leaves(func(*meta[0], **meta[1]))]
    except Exception:  # noqa: BLE001 - no meta kernel: the narrowest floating input's dtype
        narrow = next((t.dtype for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                       and t.is_floating_point()), None)
        dtypes = [narrow] * len(_leaves(result))
    flat, spec = ti.tree_flatten(result)
    out = []
    for v, dt in zip(flat, dtypes + [None] * (len(flat) - len(dtypes))):
        if isinstance(v, torch.Tensor) and id(v) in same:
            out.append(same[id(v)])
        elif isinstance(v, torch.Tensor) and ((dt is not None and v.dtype != dt) or (
                home is not None and v.device != home)):
            out.append(v.to(device=home, dtype=dt))
        else:
            out.append(v)
    return ti.tree_unflatten(out, spec)


class AtSite(ti.ObserverMode):
    """A mode that changes how one op runs: the ``site.occurrence``-th call of ``site.op`` in
    ``site.phase`` (once; ``hit`` then), its `run` given by the subclass; set ``.phase`` as the
    step moves on."""

    def __init__(self, site: OpSite) -> None:
        super().__init__()
        self.site = site
        self.phase = "forward"
        self.seen = 0
        self.hit = False

    def wants(self, func) -> bool:
        return not self.hit and func not in SKIP and self.phase == self.site.phase

    def before(self, call: ti.OpCall) -> bool:
        """The site's occurrence of its op (once): `run` runs it the subclass's way."""
        if call.name != self.site.op:
            return False
        if self.seen != self.site.occurrence:
            self.seen += 1
            return False
        self.hit = True
        return True


class UpcastOp(AtSite):
    """Compute the op at ``site`` in ``wide`` (`widened`); set ``.phase`` as the step moves on.

    >>> mode = UpcastOp(OpSite("aten.exp.default", "forward", 1), torch.float32)
    >>> x = torch.tensor([12.0], dtype=torch.float16)
    >>> with mode:
    ...     a, b = x.exp(), (x - 11).exp()    # the second exp is computed in float32
    >>> mode.hit, a.item(), round(b.item(), 2)
    (True, inf, 2.72)
    """

    def __init__(self, site: OpSite, wide: torch.dtype) -> None:
        super().__init__(site)
        self.wide = wide

    def run(self, call: ti.OpCall):
        return widened(call.func, call.args, call.kwargs, self.wide)


_NARROWING = {torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16}
_CASTS = {torch.Tensor.to, torch.Tensor.type}


class KeepWide(TorchFunctionMode):
    """Within the block, a cast of a ``wide`` tensor to a narrower floating dtype (``.half()``,
    ``.bfloat16()``, ``.to(torch.float16)``, ``.type(torch.float16)``) keeps it ``wide``: a
    module that casts explicitly still computes wide under `upcast_module`.

    >>> x = torch.ones(2)
    >>> with KeepWide(torch.float32):
    ...     a, b = x.half(), x.to(torch.float16)
    >>> a.dtype, b.dtype
    (torch.float32, torch.float32)
    """

    def __init__(self, wide: torch.dtype) -> None:
        super().__init__()
        self.wide = wide

    def _keep(self, a: Any) -> Any:
        if isinstance(a, torch.dtype) and a.is_floating_point and \
                a.itemsize < self.wide.itemsize:
            return self.wide
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        wide_in = isinstance(first, torch.Tensor) and first.dtype == self.wide
        if wide_in and func in _NARROWING:
            return first
        if wide_in and func in _CASTS:
            args = (first, *(self._keep(a) for a in args[1:]))
            kwargs = {k: self._keep(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextmanager
def upcast_module(model: torch.nn.Module, name: str, call: int | None,
                  wide: torch.dtype) -> Iterator[list[int]]:
    """Within the block, call ``call`` of module ``name`` (every call with None) runs in
    ``wide``: inputs, parameters and buffers cast (differentiably) on the way in, outputs cast
    back to the module's dtype on the way out. Yields the list of call indices it widened.

    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2)).half()
    >>> with upcast_module(m, "0", 0, torch.float32) as done:
    ...     y = m(torch.ones(1, 2, dtype=torch.float16))
    >>> done, y.dtype, m[0].weight.dtype
    ([0], torch.float16, torch.float16)
    """
    module = model.get_submodule(name) if name else model
    count, frames, done = [0], [], []    # frames: one per running call (None: not widened)
    cast = _up(wide)

    def pre(mod, args, kwargs):
        k = count[0]
        count[0] += 1
        if call is not None and k != call:
            frames.append(None)
            return None
        floats = [t.dtype for t in _leaves((args, kwargs, list(mod.parameters())))
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        narrow = min(floats, key=lambda d: d.itemsize) if floats else wide
        state = {n: cast(t) for n, t in [*mod.named_parameters(), *mod.named_buffers()]}
        ctx = ti.reparametrize_module(mod, state)
        ctx.__enter__()
        keep = KeepWide(wide)
        keep.__enter__()
        frames.append((ctx, narrow, keep))
        done.append(k)
        return (ti.tree_map(cast, tuple(args)), ti.tree_map(cast, dict(kwargs)))

    def post(mod, args, kwargs, output):
        frame = frames.pop() if frames else None
        if frame is None:
            return None
        ctx, narrow, keep = frame
        keep.__exit__(None, None, None)
        ctx.__exit__(None, None, None)
        return ti.tree_map(
            lambda t: t.to(narrow) if isinstance(t, torch.Tensor) and t.dtype == wide
            and narrow != wide else t, output)

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
               module.register_forward_hook(post, with_kwargs=True, always_call=True)]
    try:
        yield done
    finally:
        for h in handles:
            h.remove()
        for frame in reversed(frames):
            if frame is not None:
                frame[2].__exit__(None, None, None)
                frame[0].__exit__(None, None, None)
