"""Culprit signatures: what groups two failures together across a night of bundles.

A culprit's signature is ``ORIGIN @ FILE:LINE · MODULE · PHASE · DTYPES · CLASSIFICATION``:

- ORIGIN: for a backward culprit whose report names its autograd node (``culprit.node``), the
  node (``DivBackward0``); else the culprit op without its overload (``aten.div``, not
  ``aten.div.Tensor``): a different batch can make the first NaN in another aten op of the same
  node, or in another overload of the same op;
- FILE:LINE: the user line that made it (the node's ``forward_source``, else
  ``culprit.source``), the file's base name only (the same code checked out elsewhere groups
  together); ``@ ...`` is left out when no line is known;
- MODULE with layer numbers as ``N`` (`normalise_module`), the phase, the culprit's input
  dtypes (each once, sorted: not per argument, which differs between ops), the classification.

Versions: `legacy_signature` is the form before this one (``aten.div.Tensor · MODULE · PHASE
· float32,float32 · CLASSIFICATION``, issue 38 item 8). A ``--known`` list or last night's
triage.json written with it still matches: `nanbisect.triage.summary` counts a group as known
when its signature or the legacy one of any of its bundles is listed.
"""
from __future__ import annotations

import re

from nanbisect.records import module_label


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


def _non_culprit(report: dict) -> str | None:
    if report.get("verdict") == "input-nonfinite":
        return "input-nonfinite · data"
    if report.get("verdict") == "not-reproduced":
        # code-changed, replay-mismatch, unknown and transient are different nights
        return f"not-reproduced · {report.get('classification') or 'unknown'}"
    return None


def signature(report: dict) -> str | None:
    """The report's signature (None: a clean replay).

    >>> c = {"op": "aten.div.Tensor", "module": "", "phase": "backward",
    ...      "input_dtypes": ["float32", "float32"], "source": "/srv/loss.py:42",
    ...      "node": {"name": "DivBackward0", "forward_op": "aten.div.Tensor",
    ...               "forward_source": "loss.py:42"}}
    >>> signature({"verdict": "culprit", "classification": "numerics", "culprit": c})
    'DivBackward0 @ loss.py:42 · <root> · backward · float32 · numerics'
    >>> c = {**c, "op": "aten.mul.Tensor", "input_dtypes": ["float32"]}   # another batch
    >>> signature({"verdict": "culprit", "classification": "numerics", "culprit": c})
    'DivBackward0 @ loss.py:42 · <root> · backward · float32 · numerics'
    """
    c = report.get("culprit")
    if report.get("verdict") != "culprit" or not isinstance(c, dict):
        return _non_culprit(report)
    node = c.get("node") if isinstance(c.get("node"), dict) else None
    if node is not None and isinstance(node.get("name"), str) and node["name"]:
        origin = node["name"]
        line = source_line(node.get("forward_source")) or source_line(c.get("source"))
    else:
        origin = op_packet(c.get("op")) or "-"
        line = source_line(c.get("source"))
    dtypes = sorted({str(d) for d in (c.get("input_dtypes") or []) if d})
    return " · ".join([origin + (f" @ {line}" if line else ""),
                       normalise_module(module_label(c.get("module"))), c.get("phase") or "-",
                       ",".join(dtypes) or "-", report.get("classification") or "-"])


def legacy_signature(report: dict) -> str | None:
    """The signature as nanbisect wrote it before `signature`'s form (the exact aten overload
    of the culprit op, its input dtypes per argument): what older ``--known`` lists and
    triage.json files hold."""
    c = report.get("culprit")
    if report.get("verdict") != "culprit" or not isinstance(c, dict):
        return _non_culprit(report)
    return " · ".join([c.get("op") or "-", normalise_module(module_label(c.get("module"))),
                       c.get("phase") or "-", ",".join(c.get("input_dtypes") or []) or "-",
                       report.get("classification") or "-"])
