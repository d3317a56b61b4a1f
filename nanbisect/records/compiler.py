"""What the compiled replay and torch's compiler bisector found (report.json ``compiler``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompilerFinding:
    """Where the compiled step first parts from the eager one, as
    ``torch._inductor.compiler_bisector.CompilerBisector`` names it.

    ``eager`` / ``compiled``: what each replay of the step gave ("finite" | "nan" | "inf").
    ``backend``: the first backend of eager -> aot_eager -> aot_eager_decomp_partition ->
    inductor that fails (the captured backend when the bisection did not run or finish);
    ``subsystem``: the part of it whose disabling fixes the step (``decomposition``,
    ``lowerings``, a pass, or a config change's name); ``bisect_number``: which application of
    that subsystem; ``config_change``: "section.field=value" when a config change fixed it;
    ``detail``: the bisector's debug info (the decomposed op, the lowered node) or why there is
    none. ``op``, ``module``, ``module_call``: the culprit it attributes (None: not attributed).
    """

    eager: str
    compiled: str
    backend: str | None
    subsystem: str | None = None
    bisect_number: int | None = None
    config_change: str | None = None
    detail: str | None = None
    op: str | None = None
    module: str | None = None
    module_call: int | None = None
    phase: str | None = None          # the compiled step's failing phase
    seconds: float | None = None      # the bisection's wall time
    finished: bool = False            # the bisection ran to its end

    def to_json(self) -> dict:
        """Every field: the child hands it to its parent this way, and report.json holds it.

        >>> f = CompilerFinding("finite", "nan", "inductor", op="aten.exp", module_call=2)
        >>> CompilerFinding.from_json(f.to_json()) == f
        True
        """
        return {k: getattr(self, k) for k in CompilerFinding.__dataclass_fields__}

    @staticmethod
    def from_json(d: dict) -> "CompilerFinding":
        return CompilerFinding(**{k: d[k] for k in CompilerFinding.__dataclass_fields__
                                  if k in d})
