"""The facts every report of a run shares (`Losses`, `Fidelity`, `RunFacts`, `StageError`), and
the parts of a report that say what came before the failing step (`HistoryEntry`, `Finding`,
`StepRow`, `StepsWindow`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, TypeVar

from nanbisect.records.words import json_number
from nanbisect.util.recordjson import number
from nanbisect.util.text import failure_line

T = TypeVar("T")


@dataclass(frozen=True)
class Losses:
    """The step's loss as captured and as replayed on each side (JSON numbers or "nan"/"inf")."""

    original: float | str | None
    target: float | str | None
    reference: float | str | None = None
    bit_exact: bool | None = None    # None: not decidable (no finite original, or no loss)

    def to_json(self) -> dict:
        d = {"original_loss": self.original, "target_loss": self.target,
             "reference_loss": self.reference}
        if self.bit_exact is not None:
            d["bit_exact"] = self.bit_exact
        return d

    @staticmethod
    def from_json(d: dict) -> "Losses":
        """The losses of report.json's ``replay``, as written (numbers or "nan"/"inf")."""
        return Losses(d.get("original_loss"), d.get("target_loss"), d.get("reference_loss"),
                      d.get("bit_exact"))

def fidelity_tier(bit_exact: bool | None, rel_diff: float | None, tolerance: float | None,
                  elsewhere: bool) -> str | None:
    """How close a replay came to what the capture recorded: ``bit-exact``; ``within-tolerance``
    (other hardware or software than the capture's, or hardware the bundle does not record,
    ``elsewhere``, and a relative difference within the step-level ``tolerance`` of the target
    dtype); else ``mismatch``. None when it cannot tell (nothing finite to compare). The one
    rule every verdict (one step, ``--steps``, ranks) asks.

    >>> fidelity_tier(False, 2e-7, 1e-3, elsewhere=True), fidelity_tier(False, 2e-7, 1e-3, False)
    ('within-tolerance', 'mismatch')
    """
    if bit_exact is None:
        return None
    if bit_exact:
        return "bit-exact"
    if elsewhere and rel_diff is not None and tolerance is not None and rel_diff <= tolerance:
        return "within-tolerance"
    return "mismatch"


@dataclass(frozen=True)
class Fidelity:
    """Whether the replay computes the captured step (see `nanbisect.replay.fidelity`)."""

    code_changed: list[str]          # user source files that differ from the capture's
    environment_changed: list[str]   # versions/settings that differ, e.g. "torch 2.4 at ..."
    same_setup: bool                 # replayed on the capture device type at the capture dtype
    bit_exact: bool | None           # the loss equals the captured one (None: not decidable)
    code_missing: list[str] = field(default_factory=list)   # recorded files not found now
    # what differs between the capture machine's fingerprint and this one's, e.g. "cpu
    # capability: AVX512 at capture, DEFAULT now"; hardware_known: the bundle records one
    hardware_changed: list[str] = field(default_factory=list)
    hardware_known: bool = True
    loss_rel_diff: float | None = None   # |replayed - captured| / |captured| (finite losses)
    tolerance: float | None = None       # the step-level relative tolerance of ...
    tolerance_dtype: str | None = None   # ... the target dtype ("float32")
    dtype_changed: bool = False          # the replay runs at another dtype by request

    @property
    def elsewhere(self) -> bool:
        """The replay runs on other hardware or software than the capture, or on hardware the
        bundle does not record: last-bit differences are expected there."""
        return bool(self.hardware_changed or self.environment_changed or not self.hardware_known
                    or not self.same_setup)

    @property
    def tier(self) -> str | None:
        """report.json ``replay.fidelity``: `fidelity_tier` of this replay's loss."""
        return fidelity_tier(self.bit_exact, self.loss_rel_diff, self.tolerance, self.elsewhere)

    @property
    def mismatch(self) -> bool:
        """The replay does not compute the captured step: another loss on the same hardware and
        software, or a difference beyond the tolerance (never for a dtype changed by request)."""
        return self.tier == "mismatch" and not self.dtype_changed

    def causes(self) -> str:
        """The likely reasons for a mismatch, most likely first."""
        out = []
        if self.code_changed:
            out.append("the code changed since the capture: " + ", ".join(self.code_changed[:5])
                       + (f" and {len(self.code_changed) - 5} more"
                          if len(self.code_changed) > 5 else ""))
        if self.environment_changed:
            out.append("the environment changed: " + "; ".join(self.environment_changed))
        out += ["the training loop does something the Task does not describe (its own loss "
                "scaling, an extra forward, a hook, clipping or accumulation not given to Task)",
                "autocast (or another mode) entered outside loss_fn, so the replay runs at "
                "another precision",
                "state outside the model, optimizer and RNG (a global, a data-dependent "
                "schedule)"]
        if not self.same_setup:
            out.append("the capture device computed the step differently (a fault of that "
                       "device or its kernels): replay on the capture device to tell")
        return "; ".join(out)

    @property
    def faithful(self) -> bool | None:
        """True: same code and a bit-exact loss; False: other code or another loss; None: the
        loss cannot tell (not finite at capture, or replayed elsewhere) and the code is the same."""
        if self.code_changed or self.mismatch:
            return False
        return True if self.bit_exact and not self.code_missing else None

    def to_json(self) -> dict:
        return {"faithful": self.faithful, "fidelity": self.tier,
                "hardware": ("unknown" if not self.hardware_known else
                             "changed" if self.hardware_changed else "same"),
                "hardware_changed": list(self.hardware_changed),
                "loss_rel_diff": json_number(self.loss_rel_diff), "tolerance": self.tolerance,
                "code_changed": list(self.code_changed),
                "code_missing": list(self.code_missing),
                "environment_changed": list(self.environment_changed)}

    @staticmethod
    def from_json(d: dict) -> "Fidelity | None":
        """The fidelity of report.json's ``replay`` (None when it has none). What `to_json`
        leaves out is what its derived words imply: the loss's ``bit_exact`` when the losses
        leave it out, from the tier; a ``within-tolerance`` tier with no change
        named was replayed on another setup; a tier of ``mismatch`` that is not unfaithful ran at
        a dtype changed by request. ``tolerance_dtype`` is not known."""
        if "fidelity" not in d:
            return None
        tier = d.get("fidelity")
        bit_exact = d["bit_exact"] if "bit_exact" in d else \
            None if tier is None else tier == "bit-exact"
        f = Fidelity(code_changed=list(d.get("code_changed") or []),
                     environment_changed=list(d.get("environment_changed") or []),
                     same_setup=True, bit_exact=bit_exact,
                     code_missing=list(d.get("code_missing") or []),
                     hardware_changed=list(d.get("hardware_changed") or []),
                     hardware_known=d.get("hardware") != "unknown",
                     loss_rel_diff=number(d.get("loss_rel_diff")), tolerance=d.get("tolerance"))
        if f.tier != tier:
            f = replace(f, same_setup=False)
        if f.faithful != d.get("faithful"):
            f = replace(f, dtype_changed=True)
        return f

