"""Guard inside other people's training loops: `lightning` and `hf` (each imports its framework
only when used)."""
from __future__ import annotations

import logging

from nanbisect.errors import NonFiniteStep

log = logging.getLogger("nanbisect")


def close_step(cm) -> NonFiniteStep | None:
    """Leave an open `Guard.watch` context: None when the step was finite, else the
    `NonFiniteStep` (logged; its ``bundle`` is None when none could be written anywhere), so the
    caller can ask its trainer to stop instead of raising from a hook."""
    try:
        cm.__exit__(None, None, None)
    except NonFiniteStep as e:
        log.error("nanbisect: %s", e)
        return e
    return None
