"""NaN only when compiled: where the compiled step parts from the eager one.

A bundle whose Task ran its model under ``torch.compile`` (manifest ``task.compiled``) and whose
failure does not come back eagerly is replayed compiled (`nanbisect.replay.Replayer.compile`);
when it fails there, torch's own ``torch._inductor.compiler_bisector.CompilerBisector`` names the
backend, subsystem and application that make it (`bisect_compiled`, in a child process:
`nanbisect.compiler.bisector`), the op it names is attributed to the module call that fails compiled
alone, and the repro compiles that call (`nanbisect.report.repro.write_module_repro` with
``compile``), run once by `run_repro_forked`.

Not done here: the verdict and report (``nanbisect.pipeline.compiler_verdict``).
"""
from __future__ import annotations

from nanbisect.compiler.launch import (DEFAULT_TIMEOUT, TIMEOUT_ENV, bisect_compiled,
                                       bisect_timeout, run_repro_forked)

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV", "bisect_compiled", "bisect_timeout",
           "run_repro_forked", "repro_compile_args"]


def repro_compile_args(spec: dict | None, backend: str | None) -> dict:
    """torch.compile's keyword arguments for a repro: the backend the bisector found failing
    (else the captured one), with the captured mode or options when that is inductor.

    >>> repro_compile_args({"backend": "inductor", "mode": None, "options": None},
    ...                    "aot_eager_decomp_partition")
    {'backend': 'aot_eager_decomp_partition'}
    """
    spec = spec or {}
    name = backend or spec.get("backend") or "inductor"
    out: dict = {"backend": name}
    if name == "inductor" and spec.get("mode"):
        out["mode"] = spec["mode"]
    elif name == "inductor" and spec.get("options"):
        out["options"] = dict(spec["options"])
    return out
