"""Code identity: which user source files a step ran, by sha256, and which of them differ now.

A bundle replays through the entry's code, so a replay is only the captured step if that code is
the same. `user_sources` lists the entry file and every source file of a module the process has
imported that is not the standard library, not an installed package (site-packages) and not torch
or nanbisect, with its sha256. `changed_sources` compares such a record with the files on disk
now. Not guaranteed: code that never came from a file (``exec``, notebooks), or a file edited
after it was imported and before the capture (the hash is of the file, read at capture).
"""
from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

from nanbisect.util.files import file_sha256

_OWN = Path(__file__).resolve().parent.parent          # nanbisect/


def _excluded_roots() -> list[Path]:
    roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(getattr(site, "getsitepackages", lambda: [])())
    roots.add(getattr(site, "getusersitepackages", lambda: None)())
    roots |= {sys.base_prefix + "/lib", sys.prefix + "/lib"}
    out = [Path(r).resolve() for r in roots if r]
    try:
        import torch

        out.append(Path(torch.__file__).resolve().parent)
    except ImportError:
        pass
    return out + [_OWN]



def _is_user(path: Path, excluded: list[Path]) -> bool:
    return path.suffix == ".py" and not any(
        path == root or root in path.parents for root in excluded) and \
        "site-packages" not in path.parts and "dist-packages" not in path.parts


def is_user_file(path: Path) -> bool:
    """Whether ``path`` (resolved) is a user source file as `user_sources` counts them: a
    ``.py`` file outside the standard library, installed packages, torch and nanbisect.

    >>> is_user_file(Path(__file__).resolve())      # nanbisect's own
    False
    """
    return _is_user(path, _excluded_roots())


def user_sources(entry_file: str | None = None) -> dict[str, str]:
    """``{absolute path: sha256}`` of the entry file and every imported user source file.

    >>> src = user_sources(__file__)
    >>> src[str(Path(__file__).resolve())] == file_sha256(Path(__file__))
    True
    """
    excluded = _excluded_roots()
    paths = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if isinstance(f, str) and f.endswith(".py"):
            p = Path(f).resolve()
            if _is_user(p, excluded):
                paths.add(p)
    if entry_file:
        paths.add(Path(entry_file).resolve())
    out = {}
    for p in sorted(paths):
        digest = file_sha256(p, missing_ok=True)
        if digest is not None:
            out[str(p)] = digest
    return out


def relocation(captured: str | None, now: str | None) -> tuple[Path, Path] | None:
    """(old root, new root) when the entry file moved (a copied checkout, another machine):
    the paths minus their longest common tail, so /a/repo/tasks/x.py -> /b/repo/tasks/x.py
    maps /a to /b. None when nothing moved or it cannot tell.

    >>> relocation("/a/repo/t/x.py", "/b/c/repo/t/x.py")
    (PosixPath('/a'), PosixPath('/b/c'))
    """
    if not captured or not now:
        return None
    old, new = Path(captured).parts, Path(now).resolve().parts
    k = 0
    while k < min(len(old), len(new)) and old[-1 - k] == new[-1 - k]:
        k += 1
    if k == 0 or len(old) == k or len(new) == k:
        return None
    root_old, root_new = Path(*old[:-k]), Path(*new[:-k])
    return None if root_old == root_new else (root_old, root_new)


def changed_sources(recorded: dict[str, str], moved: tuple[Path, Path] | None = None
                    ) -> tuple[list[str], list[str]]:
    """(files that differ on disk now, files not found now), of the recorded ones. A file under
    the old root of ``moved`` (see `relocation`) is looked for under the new root first.

    >>> changed_sources({__file__: "0" * 64, "/no/such.py": "0" * 64})
    ([...code.py'], ['/no/such.py'])
    """
    changed, missing = [], []
    for path, digest in sorted(recorded.items()):
        p = Path(path)
        if moved is not None:
            try:
                p = moved[1] / p.relative_to(moved[0])
            except ValueError:
                pass
        if not p.is_file():
            p = Path(path)
        now = file_sha256(p, missing_ok=True) if p.is_file() else None
        if now is None:
            missing.append(path)
        elif now != digest:
            changed.append(str(p))
    return changed, missing
