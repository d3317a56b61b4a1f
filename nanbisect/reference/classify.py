"""The classification of a NaN/inf culprit from an explicit evidence record (one rank or many),
and of a recorded failure that did not come back (`classify_not_reproduced`, one rank or many).

``device`` only when the op, given the same inputs at the same dtype, is wrong on the target and
right on the reference (the op check); a whole-step reference that stays finite is not enough (a
float64 reference does not overflow where float32 does). ``transient`` only on the capture
machine: the same code, hardware and versions, and no sign that the replay computes another
step. Pure functions: no torch state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanbisect.records import Fidelity, OpCheck


REPLAY_MISMATCH_NOTE = ("the culprit above is where the replay failed; the replay does not "
                        "compute the captured step, so it may not be where the training run "
                        "failed")


@dataclass(frozen=True)
class Evidence:
    """What a culprit's classification is decided from, gathered by whoever replayed it.

    ``reference`` says what the reference's own step showed: ``"none"`` (no reference, or it
    could not replay the step), ``"failed"`` / ``"finite"`` (its step went non-finite or not),
    or ``"served"`` (a rank replayed alone: the reference was served the capture's collectives,
    non-finite ones included, so its step proves nothing; only the op check, re-run from the
    same inputs, does: the same non-finite result there is the arithmetic, another the device).
    """

    reference: str                       # none | failed | finite | served
    reference_dtype: torch.dtype | None  # the reference's dtype when it differs by request
    target_dtype: torch.dtype
    op_check: OpCheck | None
    replay_mismatch: bool = False        # the replay does not compute the captured step


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


def classify_culprit(ev: Evidence) -> tuple[str, list[str]]:
    """(classification, notes) of a NaN/inf culprit: `classify` of the evidence, with the notes
    every run prints for it (an op the reference could not run; why; a replay that is not the
    captured step).

    >>> from nanbisect.records import OpCheck
    >>> ev = Evidence("finite", None, torch.float32, OpCheck("aten.exp.default", 7, "mismatch"))
    >>> classify_culprit(ev)
    ('device', [])
    >>> classify_culprit(Evidence("none", None, torch.float32, None, replay_mismatch=True))[0]
    'replay-mismatch'
    """
    notes = []
    check = ev.op_check
    if check is not None and check.status == "uncomparable":
        notes.append(f"{check.op} cannot run on the reference ({check.detail}); it is reported "
                     "as uncomparable, not as correct")
    failed = ev.reference == "failed" or (ev.reference == "served" and check is not None
                                          and check.status == "ok")
    classification, why = classify(ev.reference != "none", failed, ev.reference_dtype,
                                   ev.target_dtype, check)
    if why:
        notes.append(why)
    if ev.replay_mismatch:
        classification = "replay-mismatch"
        notes.append(REPLAY_MISMATCH_NOTE)
    return classification, notes


def classify_not_reproduced(f: Fidelity | None, target: str, undeclared_scaler: bool = False
                            ) -> tuple[str, str]:
    """(classification, why) of a recorded failure that did not come back on ``target``: what
    the fidelity evidence allows, ``transient`` only when the replay ran the captured code on
    the capture machine (same hardware, same versions) and computed the captured step.
    ``undeclared_scaler``: the Guard bundled a stall of steps skipped with no GradScaler on
    the Task, so a finite replay (without that scaling) is the loop's scaling, not a transient.

    >>> f = Fidelity([], [], True, True, hardware_changed=["cpu processor: A at capture, B now"])
    >>> classify_not_reproduced(f, "cpu")[0], classify_not_reproduced(None, "cpu")[0]
    ('unknown', 'transient')
    """
    if undeclared_scaler:
        return "replay-mismatch", (
            "the loop scales its loss with a GradScaler the Task does not declare: the replay, "
            "without that scaling, has finite gradients, so the overflow was the scaling's")
    if f is not None and f.code_changed:
        return "code-changed", (
            "the replay ran different code from the capture's (listed above): the edit, not the "
            "hardware, is the first suspect; replay with the captured code to tell")
    if f is not None and f.mismatch:
        return "replay-mismatch", (
            "the replay does not compute the captured step, so it cannot tell whether the "
            "failure would come back; make the Task describe the loop")
    if f is not None and not f.same_setup:
        return "unknown", (
            f"the replay ran on {target}, not on the capture device: a fault of that "
            "device or its kernels would not show here; replay on the capture device")
    if f is not None and f.code_missing:
        return "unknown", (
            "source files of the capture are missing here (listed above), so the replay may not "
            "run the captured code; replay where the training code is")
    if f is not None and f.hardware_changed:
        return "unknown", (
            "the replay ran on other hardware than the capture's (" + "; ".join(
                f.hardware_changed[:3]) + "): a fault or a rounding of the capture machine "
            "would not show here, and a transient needs the capture machine to tell; replay "
            "there")
    if f is not None and f.environment_changed:
        return "unknown", (
            "the replay ran with other versions than the capture (listed above): a change in "
            "them is as likely a cause as a transient; replay with the captured versions")
    if f is not None and not f.hardware_known and f.bit_exact is False:
        return "unknown", (
            "the bundle records no hardware fingerprint and the loss is not the captured one "
            "bit for bit, so this may be another machine, where a transient cannot be told "
            "from a fault of the capture machine; replay on the capture machine")
    return "transient", (
        "the replay ran the captured code from the same state, RNG and batch"
        + (", with the captured loss bit for bit," if f is not None and f.faithful else "")
        + " and was finite: suspect a transient (hardware, race, unsynchronised "
        "communication)")
