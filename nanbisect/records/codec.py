"""One codec for the records that cross a process boundary as JSON (a multi-rank worker's
`RankResult` to its launcher), derived from the dataclass's typed fields, so the writer and the
reader cannot drift apart.

Guarantees: ``decode(cls, encode(r)) == r`` for a frozen dataclass ``r`` whose fields are
``None``, ``bool``, ``int``, ``float``, ``str``, records (nested dataclasses), ``list[X]`` and
``dict[str, X]`` of those, and unions of them with ``None``; a non-finite float is written as
``"nan"``/``"inf"``/``"-inf"`` (`nanbisect.util.recordjson`) and read back as a float where the
field is typed ``float`` without ``str``. A nested record whose class has its own ``to_json``
and ``from_json`` (`Culprit`, `OpCheck`, `Remedy`, ...) is written and read by them; the record given to
`encode`/`decode` itself is always derived from its fields (its own ``to_json`` may call them). A key the
reader does not know is ignored, a field the writer left out takes its default.
Not guaranteed: fields typed ``Any``, tuples, sets or unions of two records (none cross).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar, Union

from nanbisect.util.recordjson import encode as encode_numbers
from nanbisect.util.recordjson import number

R = TypeVar("R")


def _own_codec(cls: type) -> bool:
    return "to_json" in vars(cls) and "from_json" in vars(cls)


def encode(record: Any) -> Any:
    """``record`` as JSON-ready values (strict JSON: non-finite floats as words).

    >>> from nanbisect.records import Stats
    >>> encode(Stats(0, 1, 0, float("inf")))
    {'nan': 0, 'posinf': 1, 'neginf': 0, 'absmax': 'inf', 'abssum': 0.0}
    """
    def plain(v: Any, top: bool = False) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if _own_codec(type(v)) and not top:
                return v.to_json()
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return encode_numbers(plain(record, top=True))


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _decode(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    opts = [t for t in _options(tp) if t is not type(None)]
    if float in opts and str not in opts:
        v = number(v)
        if isinstance(v, float) and not math.isfinite(v):
            return v
    for t in opts:
        origin = typing.get_origin(t)
        if origin is list and isinstance(v, list):
            (item,) = typing.get_args(t) or (Any,)
            return [_decode(item, x) for x in v]
        if origin is dict and isinstance(v, dict):
            _, item = typing.get_args(t) or (str, Any)
            return {k: _decode(item, x) for k, x in v.items()}
        if isinstance(t, type) and dataclasses.is_dataclass(t) and isinstance(v, dict):
            return t.from_json(v) if _own_codec(t) else decode(t, v)
    return v


def decode(cls: type[R], data: dict) -> R:
    """The record of ``cls`` that `encode` wrote as ``data``.

    >>> from nanbisect.records import Stats
    >>> decode(Stats, {"nan": 0, "posinf": 1, "neginf": 0, "absmax": "inf"})
    Stats(nan=0, posinf=1, neginf=0, absmax=inf, abssum=0.0)
    """
    hints = _hints(cls)
    return cls(**{f.name: _decode(hints[f.name], data[f.name])
                  for f in dataclasses.fields(cls) if f.init and f.name in data})
