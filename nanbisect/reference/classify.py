"""The classification of a NaN/inf culprit from the evidence of a reference (one rank or many).

``device`` only when the op, given the same inputs at the same dtype, is wrong on the target and
right on the reference (the op check); a whole-step reference that stays finite is not enough (a
float64 reference does not overflow where float32 does). Pure function: no torch state.
"""
from __future__ import annotations

import torch

from nanbisect.records import OpCheck


def classify(has_reference: bool, reference_failed: bool, ref_dtype: torch.dtype | None,
             target_dtype: torch.dtype, op_check: OpCheck | None) -> tuple[str, str | None]:
    """(classification, why) for a culprit op; ``why`` is a note when the evidence needs one.

    >>> from nanbisect.records import OpCheck
    >>> mismatch = OpCheck("aten.sqrt.default", 3, "mismatch")
    >>> classify(True, False, None, torch.float32, mismatch)
    ('device', None)
    >>> classify(False, False, None, torch.float32, None)
    ('unknown', None)
    """
    if not has_reference:
        return "unknown", None
    if reference_failed:
        return "numerics", ("the reference fails too: the failure follows from the arithmetic, "
                            "not from the target device")
    if op_check is None or op_check.status in ("uncomparable", "skipped"):
        return "unknown", ("the reference step stays finite, but the culprit op could not be "
                           "re-run on the reference from the same inputs, so the device is not "
                           "proven at fault")
    if op_check.status == "mismatch":
        return "device", None
    if ref_dtype is not None and ref_dtype != target_dtype:
        return "numerics", (f"given the same inputs at {str(target_dtype)[6:]}, the "
                            f"reference computes the same non-finite result: the "
                            f"{str(ref_dtype)[6:]} reference avoided it by its wider dtype, "
                            "not by a correct kernel")
    return "unknown", ("the culprit op computes the same on the reference from the same inputs, "
                       "yet the reference step stays finite: the op's inputs already differed "
                       "(an earlier divergence); replay without NaN to find it")
