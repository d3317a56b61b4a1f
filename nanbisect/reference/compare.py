"""Compare a target tensor with a reference, dtype-aware, the way accuracy checkers do.

Pure functions; a failed comparison is data (`Comparison`) until `Comparison.message` turns it
into text. Two levels of strictness:

* **Op level** (`compare_op`): an op is judged from the *same inputs* on both sides, against a
  float64 ground truth computed from those inputs. The target may be as far from the truth as the
  reference device is (twice that, to absorb a different accumulation order), plus the dtype's
  tolerance from `OP_TOL`. It fails when it produces NaN/inf where the truth is finite, or when
  more than `MAX_SHARE` of its elements are off, or when any element is off by more than
  `GROSS` times its bound.
* **Step level** (`compare_step`): loss, gradients and updated parameters after a whole step have
  accumulated rounding from thousands of ops, so they are judged by relative L2 error against
  `STEP_RTOL`, which only flags real divergence.

Tolerance table (``rtol``, ``atol`` per element at op level; relative L2 at step level):

| dtype    | op rtol | op atol | step rel-L2 | why |
|----------|---------|---------|-------------|-----|
| float64  | 1e-7    | 1e-7    | 1e-6        | ~1e9 ulps of headroom over eps 2.2e-16: only real errors |
| float32  | 1.3e-6  | 1e-5    | 1e-3        | torch.testing's defaults (~10 ulps); a step accumulates far more |
| float16  | 1e-3    | 1e-5    | 2e-2        | eps 9.8e-4: one ulp relative |
| bfloat16 | 1.6e-2  | 1e-5    | 5e-2        | eps 7.8e-3: two ulps relative |

Not guaranteed: detecting an error smaller than the reference device's own error against float64.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from nanbisect import devices
from nanbisect.records import Comparison
from nanbisect.util.tensors import parts

OP_TOL = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5),
          torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
STEP_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
MAX_SHARE = 1e-3   # more than 0.1% of elements off fails
GROSS = 10.0       # one element off by 10x its bound fails
# msprobe-style share thresholds for the report: relative error beyond these counts as "off"
SHARE_REL = {torch.float32: 1e-3, torch.float64: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def op_tol(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of ``dtype`` (a complex dtype: its parts')."""
    return OP_TOL.get(dtype.to_real(), (0.0, 0.0))


def step_rtol(dtype: torch.dtype) -> float:
    """The step-level relative L2 tolerance of ``dtype`` (a complex dtype: its parts').

    >>> step_rtol(torch.complex64) == step_rtol(torch.float32)
    True
    """
    return STEP_RTOL.get(dtype.to_real(), 0.0)


def _summary(t: torch.Tensor, e: torch.Tensor, off: torch.Tensor, dtype: torch.dtype,
             reason: str = "") -> Comparison:
    """Numbers for the report; ``t``/``e`` float64 on one device, ``off`` the failing mask."""
    numel = t.numel()
    both = torch.isfinite(t) & torch.isfinite(e)
    new_bad = ~torch.isfinite(t) & torch.isfinite(e)
    diff = torch.where(both, (t - e).abs(), torch.zeros_like(t))
    diff = torch.where(new_bad, torch.full_like(t, math.inf), diff)
    rel = torch.where(both, diff, 0.0) / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    nonfinite_new = int(new_bad.sum())
    worst = int(torch.argmax(torch.where(off, diff + 1.0, diff))) if numel else 0
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), t.shape)) if numel else None
    tf, ef = torch.where(both, t, 0).flatten(), torch.where(both, e, 0).flatten()
    denom = float(tf.norm() * ef.norm())
    cosine = (math.nan if not bool(both.any()) else float(tf @ ef) / denom if denom > 0
              else 1.0 if float(tf.norm()) == float(ef.norm()) == 0 else 0.0)
    share = float((rel > SHARE_REL.get(dtype, 1e-3)).float().mean()) if numel else 0.0
    return Comparison(ok=not bool(off.any()) if reason == "" else False, numel=numel,
                      mismatched=int(off.sum()), worst_abs=float(diff.flatten()[worst]) if numel
                      else 0.0, worst_index=idx, worst_target=float(t.flatten()[worst]) if numel
                      else None, worst_expected=float(e.flatten()[worst]) if numel else None,
                      max_rel=float(rel.max()) if numel else 0.0, cosine=cosine,
                      share_off=share, nonfinite_new=nonfinite_new, reason=reason)


