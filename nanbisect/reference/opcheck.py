"""Isolate one op: re-execute it on the reference with the target's own inputs and compare.

Accumulated rounding is never blamed on an op: each op is judged from the *same* inputs on both
sides (moved to the reference device, upcast when the reference asks for a wider dtype), against a
float64 ground truth of those inputs (see `compare.compare_op`). An op the reference device has no
kernel for runs through `registry.reference_impl` when one is registered; otherwise it is
``uncomparable`` and reported as such, never taken as correct. Random ops and ops that return
uninitialised memory cannot be compared value by value and are ``skipped``.
"""
from __future__ import annotations

from typing import Any

import torch

from nanbisect.reference import kernels as registry
from nanbisect.records import OpCheck
from nanbisect.reference.compare import compare_op
from nanbisect.replay.recorder import tensor_args, written_tensors

RANDOM_OR_UNINITIALISED = {
    "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_",
    "multinomial", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "rrelu_with_noise", "_fused_dropout", "random_", "cauchy_", "geometric_", "log_normal_"}


def resolve(op: str):
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def move(obj: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Copy tensors to ``device`` (floating ones cast to ``dtype`` when given)."""
    def one(x):
        if isinstance(x, torch.Tensor):
            cast = dtype if dtype is not None and x.is_floating_point() else None
            return x.detach().to(device=device, dtype=cast, copy=True)
        if isinstance(x, torch.device):
            return device
        return x
    return torch.utils._pytree.tree_map(one, obj)


def _call(op: str, args: list, kwargs: dict) -> tuple[Any, str]:
    """Run ``op`` with its kernel, else with a registered reference implementation."""
    try:
        return resolve(op)(*args, **kwargs), "kernel"
    except (NotImplementedError, RuntimeError) as e:
        impl = registry.lookup(op)
        if impl is None:
            raise LookupError(f"no reference kernel and no registered reference_impl: "
                              f"{str(e).splitlines()[0][:160]}") from None
        return impl(*args, **kwargs), "registered"


def _written(op: str, out: Any, args: list, kwargs: dict, how: str) -> list[torch.Tensor]:
    """What the call returned and wrote; a registered implementation only returns."""
    if how != "kernel":
        return [t for t, _ in tensor_args(list(out) if isinstance(out, tuple) else [out])]
    returned, mutated = written_tensors(resolve(op), out, tuple(args), kwargs)
    return [t for t, _ in tensor_args(returned + mutated)]


def check_op(op: str, index: int, args: list, kwargs: dict, target_out: list[torch.Tensor],
             ref_device: torch.device, ref_dtype: torch.dtype | None) -> OpCheck:
    """Judge ``op`` given the target's inputs ``args``/``kwargs`` and its outputs ``target_out``
    (the tensors it returned and wrote, in `written_tensors` order)."""
    if op.split(".")[1] in RANDOM_OR_UNINITIALISED:
        return OpCheck(op, index, "skipped", detail="random or uninitialised output")
    r_args, r_kwargs = move(args, ref_device, ref_dtype), move(kwargs, ref_device, ref_dtype)
    try:
        ref_out, how = _call(op, r_args, r_kwargs)
    except LookupError as e:
        return OpCheck(op, index, "uncomparable", detail=str(e))
    ref_w = _written(op, ref_out, r_args, r_kwargs, how)
    truth_w = ref_w
    if ref_dtype != torch.float64:
        e_args, e_kwargs = move(args, ref_device, torch.float64), move(kwargs, ref_device,
                                                                       torch.float64)
        try:
            truth, how_e = _call(op, e_args, e_kwargs)
            truth_w = _written(op, truth, e_args, e_kwargs, how_e)
        except (LookupError, RuntimeError, TypeError):
            truth_w = ref_w  # the op has no float64 path: judge against the reference itself
    comps = []
    for t, r, e in zip(target_out, ref_w, truth_w):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            continue
        same_dtype = r.dtype == t.dtype and truth_w is not ref_w
        comps.append(compare_op(t, r if same_dtype else None, e, t.dtype))
    status = "ok" if all(c.ok for c in comps) else "mismatch"
    return OpCheck(op, index, status, how, comps)
