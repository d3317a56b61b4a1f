"""Culprit signatures: what groups two failures together across a night of bundles.

A culprit's signature is ``ORIGIN @ SITE · MODULE · PHASE · DTYPES · CLASSIFICATION``:

- ORIGIN: for a backward culprit whose report names its autograd node (``culprit.node``), the
  node (``DivBackward0``); else the culprit op without its overload (``aten.div``, not
  ``aten.div.Tensor``): a different batch can make the first NaN in another aten op of the same
  node, or in another overload of the same op;
- SITE: the code site, the module-qualified name of the function whose line made it
  (``culprit.function``: ``model.Attention.forward``), so that an unrelated edit above the line
  (a comment, an import) keeps the signature; a report without one (written by an older
  nanbisect, or whose file could not be read) names the line instead, the file's base name and
  line number (``model.py:57``); ``@ ...`` is left out when neither is known. The line itself
  stays in the report, for display;
- MODULE with layer numbers as ``N`` (`normalise_module`), the phase, the culprit's input
  dtypes (each once, sorted: not per argument, which differs between ops), the classification.

Versions: `line_signature` is the form before this one (``ORIGIN @ FILE:LINE · ...``), and
`legacy_signature` the one before that (``aten.div.Tensor · MODULE · PHASE · float32,float32 ·
CLASSIFICATION``). A ``--known`` list or last night's triage.json written with either still
matches: `nanbisect.nightly.summary` counts a group as known when its signature or an older
form (`older_signatures`) of any of its bundles is listed.
"""
from __future__ import annotations

import re

from nanbisect.records import module_label
from nanbisect.report.model import Report


def as_report(report: Report | dict) -> Report:
    """``report`` as a `Report` (a report.json's dict read through `Report.from_json`)."""
    return report if isinstance(report, Report) else Report.from_json(report)


def normalise_module(name: str) -> str:
    """``layers.17.mlp`` -> ``layers.N.mlp``: the same code at another depth groups together."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "N", name)


def op_packet(op: str | None) -> str | None:
    """An aten overload's packet: what stays the same when another overload runs.

    >>> op_packet("aten.div.Tensor"), op_packet("aten.sqrt.default"), op_packet("my_op")
    ('aten.div', 'aten.sqrt', 'my_op')
    """
    if not op:
        return None
    parts = op.split(".")
    return ".".join(parts[:-1]) if len(parts) >= 3 else op


def source_line(source: str | None) -> str | None:
    """``path/to/model.py:57`` -> ``model.py:57`` (None: no line).

    >>> source_line("/srv/job/src/loss.py:42"), source_line("C:\\\\job\\\\loss.py:42")
    ('loss.py:42', 'loss.py:42')
    """
    if not isinstance(source, str) or not source.strip():
        return None
    path, sep, line = source.strip().rpartition(":")
    if not sep or not line.isdigit():
        path, line = source.strip(), ""
    base = re.split(r"[\\/]", path)[-1] or path
    return f"{base}:{line}" if line else base


def _non_culprit(report: Report) -> str | None:
    if report.verdict == "input-nonfinite":
        # the data, or (unknown) buffers the model made in an earlier step: different nights
        return f"input-nonfinite · {report.classification or 'data'}"
    if report.verdict == "not-reproduced":
        # code-changed, replay-mismatch, unknown and transient are different nights
        return f"not-reproduced · {report.classification or 'unknown'}"
    return None


def signature(report: Report | dict) -> str | None:
    """The report's signature (None: a clean replay); a report.json's dict is read as its
    `Report`.

    >>> c = {"op": "aten.div.Tensor", "module": "", "phase": "backward",
    ...      "input_dtypes": ["float32", "float32"], "source": "/srv/loss.py:42",
    ...      "node": {"name": "DivBackward0", "forward_op": "aten.div.Tensor",
    ...               "forward_source": "loss.py:42"}, "function": "loss.masked_mean"}
    >>> signature({"verdict": "culprit", "classification": "numerics", "culprit": c})
    'DivBackward0 @ loss.masked_mean · <root> · backward · float32 · numerics'
    >>> c = {**c, "op": "aten.mul.Tensor", "input_dtypes": ["float32"]}   # another batch
    >>> signature({"verdict": "culprit", "classification": "numerics", "culprit": c})
    'DivBackward0 @ loss.masked_mean · <root> · backward · float32 · numerics'
    >>> signature({"verdict": "culprit", "classification": "numerics",   # an older report
    ...            "culprit": {**c, "function": None}})
    'DivBackward0 @ loss.py:42 · <root> · backward · float32 · numerics'
    """
    return _signature(report, by_function=True)


def line_signature(report: Report | dict) -> str | None:
    """The signature as nanbisect wrote it before `signature`'s form: the code site as the
    line's file name and number (what older ``--known`` lists and triage.json files hold)."""
    return _signature(report, by_function=False)


def _signature(report: Report | dict, by_function: bool) -> str | None:
    report = as_report(report)
    c = report.culprit
    if report.verdict != "culprit" or c is None:
        return _non_culprit(report)
    node = c.node
    if node is not None and isinstance(node.name, str) and node.name:
        origin = node.name
        line = source_line(node.forward_source) or source_line(c.source)
    else:
        origin = op_packet(c.op) or "-"
        line = source_line(c.source)
    site = c.function if by_function and isinstance(c.function, str) and c.function else line
    dtypes = sorted({str(d) for d in (c.input_dtypes or []) if d})
    return " · ".join([origin + (f" @ {site}" if site else ""),
                       normalise_module(module_label(c.module)), c.phase or "-",
                       ",".join(dtypes) or "-", report.classification or "-"])


def older_signatures(report: Report | dict) -> list[str]:
    """The report's signature in every older form (`line_signature`, `legacy_signature`),
    each once, none equal to `signature`'s: what a known list may hold of the same failure."""
    report = as_report(report)
    now = signature(report)
    out: list[str] = []
    for s in (line_signature(report), legacy_signature(report)):
        if s is not None and s != now and s not in out:
            out.append(s)
    return out


def legacy_signature(report: Report | dict) -> str | None:
    """The signature as nanbisect wrote it before `signature`'s form (the exact aten overload
    of the culprit op, its input dtypes per argument): what older ``--known`` lists and
    triage.json files hold."""
    report = as_report(report)
    c = report.culprit
    if report.verdict != "culprit" or c is None:
        return _non_culprit(report)
    return " · ".join([c.op or "-", normalise_module(module_label(c.module)),
                       c.phase or "-", ",".join(c.input_dtypes or []) or "-",
                       report.classification or "-"])
