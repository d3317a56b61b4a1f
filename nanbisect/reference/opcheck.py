"""Isolate one op: re-execute it on the reference with the target's own inputs and compare.

Accumulated rounding is never blamed on an op: each op is judged from the *same* inputs on both
sides, at the same dtype (moved to the reference device), against a float64 ground truth of those
inputs (see `compare.compare_op`); a complex output is compared by its real and imaginary parts
(``torch.view_as_real``), at the tolerance of their real dtype. An op the reference device has no
kernel for runs through `registry.reference_impl` when one is registered; otherwise it is
``uncomparable`` and reported as such, never taken as correct. Random ops and ops that return
uninitialised memory cannot be compared value by value and are ``skipped``.
"""
from __future__ import annotations

from typing import Any

import torch

from nanbisect import devices
from nanbisect.reference import kernels as registry
from nanbisect.records import OpCheck
from nanbisect.reference.compare import compare_op
from nanbisect.replay.recorder import is_collective, tensor_args, written_tensors
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import cast_floating, floating, parts

RANDOM_OR_UNINITIALISED = {
    "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_",
    "multinomial", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "rrelu_with_noise", "_fused_dropout", "random_", "cauchy_", "geometric_", "log_normal_"}


def resolve(op: str):
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def move(obj: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Copy tensors to ``device`` (floating ones cast to ``dtype`` when given, complex ones to
    the complex dtype of that precision: `nanbisect.util.tensors.cast_floating`)."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return cast_floating(x.detach().to(device=device, copy=True), dtype)
        if isinstance(x, torch.device):
            return device
        return x
    return ti.tree_map(one, obj)


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
             ref_device: torch.device) -> OpCheck:
    """Judge ``op`` given the target's inputs ``args``/``kwargs`` and its outputs ``target_out``
    (the tensors it returned and wrote, in `written_tensors` order).

    NB: the reference runs the op at the *target's* dtype, whatever dtype the reference replay
    used: only the same inputs at the same dtype tell a wrong kernel from arithmetic that fails
    at that dtype on any device (an fp32 underflow is not the device's fault because float64 does
    not underflow). A float64 run of the same inputs is the ground truth the error is measured
    against.

    >>> x = [torch.tensor([4.0, -1.0])]
    >>> check_op("aten.sqrt.default", 0, x, {}, [torch.sqrt(x[0])], torch.device("cpu")).status
    'ok'
    >>> wrong = torch.tensor([2.5, float("nan")])       # sqrt(4) is not 2.5
    >>> check_op("aten.sqrt.default", 0, x, {}, [wrong], torch.device("cpu")).status
    'mismatch'
    """
    if op.split(".")[1] in RANDOM_OR_UNINITIALISED:
        return OpCheck(op, index, "skipped", detail="random or uninitialised output")
    if is_collective(op):
        # re-run alone it would wait for peers that are not running it (a hang in lockstep)
        return OpCheck(op, index, "skipped", detail="a collective: its result depends on the "
                       "other ranks' inputs, it cannot be re-run alone")
    r_args, r_kwargs = move(args, ref_device), move(kwargs, ref_device)
    try:
        ref_out, how = _call(op, r_args, r_kwargs)
    except LookupError as e:
        return OpCheck(op, index, "uncomparable", detail=str(e))
    ref_w = _written(op, ref_out, r_args, r_kwargs, how)
    e_args, e_kwargs = move(args, ref_device, torch.float64), move(kwargs, ref_device,
                                                                   torch.float64)
    try:
        truth, how_e = _call(op, e_args, e_kwargs)
        truth_w = _written(op, truth, e_args, e_kwargs, how_e)
    except (LookupError, RuntimeError, TypeError):
        truth_w = ref_w  # the op has no float64 path: judge against the reference itself
    comps = []
    for t, r, e in zip(target_out, ref_w, truth_w):
        if not (isinstance(t, torch.Tensor) and floating(t)):
            continue
        same = r.dtype == t.dtype
        # a complex output is compared by its real view: part by part, at its parts' tolerance
        t, r, e = parts(t), parts(r), parts(e)
        comps.append(compare_op(t, r if same else None, e, t.dtype))
    status = "ok" if all(c.ok for c in comps) else "mismatch"
    return OpCheck(op, index, status, how, comps)


def check_caught(caught, index: int, device: torch.device, ref_device: torch.device,
                 wrap=None) -> OpCheck:
    """Run a caught op (`nanbisect.records.Caught`) on the target ``device`` under ``wrap()``
    (the injected context, when there is one) and judge it on ``ref_device`` from the same
    inputs."""
    from contextlib import nullcontext

    args, kwargs = move(caught.args, device), move(caught.kwargs, device)
    with (wrap or nullcontext)():
        out = resolve(caught.op)(*args, **kwargs)
    returned, mutated = written_tensors(resolve(caught.op), out, tuple(args), kwargs)
    target_out = [t.detach().to(devices.HOST) for t, _ in tensor_args(returned + mutated)]
    return check_op(caught.op, index, caught.args, caught.kwargs, target_out, ref_device)


def safe_check(caught, index: int, device: torch.device, ref_device: torch.device,
               wrap=None) -> OpCheck:
    """`check_caught`, with any failure of the re-run reported as ``uncomparable`` (a missing
    kernel, an op that needs state the caught inputs lack) instead of ending the replay."""
    if is_collective(caught.op):
        return OpCheck(caught.op, index, "skipped", detail="a collective: it cannot be re-run "
                       "alone")
    try:
        return check_caught(caught, index, device, ref_device, wrap)
    except Exception as e:  # noqa: BLE001 - the evidence is missing, the run goes on
        return OpCheck(caught.op, index, "uncomparable",
                       detail=f"re-running it raised {type(e).__name__}: {str(e)[:160]}")
