"""Culprit signatures: what groups two failures together across a night of bundles."""
from __future__ import annotations

import re

from nanbisect.records import module_label



def normalise_module(name: str) -> str:
    """``layers.17.mlp`` -> ``layers.N.mlp``: the same code at another depth groups together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "N", name)


def signature(report: dict) -> str | None:
    c = report.get("culprit")
    if report.get("verdict") != "culprit" or not c:
        if report.get("verdict") == "input-nonfinite":
            return "input-nonfinite · data"
        if report.get("verdict") == "not-reproduced":
            # code-changed, replay-mismatch, unknown and transient are different nights
            return f"not-reproduced · {report.get('classification') or 'unknown'}"
        return None
    return " · ".join([c.get("op") or "-", normalise_module(module_label(c.get("module"))),
                       c.get("phase") or "-", ",".join(c.get("input_dtypes") or []) or "-",
                       report.get("classification") or "-"])
