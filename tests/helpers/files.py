"""Files: age a tree, digest one (to show it was left untouched)."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path


def aged(*paths, seconds=3 * 86400) -> None:
    """Set every file and directory under ``paths`` (and they) to ``seconds`` ago."""
    old = time.time() - seconds
    for p in paths:
        for q in sorted(Path(p).rglob("*"), reverse=True) + [Path(p)]:
            os.utime(q, (old, old), follow_symlinks=False)


def tree_digest(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256): to show a tree was left untouched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}