@dataclass(frozen=True)
class RunFacts:
    """What every report of one run states, whatever the verdict."""

    bundle: str
    entry: str
    target: str
    reference: str
    observed: Any                    # the manifest's `observed` (one rank's, or rank -> its)
    losses: Losses
    fidelity: Fidelity | None = None

@dataclass(frozen=True)
class StageError:
    """A stage after the verdict that failed (report.json ``errors``): the rest of the report
    is written without what it would have added, and the exit code stays the verdict's.

    >>> StageError("remedies", "RuntimeError: out of memory").to_json()
    {'stage': 'remedies', 'message': 'RuntimeError: out of memory'}
    """

    stage: str        # a key of nanbisect.pipeline.STAGES, or "history", "page", ...
    message: str      # one line: the exception's type and text, and where it was raised

    def to_json(self) -> dict:
        return {"stage": self.stage, "message": self.message}

    @staticmethod
    def from_json(d: dict) -> "StageError":
        return StageError(str(d.get("stage")), str(d.get("message")))


def after_verdict(errors: list[StageError], stage: str, fn: Callable[[], T], default: T) -> T:
    """``fn()``, a stage that runs once the verdict is known; when it raises, ``default``, and
    ``StageError(stage, the exception in one line)`` appended to ``errors`` (report.json
    ``errors``): the report is still written, without what the stage would have added, and the
    exit code stays the verdict's. A `BadInput` a stage raises (the entry's code failing in a
    remedy's or a repro's replay) is listed the same way: the verdict was reached on that entry.
    What is not an `Exception` (KeyboardInterrupt, SystemExit, the passes' own control flow,
    such as the catch that ends a narrow replay) goes through.

    >>> errors = []
    >>> after_verdict(errors, "remedies", lambda: 1 / 0, []), errors[0].stage
    ([], 'remedies')
    >>> errors[0].message.startswith("ZeroDivisionError: division by zero at ")
    True
    """
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - listed in the report, which is still written
        errors.append(StageError(stage, failure_line(e)))
        return default

