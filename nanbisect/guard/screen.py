"""A Guard's screen of a step and the exact check behind it.

Guarantees: the screen (`tensor_norms`, `screen_sum`, `step_norms`) is device ops only, one
float32 norm per tensor, so a healthy step costs no host synchronisation here; it is non-finite
iff some element is, or the sum of squares overflows float32 (the exact check then clears it).
The exact check (`bad_names`) names every tensor holding a NaN (else an inf); `observed` lists
at most `LISTED` names per kind, with the full counts (`listed_names`).
"""
from __future__ import annotations

import torch

from nanbisect.bundle.state import local
from nanbisect.util.torch_internals import foreach_norm

LISTED = 20     # names listed per kind in `observed`; the counts say how many there were
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def local_each(tensors) -> list[torch.Tensor]:
    """`local` of each tensor (a plain tensor or parameter is itself: no call for it)."""
    return [t if type(t) in PLAIN_TENSORS else local(t) for t in tensors]


def tensor_norms(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The float32 L2 norm of each tensor (0 for None), on ``device``: non-finite iff some element
    is (or the sum of squares overflows float32: an exact check then clears it)."""
    if not tensors:
        return torch.zeros(0, device=device)
    ts = [local(t) for t in tensors if t is not None]
    if len(ts) == len(tensors) and all(t.device == device for t in ts):
        try:
            return torch.stack(foreach_norm(ts, 2, dtype=torch.float32))
        except (RuntimeError, TypeError):   # a dtype foreach has no kernel for: one at a time
            pass
    zero = torch.zeros((), device=device)
    return torch.stack([torch.linalg.vector_norm(local(t).detach().abs().float()).to(device)
                        if t is not None else zero for t in tensors])


@torch.no_grad()
def step_norms(params: list[torch.Tensor], grads: list[torch.Tensor | None],
                device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """[2, P]: each parameter's float32 L2 norm (row 0) and its gradient's (row 1; 0 for None),
    from one pass over both (one foreach call where the tensors allow): `tensor_norms`' rules.
    ``out``: a contiguous float32 [2, P] to write them into (the history's ring row), returned."""
    return step_and_buffer_norms(params, grads, [], device, out)[0]


@torch.no_grad()
def step_and_buffer_norms(params: list[torch.Tensor], grads: list[torch.Tensor | None],
                          buffers: list[torch.Tensor], device: torch.device,
                          out: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`step_norms`, and the buffers' NaN flag ([1]: NaN when some element of ``buffers`` is
    NaN, else 0; None without buffers) from the same foreach call. Only NaN: a buffer may hold
    inf by design (an attention mask of -inf, an observer's running minimum of +inf)."""
    n = len(params)
    bufs = local_each(buffers)
    if not n:
        return (torch.zeros(2, 0, device=device) if out is None else out), (
            _nan_flag(tensor_norms(bufs, device)) if bufs else None)
    ps = local_each(params)
    gs = local_each(g for g in grads if g is not None)
    if len(gs) < n:
        zero = torch.zeros(1, dtype=(gs or ps)[0].dtype, device=device)
        gs = [g if g is not None else zero for g in local_each(grads)]
    both = ps + gs
    every = both + bufs
    try:
        # all on one device, each dtype with a kernel: one call (else an error, below); float32
        # tensors without the dtype argument (it costs them a fifth more: docs/BENCHMARKS.md)
        norms = foreach_norm(every, 2) if all(t.dtype == torch.float32 for t in every) \
            else foreach_norm(every, 2, dtype=torch.float32)
    except (RuntimeError, TypeError):   # another device, a dtype foreach has no kernel for
        both = torch.stack([tensor_norms(ps, device), tensor_norms(gs, device)])
        extra = _nan_flag(tensor_norms(bufs, device)) if bufs else None
        return (both if out is None else out.copy_(both)), extra
    extra = _nan_flag(torch.stack(norms[2 * n:])) if bufs else None
    if out is None:
        return torch.stack(norms[:2 * n]).view(2, n), extra
    torch.stack(norms[:2 * n], out=out.view(2 * n))
    return out, extra


def _nan_flag(norms: torch.Tensor) -> torch.Tensor:
    """[1]: NaN when some of ``norms`` is NaN (a NaN element; an inf one gives inf), else 0."""
    return torch.zeros(1, device=norms.device).masked_fill(norms.isnan().any(), float("nan"))


def screen_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The screen of a step: the sum of the parameters' norms (`tensor_norms`), non-finite iff some
    element is."""
    return tensor_norms(tensors, device).sum()


def bad_names(named: list[tuple[str, torch.Tensor]]) -> dict:
    # NB: not util.tensors' counts: a name is bad or not, and .any() is all it needs
    out = {"nan": [], "inf": []}
    for name, t in named:
        t = local(t)
        if torch.isnan(t).any():
            out["nan"].append(name)
        elif torch.isinf(t).any():
            out["inf"].append(name)
    return out


def any_nonfinite(tensors) -> bool:
    """Does one of ``tensors`` (None ones skipped) hold a NaN or an inf? The exact check behind a
    tripped screen (whose sum of squares can overflow on finite values)."""
    return any(t is not None and not bool(torch.isfinite(local(t)).all()) for t in tensors)


def value_kind(x: float) -> str:
    return "nan" if x != x else ("inf" if abs(x) == float("inf") else "finite")


def listed_names(names: dict) -> dict:
    """Names per kind, at most `LISTED` each, with the full counts."""
    return {**{k: v[:LISTED] for k, v in names.items()},
            **{f"{k}_count": len(v) for k, v in names.items()}}