def compare_op(target: torch.Tensor, reference: torch.Tensor | None, truth: torch.Tensor,
               dtype: torch.dtype) -> Comparison:
    """Judge one op output of the target against the float64 ``truth`` of the same inputs.

    ``reference`` is the reference device's output in the target's dtype (None when the
    reference computed only in float64); its error against the truth widens the bound.
    """
    dev = truth.device
    t = target.detach().to(dev, torch.float64)
    e = truth.detach().to(torch.float64)
    if t.shape != e.shape:
        return Comparison(False, t.numel(), t.numel(), math.inf, None, None, None, math.inf, 0.0,
                          1.0, reason=f"shape {tuple(t.shape)} vs expected {tuple(e.shape)}")
    rtol, atol = op_tol(dtype)
    bound = atol + rtol * e.abs()
    if reference is not None:
        r = reference.detach().to(dev, torch.float64)
        ref_err = torch.where(torch.isfinite(r) & torch.isfinite(e), (r - e).abs(), 0.0)
        bound = bound + 2.0 * ref_err
    finite_e = torch.isfinite(e)
    same_nonfinite = ~finite_e & ((t == e) | (torch.isnan(t) & torch.isnan(e)))
    if reference is not None:
        # the reference at the target's dtype made the same inf or NaN from the same inputs:
        # that is the dtype's arithmetic (an overflow, a 0/0 after an underflow), not a fault
        same_nonfinite |= ~torch.isfinite(t) & ((t == r) | (torch.isnan(t) & torch.isnan(r)))
    err = torch.where(finite_e & torch.isfinite(t), (t - e).abs(), torch.full_like(t, math.inf))
    err = torch.where(same_nonfinite, torch.zeros_like(err), err)
    off = err > bound
    n_off = int(off.sum())
    gross = bool((err > GROSS * bound).any())
    fail = n_off > 0 and (gross or n_off > MAX_SHARE * max(t.numel(), 1))
    c = _summary(t, e, off, dtype)
    return replace(c, ok=not fail)


def compare_step(target: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> Comparison:
    """Relative L2 error of a whole-step result (loss, a gradient, a parameter); a complex one
    by its real and imaginary parts (the same L2 norm).

    >>> z = torch.tensor([1 + 1j, 2 - 1j])
    >>> compare_step(z, z, torch.float32).ok, compare_step(z, z.conj(), torch.float32).ok
    (True, False)
    """
    t = parts(target.detach()).to(devices.HOST, torch.float64)
    e = parts(reference.detach()).to(devices.HOST, torch.float64)
    if t.shape != e.shape:
        return Comparison(False, t.numel(), t.numel(), math.inf, None, None, None, math.inf, 0.0,
                          1.0, reason=f"shape {tuple(t.shape)} vs {tuple(e.shape)}")
    fin = torch.isfinite(t) & torch.isfinite(e)
    nonfinite_differs = bool(((~torch.isfinite(t)) != (~torch.isfinite(e))).any())
    rel_l2 = float(torch.where(fin, t - e, 0).norm() / torch.where(fin, e, 0).norm().clamp_min(
        torch.finfo(torch.float64).tiny))
    bad = nonfinite_differs or rel_l2 > step_rtol(dtype)
    off = torch.zeros_like(t, dtype=torch.bool) if not bad else (
        (t - e).abs() > step_rtol(dtype) * e.abs().clamp_min(1e-12)) | (
        torch.isfinite(t) != torch.isfinite(e))
    c = _summary(t, e, off, dtype, reason=(f"relative L2 error {rel_l2:.3g} > {step_rtol(dtype)}"
                                           if bad else ""))
    return replace(c, ok=not bad)
