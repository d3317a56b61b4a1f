"""Numbers read from ``NANBISECT_*`` environment variables, as they are at the call.

Guarantees: a value that is not a number (or, with ``positive``, not more than 0) is `BadInput`
naming the variable, its value and the fix; nothing is cached.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

from nanbisect.errors import BadInput
from nanbisect.util.text import show

T = TypeVar("T", int, float)


def env_number(name: str, default, parse: Callable[[str], T] = float, *, what: str, fix: str,
               positive: bool = True, empty_is_default: bool = True,
               shown: Callable[[str], str] = show):
    """``parse(os.environ[name])``, or ``default`` when the variable is unset (or empty, with
    ``empty_is_default``); otherwise `BadInput` ``"NAME=VALUE is not WHAT; FIX"``.

    >>> import os
    >>> os.environ["NANBISECT_EXAMPLE"] = "0"
    >>> env_number("NANBISECT_EXAMPLE", 5, int, what="a positive integer", fix="set it to 5")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: NANBISECT_EXAMPLE='0' is not a positive integer; set it to 5
    >>> del os.environ["NANBISECT_EXAMPLE"]
    """
    raw = os.environ.get(name)
    if raw is None or (empty_is_default and not raw):
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or (positive and not value > 0):
        raise BadInput(f"{name}={shown(raw)} is not {what}; {fix}")
    return value