@dataclass(frozen=True)
class HistoryEntry:
    """One step of a bundle's history (``Guard(history=N)``; report.json ``history``): what is
    not known is None and left out of the JSON.

    >>> HistoryEntry(12, loss=float("nan"), skipped=False).to_json()
    {'step': 12, 'loss': 'nan', 'skipped': False}
    """

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    skipped: bool | None = None

    def to_json(self) -> dict:
        out: dict = {"step": self.step}
        for k in ("loss", "grad_norm", "lr"):
            if getattr(self, k) is not None:
                out[k] = json_number(getattr(self, k))
        if self.skipped is not None:
            out["skipped"] = self.skipped
        return out

    @staticmethod
    def from_json(d: dict) -> "HistoryEntry":
        return HistoryEntry(d["step"], number(d.get("loss")), number(d.get("grad_norm")),
                            number(d.get("lr")), d.get("skipped"))

@dataclass(frozen=True)
class Finding:
    """What a bundle's history points out (report.json ``history_findings``): its ``kind``
    (``lr-jump``, ``loss-jump``, ``grad-norm-jump``, ``param-extreme``, ``moment-extreme``), the
    numbers that earn it and a sentence for people."""

    kind: str
    text: str
    step: int | None = None
    parameter: str | None = None
    state: str | None = None          # an optimizer state's name (moment-extreme)
    value: float | None = None
    baseline: float | None = None
    ratio: float | None = None
    z: float | None = None            # robust z score (the jumps)
    since_step: int | None = None     # param-extreme: above x2 of its baseline since then

    KEYS = {"lr-jump": ("kind", "step", "value", "baseline", "ratio", "text"),
            "loss-jump": ("kind", "step", "value", "baseline", "ratio", "z", "text"),
            "grad-norm-jump": ("kind", "step", "value", "baseline", "ratio", "z", "text"),
            "param-extreme": ("kind", "parameter", "value", "baseline", "ratio", "since_step",
                              "text"),
            "moment-extreme": ("kind", "parameter", "state", "value", "baseline", "ratio",
                               "text")}

    def to_json(self) -> dict:
        keys = self.KEYS.get(self.kind) or [f.name for f in fields(self)
                                            if getattr(self, f.name) is not None]
        return {k: getattr(self, k) for k in keys}

    @staticmethod
    def from_json(d: dict) -> "Finding":
        names = {f.name for f in fields(Finding)}
        return Finding(**{k: v for k, v in d.items() if k in names})

@dataclass(frozen=True)
class StepRow:
    """One step of a ``--steps`` window, replayed on both sides."""

    step: int
    target_loss: float | str | None
    reference_loss: float | str | None
    original_loss: float | str | None     # the guarded run's, from the bundle's history
    max_rel_diff: float | None
    parted: bool
    why: str | None = None                # what parted: "param:<name>", "target failed", ...

    def to_json(self) -> dict:
        return {"step": self.step, "target_loss": self.target_loss,
                "reference_loss": self.reference_loss, "original_loss": self.original_loss,
                "max_rel_diff": self.max_rel_diff, "parted": self.parted,
                **({"why": self.why} if self.why else {})}

    @staticmethod
    def from_json(d: dict) -> "StepRow":
        return StepRow(d["step"], d.get("target_loss"), d.get("reference_loss"),
                       d.get("original_loss"), d.get("max_rel_diff"), d["parted"], d.get("why"))

@dataclass(frozen=True)
class StepsWindow:
    """report.json ``steps`` (``run --steps K``): the replayed window and where it parts.

    >>> StepsWindow([StepRow(7, 1.0, 1.0, 1.0, 0.0, False)], None, 0, None).to_json()["replayed"]
    [{'step': 7, 'target_loss': 1.0, 'reference_loss': 1.0, 'original_loss': 1.0, \
'max_rel_diff': 0.0, 'parted': False}]
    """

    replayed: list[StepRow]
    first_divergent_step: int | None
    advanced: int                  # steps replayed on the target alone before the window
    # the target's pre-state of the failing step against the recorded one: bit_exact,
    # max_rel_diff, parameters, first_step_off_history (and stopped_at when it never got there)
    reached_recorded: dict[str, Any] | None
    failing_prestate_max_rel_diff: float | None = None   # how far the failing step's pre-state
                                                         # had drifted from the reference's

    def to_json(self) -> dict:
        return {"replayed": [r.to_json() for r in self.replayed],
                "first_divergent_step": self.first_divergent_step,
                "advanced": self.advanced, "reached_recorded": self.reached_recorded,
                "failing_prestate_max_rel_diff": self.failing_prestate_max_rel_diff}

    @staticmethod
    def from_json(d: dict) -> "StepsWindow":
        return StepsWindow([StepRow.from_json(r) for r in d.get("replayed") or []],
                           d.get("first_divergent_step"), d.get("advanced", 0),
                           d.get("reached_recorded"), d.get("failing_prestate_max_rel_diff"))
