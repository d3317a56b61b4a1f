"""Target against reference: a comparison (`Comparison`), the verdict on one op (`OpCheck`),
where two steps part (`Divergence`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one target tensor with its reference."""

    ok: bool
    numel: int
    mismatched: int
    worst_abs: float
    worst_index: tuple[int, ...] | None
    worst_target: float | None
    worst_expected: float | None
    max_rel: float
    cosine: float
    share_off: float          # share of elements with relative error beyond the dtype's threshold
    nonfinite_new: int = 0    # non-finite in the target where the expected value is finite
    reason: str = ""

    def message(self) -> str:
        """assert_close-style text, e.g. 'Mismatched elements: 3 / 4096 (0.1%) ...'."""
        if self.ok:
            return "within tolerance"
        pct = 100.0 * self.mismatched / max(self.numel, 1)
        lines = [f"Mismatched elements: {self.mismatched} / {self.numel} ({pct:.3g}%)"]
        if self.worst_index is not None:
            lines.append(f"Greatest absolute difference: {self.worst_abs:.4g} at index "
                         f"{self.worst_index} (target {self.worst_target:.6g}, expected "
                         f"{self.worst_expected:.6g})")
        lines.append(f"Greatest relative difference: {self.max_rel:.4g}; cosine similarity "
                     f"{self.cosine:.6f}; share off by more than the dtype's threshold "
                     f"{100 * self.share_off:.3g}%")
        if self.nonfinite_new:
            lines.append(f"Non-finite in target where expected is finite: {self.nonfinite_new}")
        if self.reason:
            lines.append(self.reason)
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("worst_abs", "max_rel", "cosine", "worst_target", "worst_expected"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = repr(d[k])
        d["worst_index"] = list(d["worst_index"]) if d["worst_index"] is not None else None
        d["message"] = self.message()
        return d

    @staticmethod
    def from_json(d: dict) -> "Comparison":
        """The inverse of `to_json` (between our own processes)."""
        kw = {f.name: d[f.name] for f in fields(Comparison) if f.name in d}
        for k in ("worst_abs", "max_rel", "cosine", "worst_target", "worst_expected"):
            if isinstance(kw.get(k), str):
                kw[k] = float(kw[k])
        if kw.get("worst_index") is not None:
            kw["worst_index"] = tuple(kw["worst_index"])
        return Comparison(**kw)

@dataclass(frozen=True)
class OpCheck:
    """The verdict on one op, judged in isolation on the reference from the target's inputs."""

    op: str
    op_index: int
    status: str                  # "ok" | "mismatch" | "uncomparable" | "skipped"
    how: str | None = None       # "kernel" | "registered": what ran on the reference
    comparisons: list[Comparison] = field(default_factory=list)
    detail: str = ""

    def to_json(self) -> dict:
        return {"op": self.op, "op_index": self.op_index, "status": self.status,
                "how": self.how, "detail": self.detail,
                "comparisons": [c.to_json() for c in self.comparisons]}

    @staticmethod
    def from_json(d: dict) -> "OpCheck":
        return OpCheck(d["op"], d["op_index"], d["status"], d.get("how"),
                       [Comparison.from_json(c) for c in d.get("comparisons", [])],
                       d.get("detail", ""))

@dataclass(frozen=True)
class Divergence:
    """Where target and reference first disagree after a whole step without NaN."""

    phase: str                 # forward (loss) | backward (a gradient) | optimizer (a parameter)
    what: str                  # "loss", "grad:<name>", "param:<name>"
    comparison: Comparison

    def to_json(self) -> dict:
        return {"what": self.what, **self.comparison.to_json()}

    @staticmethod
    def from_json(d: dict) -> "Divergence":
        """The inverse of `to_json`: the phase, which it leaves out, is the one ``what`` names
        (the loss: forward, a gradient: backward, a parameter: optimizer)."""
        what = d["what"]
        phase = {"grad": "backward", "param": "optimizer"}.get(what.split(":")[0], "forward")
        return Divergence(phase, what, Comparison.from_json(d))
