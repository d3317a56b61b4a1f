"""The words and numbers every record and report shares: JSON numbers (`json_number`), the
report contract's closed word sets (`Verdict`, `Classification`), and how the top-level module
is named (`ROOT`, `module_label`).
"""
from __future__ import annotations

from enum import Enum

from nanbisect.util.recordjson import json_number  # noqa: F401 - its home is there


class Word(str, Enum):
    """A word of the report contract: a ``str`` (JSON, comparisons and f-strings see its
    value), drawn from a closed set (a misspelt one fails where it is made)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
    __hash__ = str.__hash__     # NB: Enum hashes the name; a dict keyed by the value must

class Verdict(Word):
    """report.json ``verdict``.

    >>> Verdict("culprit") == "culprit", f"{Verdict.NOT_REPRODUCED}"
    (True, 'not-reproduced')
    """

    CULPRIT = "culprit"
    CLEAN = "clean"
    NOT_REPRODUCED = "not-reproduced"
    INPUT_NONFINITE = "input-nonfinite"

class Classification(Word):
    """report.json ``classification`` (what each means: DESIGN.md; each must be earned)."""

    DEVICE = "device"                    # the op, same inputs and dtype, wrong on the target
    NUMERICS = "numerics"                # the arithmetic at that dtype fails on any device
    DATA = "data"                        # the batch or a loaded state held it already
    TRANSIENT = "transient"              # faithful replay, the failure does not come back
    COMMUNICATION = "communication"      # finite into a collective, non-finite out of it
    CODE_CHANGED = "code-changed"        # the user's code differs from the capture's
    REPLAY_MISMATCH = "replay-mismatch"  # the replay does not compute the captured step
    COMPILER = "compiler"                # fails compiled, not eager, from the same state
    UNKNOWN = "unknown"                  # not enough evidence

ROOT = "<root>"   # how reports name the top-level module (JSON: "")

def module_label(name: str | None) -> str:
    """A module's dotted name as the reports print it: ``ROOT`` for the top-level module, that
    is, code outside any submodule (the model's own forward, the loss function); JSON keeps
    ``""`` (DESIGN.md)."""
    return name or ROOT
