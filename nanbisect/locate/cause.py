"""A likely cause in plain words, beside the verdict, for the patterns NaN hunts meet most, from
evidence the run holds: the culprit op, its autograd node, its phase, the inputs the narrow pass
caught (`Caught`), where its inf was born (``inf_origin``) and the optimizer.

Guarantees: every sentence is backed by a check of that evidence (an input row that is entirely
-inf, an exact zero where a backward formula divides and no inf came in, a log's input below or at
its edge, a division whose numerator and denominator are both 0, a float16 culprit whose inf was
born in an op that can overflow, an Adam ``eps`` of 0 or below the dtype's smallest normal);
`likely_cause` returns None when none holds. Not guaranteed: that the pattern named is the only
thing wrong (it is the arithmetic that made the value, not why the data or the model got there).
"""
from __future__ import annotations

import torch

from nanbisect.records import Caught, Culprit, OpFinding
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import widened

# backward formulas that divide by their forward result or input: infinite slope at 0
_AT_ZERO = {"SqrtBackward0": "sqrt", "RsqrtBackward0": "rsqrt", "PowBackward0": "pow",
            "PowBackward1": "pow", "PowBackward2": "pow", "NormBackward0": "norm",
            "NormBackward1": "norm", "LinalgVectorNormBackward0": "norm",
            "HypotBackward0": "hypot", "CdistBackward0": "cdist",
            "LogBackward0": "log", "Log2Backward0": "log2", "Log10Backward0": "log10",
            "DivBackward0": "div", "AngleBackward0": "angle"}
# ops whose float16 result can exceed 65504 from finite inputs (a cast from float32 included)
_OVERFLOWING = ("aten.exp", "aten.expm1", "aten.mul", "aten.add", "aten.sub", "aten.sum",
                "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul", "aten.mv",
                "aten.dot", "aten.linear", "aten.pow", "aten.square", "aten.cumsum",
                "aten.native_layer_norm", "aten.native_batch_norm", "aten.convolution",
                "aten._to_copy", "aten.sinh", "aten.cosh", "aten.sigmoid_backward")
_SOFTMAX = {"aten._softmax.default", "aten._log_softmax.default",
            "aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default",
            "aten.logsumexp.default"}
_SOFTMAX_NODES = {"SoftmaxBackward0", "LogSoftmaxBackward0", "LogsumexpBackward0"}
_LOGS = {"aten.log.default", "aten.log2.default", "aten.log10.default", "aten.log1p.default"}
_LOG_EDGE = {"aten.log1p.default": -1.0}      # where a log gives -inf (0 for the others)
_DIVS = {"aten.div.Tensor", "aten.div_.Tensor", "aten.div.Scalar", "aten.div_.Scalar",
         "aten.mean.default", "aten.mean.dim", "aten.nll_loss_forward.default",
         "aten.nll_loss2d_forward.default"}
_HALF_MAX = 65504.0


def _tensors(caught: Caught | None) -> list[torch.Tensor]:
    if caught is None:
        return []
    return [t for t in ti.tree_leaves((caught.args, caught.kwargs))
            if isinstance(t, torch.Tensor)]


def _floats(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in ts if t.is_floating_point() or t.is_complex()]


def _all_neginf_row(ts: list[torch.Tensor]) -> bool:
    """Some row (along the last dim) of a floating input is -inf everywhere."""
    for t in _floats(ts):
        if t.is_floating_point() and t.dim() >= 1 and t.numel() and t.shape[-1] > 0:
            if bool((t == float("-inf")).all(-1).any()):
                return True
    return False


def _has_zero(ts: list[torch.Tensor]) -> bool:
    return any(t.numel() and bool((t == 0).any()) for t in _floats(ts))


def _zero_over_zero(caught: Caught | None) -> bool:
    """A division whose numerator and denominator are both 0 somewhere (broadcast), or a
    mean over nothing."""
    if caught is None or caught.op not in _DIVS:
        return False
    op = caught.op
    ts = [t for t in caught.args if isinstance(t, torch.Tensor)]
    if op.startswith("aten.mean"):
        return bool(ts) and ts[0].numel() == 0
    if op.startswith("aten.nll_loss"):
        # (input, target, weight, reduction, ignore_index): every label ignored, a mean of 0
        target = caught.args[1] if len(caught.args) > 1 else None
        ignore = caught.args[4] if len(caught.args) > 4 else -100
        reduction = caught.args[3] if len(caught.args) > 3 else 1
        return (isinstance(target, torch.Tensor) and reduction == 1
                and (target.numel() == 0 or bool((target == ignore).all())))
    if len(ts) >= 2:
        a, b = ts[0], ts[1]
        try:
            return bool(((a == 0) & (b == 0)).any())
        except RuntimeError:
            return False
    if len(ts) == 1 and len(caught.args) > 1 and caught.args[1] == 0:
        return bool((ts[0] == 0).any())
    return False


