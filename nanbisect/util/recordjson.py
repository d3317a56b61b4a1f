"""The one JSON encoding of every record nanbisect writes for people's scripts and its own
processes: report.json (and `run --json`), the multi-rank rank files, triage.json and its cache.

Guarantees: the output is strict JSON (RFC 8259: no ``NaN`` or ``Infinity`` tokens, which most
parsers outside Python refuse); a float that is not finite, wherever it sits in the record, is
written as the string ``"nan"``, ``"inf"`` or ``"-inf"`` (DESIGN.md, contract v4), and
`number` reads those strings back as floats.
Not guaranteed: that a reader can tell the string ``"nan"`` written for a float from a field
whose value is the word "nan" (``kind``): readers turn back only the fields they know are
numbers. The bundle manifest is another format with writers of its own (`nanbisect.bundle`).
"""
from __future__ import annotations

import json
import math
from typing import Any

WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_number(x: float | None) -> float | str | None:
    """A float as JSON: itself when finite, else ``"nan"``, ``"inf"`` or ``"-inf"``.

    >>> json_number(float("inf")), json_number(0.5), json_number(None), json_number(-1e999)
    ('inf', 0.5, None, '-inf')
    """
    if x is None or isinstance(x, str) or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def encode(value: Any) -> Any:
    """``value`` with every non-finite float inside it (dict values, list and tuple items, at
    any depth) made `json_number`'s string; tuples become lists, the rest is kept as it is.

    >>> encode({"a": [1.0, float("nan")], "b": (float("-inf"), "nan", None)})
    {'a': [1.0, 'nan'], 'b': ['-inf', 'nan', None]}
    """
    if isinstance(value, float):
        return json_number(value)
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def dumps(value: Any, **kw: Any) -> str:
    """``json.dumps`` of `encode` (value): strict JSON whatever numbers the record holds.

    >>> dumps({"abssum": float("inf"), "loss": 0.5})
    '{"abssum": "inf", "loss": 0.5}'
    """
    return json.dumps(encode(value), allow_nan=False, **kw)


def number(v: Any) -> Any:
    """A number field read back: ``"nan"``, ``"inf"``, ``"-inf"`` as floats, anything else as
    it is.

    >>> number("inf"), number(2), number(None), number("x")
    (inf, 2, None, 'x')
    """
    return WORDS[v] if isinstance(v, str) and v in WORDS else v
