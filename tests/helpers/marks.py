"""Marks the suite's tests share."""
from __future__ import annotations

import pytest


def same_run(name: str):
    """Mark for the tests that read the `replayed` run of shipped bundle ``name``: one
    pytest-xdist group, so they go to one worker (scripts/test.sh: --dist loadgroup), where that
    run is done once."""
    return pytest.mark.xdist_group(f"replayed-{name}")