def _zero_times_inf(caught: Caught | None) -> bool:
    """A product of 0 and an infinity at the same position (broadcast)."""
    if caught is None or caught.op not in ("aten.mul.Tensor", "aten.mul_.Tensor"):
        return False
    ts = [t for t in caught.args if isinstance(t, torch.Tensor)]
    if len(ts) < 2 or not (ts[0].is_floating_point() and ts[1].is_floating_point()):
        return False
    a, b = widened(ts[0]), widened(ts[1])
    try:
        return bool((((a == 0) & b.isinf()) | (a.isinf() & (b == 0))).any())
    except RuntimeError:
        return False


def likely_cause(culprit: Culprit, caught: Caught | None, finding: OpFinding | None,
                 optimizer: torch.optim.Optimizer | None = None) -> str | None:
    """One plain sentence for a recognised pattern, else None.

    >>> c = Culprit("forward", "pool", 0, ["float32"], [[2, 3]], None, op="aten.div.Tensor")
    >>> zero = torch.zeros(2)
    >>> likely_cause(c, Caught("aten.div.Tensor", [zero, zero], {}, [], {}, None), None)
    '0/0: a division of 0 by 0, as a mean over an empty selection gives (no tokens, every label ignored, an empty mask)'
    """
    ins = _tensors(caught)
    node = culprit.node.name if culprit.node is not None else None
    origin = finding.inf_origin if finding is not None else None
    if culprit.phase == "optimizer" and optimizer is not None:
        eps = [float(g["eps"]) for g in optimizer.param_groups
               if isinstance(g.get("eps"), (int, float)) and not isinstance(g.get("eps"), bool)]
        name = type(optimizer).__name__
        if eps and "Adam" in name:
            low = min(eps)
            dtype = next((getattr(torch, d) for d in culprit.input_dtypes
                          if isinstance(getattr(torch, d, None), torch.dtype)
                          and getattr(torch, d).is_floating_point), torch.float32)
            if low <= torch.finfo(dtype).tiny:
                return (f"{name}'s eps ({low:g}) is too small for {str(dtype)[6:]}: the update "
                        "divides by sqrt(v) + eps, 0/0 for a parameter whose gradient is 0")
    if (culprit.op in _SOFTMAX or node in _SOFTMAX_NODES) and _all_neginf_row(ins):
        return ("a softmax (or logsumexp) over a row that is entirely -inf (every position "
                "masked): exp(-inf - -inf) is NaN")
    if culprit.phase == "backward" and node in _AT_ZERO and origin is None and _has_zero(ins):
        f = _AT_ZERO[node]
        if f in ("log", "log2", "log10", "div"):
            return f"the backward of {f} at 0: it divides the incoming gradient by 0"
        return (f"the backward of {f} at 0: its derivative is infinite there (a norm or "
                "distance of a zero or duplicated vector, a magnitude of 0), and 0 times it "
                "is NaN")
    if culprit.op in _LOGS and ins:
        edge = _LOG_EDGE.get(culprit.op, 0.0)
        x = ins[0]
        if x.is_floating_point() and bool((x < edge).any()):
            return f"log of a number below {edge:g}: NaN"
        if x.is_floating_point() and bool((x == edge).any()):
            return f"log of {edge:g}: -inf"
    if origin is not None and origin.op in _LOGS:
        return f"log of 0: {origin.op} made -inf, and the arithmetic after it made NaN of it"
    if _zero_times_inf(caught):
        made = f" ({origin.op} made the infinity)" if origin is not None else ""
        return ("0 * inf: a zero (a probability of 0, a gradient a mask zeroed) times an "
                f"infinity (a log of 0, a -inf mask){made} is NaN")
    if _zero_over_zero(caught):
        if culprit.phase == "optimizer":
            return "0/0: the update divides 0 by 0"
        return ("0/0: a division of 0 by 0, as a mean over an empty selection gives (no "
                "tokens, every label ignored, an empty mask)")
    if "float16" in culprit.input_dtypes and origin is not None and \
            origin.op.startswith(_OVERFLOWING):
        return (f"a float16 overflow in {origin.op}: a value above {_HALF_MAX:g} (float16's "
                "largest) became inf, and inf - inf, inf / inf or 0 * inf made NaN")
    return None
