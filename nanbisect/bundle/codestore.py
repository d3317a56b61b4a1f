"""The user's code carried in the bundle: the entry file and the user source files the step
imported (`nanbisect.bundle.code.user_sources`), stored under ``code/`` so that the bundle
replays on a machine without the repository.

Layout: every stored file keeps its path relative to the common root of the files stored
(``code.root`` in the manifest), so ``/home/u/repo/tasks/x.py`` and ``/home/u/repo/tasks/moe.py``
become ``code/x.py`` and ``code/moe.py``, and ``/home/u/repo/lib/y.py`` beside them makes the
root ``/home/u/repo`` (``code/tasks/x.py``, ``code/lib/y.py``). ``code.import_roots`` lists the
directories under ``code/`` that were import roots at capture (the entry's directory first, then
each ``pkg.module``'s top directory), which a replay of the stored copy puts first on
``sys.path``: the entry's ``from moe import ...`` finds the stored sibling.

The manifest's ``code`` section: ``entry_file``, ``sources`` ({path: sha256}, as before),
``root``, ``files`` ({original path: {path: "code/REL", sha256, bytes}}), ``import_roots``,
``left_out`` ({original path: why}) and ``caps``. Caps: at most `MAX_FILE_BYTES` per file,
`MAX_TOTAL_BYTES` in all and `MAX_FILES` files (the entry first, then the files under the
entry's directory, then the rest, each in path order); what does not fit is listed in
``left_out`` with the reason, as is a file that changed on disk after it was hashed (the stored
copy must be the code that ran) or one that could not be read.

Guarantees: `plan` and `store` never raise for a user file (an unreadable one is left out);
`check` refuses a manifest whose stored path is not ``code/`` followed by plain names ending in
``.py`` (no ``..``, no absolute path, no link anywhere on the way: nothing outside the bundle is
read), and with ``verify`` a stored file that is missing, not a plain file, or whose size or
sha256 differs from the manifest's, or a file under ``code/`` the manifest does not list
(``__pycache__`` aside). Not guaranteed: that the stored code imports only stored
files (a module left out, or one that was never a file, is looked for where Python finds it
now), nor, in one process that already imported a module of the same name from elsewhere, that
the stored sibling is the one imported.
"""
from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path, PurePosixPath

from nanbisect.bundle.bounded import is_uint, regular_file
from nanbisect.bundle.schema import safe_name
from nanbisect.errors import BadInput
from nanbisect.util.text import show

CODE_DIR = "code"
MAX_FILE_BYTES = 2 << 20          # one stored source file
MAX_TOTAL_BYTES = 10 << 20        # all of them, per bundle (per rank's part)
MAX_FILES = 1000
_FIX = "the manifest was altered or damaged: re-capture the bundle"


def stored_path_ok(v) -> bool:
    """Is ``v`` a path a manifest may name for a stored file: ``code/`` then plain names (no
    ``..``, ``.``, empty part, backslash or control character), ending in ``.py``?

    >>> [stored_path_ok(p) for p in ("code/a/b.py", "code/../x.py", "/code/a.py", "code/a.txt")]
    [True, False, False, False]
    """
    if not isinstance(v, str) or len(v) > 4096 or not v.endswith(".py"):
        return False
    parts = v.split("/")
    return parts[0] == CODE_DIR and len(parts) >= 2 and len(parts) <= 64 and \
        all(safe_name(x) for x in parts)


def root_ok(v) -> bool:
    """An import root under ``code/``: ``"."`` (code/ itself) or plain names joined by ``/``."""
    return isinstance(v, str) and (v == "." or (
        len(v) <= 4096 and len(v.split("/")) <= 64 and all(safe_name(x) for x in v.split("/"))))


# --------------------------------------------------------------------------------------------
# capture

def _module_root(name: str, path: Path) -> Path:
    """The directory that was on sys.path for module ``name`` found at ``path`` (its file's
    directory for a module imported by path or run as a script).

    >>> str(_module_root("pkg.mod", Path("/r/pkg/mod.py"))), str(_module_root("x", Path("/r/y.py")))
    ('/r', '/r')
    """
    if name == "__main__" or name.startswith("nanbisect_entry_"):
        return path.parent
    parts = name.split(".")
    tail = (parts + ["__init__.py"] if path.name == "__init__.py"
            else parts[:-1] + [parts[-1] + ".py"])
    if len(path.parts) <= len(tail) or list(path.parts[-len(tail):]) != tail:
        return path.parent
    return Path(*path.parts[:-len(tail)])


def _import_roots(entry: Path | None, stored: list[Path]) -> list[Path]:
    """The import roots of the stored files: the entry's directory first, then each module's."""
    by_path = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        name = getattr(mod, "__name__", None)
        if isinstance(f, str) and isinstance(name, str):
            if f.endswith(".py"):
                by_path.setdefault(Path(f).resolve(), name)
    roots = [entry.parent] if entry is not None else []
    for p in stored:
        name = by_path.get(p)
        if name is not None:
            r = _module_root(name, p)
            if r not in roots:
                roots.append(r)
    return roots


def plan(entry_file: str | None, sources: dict[str, str]) -> dict:
    """What the bundle will store of the code (the manifest's ``code`` section less each file's
    sha256 and size, which `store` fills as it copies): the files within the caps, their
    common root, the import roots, and what is left out and why.

    >>> p = plan(__file__, {str(Path(__file__).resolve()): "0" * 64})
    >>> p["files"][str(Path(__file__).resolve())], p["import_roots"]
    ({'path': 'code/codestore.py'}, ['.'])
    """
    entry = Path(entry_file).resolve() if entry_file else None
    paths = sorted({Path(p) for p in sources} | ({entry} if entry is not None else set()))
    home = entry.parent if entry is not None else None

    def rank(p: Path) -> tuple:
        return (p != entry, not (home is not None and home in p.parents), str(p))

    left_out: dict[str, str] = {}
    chosen: list[Path] = []
    total = 0
    for p in sorted(paths, key=rank):
        try:
            st = os.stat(p)
        except OSError as e:
            left_out[str(p)] = f"cannot be read ({e.strerror})"
            continue
        if not stat.S_ISREG(st.st_mode):
            left_out[str(p)] = "not a plain file"
        elif not p.is_absolute() or not all(safe_name(x) for x in p.parts[1:]):
            left_out[str(p)] = "its path cannot be stored (a name with odd characters)"
        elif st.st_size > MAX_FILE_BYTES:
            left_out[str(p)] = f"{st.st_size} bytes, over the {MAX_FILE_BYTES}-byte cap per file"
        elif total + st.st_size > MAX_TOTAL_BYTES:
            left_out[str(p)] = f"over the {MAX_TOTAL_BYTES}-byte cap on all stored files"
        elif len(chosen) >= MAX_FILES:
            left_out[str(p)] = f"over the cap of {MAX_FILES} stored files"
        else:
            chosen.append(p)
            total += st.st_size
    out = {"caps": {"file_bytes": MAX_FILE_BYTES, "total_bytes": MAX_TOTAL_BYTES,
                    "files": MAX_FILES}, "left_out": left_out, "files": {},
           "import_roots": []}
    if not chosen:
        return out
    root = Path(os.path.commonpath([str(p.parent) for p in chosen]))
    out["root"] = str(root)
    for p in chosen:
        out["files"][str(p)] = {"path": f"{CODE_DIR}/{p.relative_to(root).as_posix()}"}
    for r in _import_roots(entry, chosen):
        try:
            rel = r.relative_to(root).as_posix()
        except ValueError:
            continue
        out["import_roots"].append(rel if rel else ".")
    return out


def store(into: Path, section: dict | None, sources: dict[str, str]) -> dict | None:
    """Copy the files ``section`` (a `plan`, as in the manifest) lists into ``into`` (the bundle
    being written) and return the section with each file's sha256 and size; a file that cannot
    be read, grew past a cap, or whose bytes are not the ones ``sources`` hashed (it changed
    on disk since) moves to ``left_out``. None: nothing to store."""
    if not isinstance(section, dict) or not isinstance(section.get("files"), dict):
        return section
    out = {**section, "files": {}, "left_out": dict(section.get("left_out") or {})}
    total = 0
    for orig, info in section["files"].items():
        rel = info.get("path") if isinstance(info, dict) else None
        if not stored_path_ok(rel):
            out["left_out"][orig] = "its path cannot be stored"
            continue
        try:
            with open(orig, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            out["left_out"][orig] = f"cannot be read ({e.strerror})"
            continue
        digest = hashlib.sha256(data).hexdigest()
        if len(data) > MAX_FILE_BYTES or total + len(data) > MAX_TOTAL_BYTES:
            out["left_out"][orig] = "grew past the caps while the bundle was written"
        elif orig in sources and sources[orig] != digest:
            out["left_out"][orig] = ("changed on disk after the capture hashed it (the stored "
                                     "copy would not be the code that ran)")
        else:
            dest = into.joinpath(*rel.split("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            out["files"][orig] = {"path": rel, "sha256": digest, "bytes": len(data)}
            total += len(data)
    return out


# --------------------------------------------------------------------------------------------
# reading

def check(p: Path, manifest: dict, verify: bool) -> None:
    """`BadInput` unless every stored file the manifest's ``code.files`` names is a path inside
    ``p``'s ``code/`` (`stored_path_ok`) with sha256 and size; with ``verify``, also a plain file
    there, reached through no symbolic link, of that size and sha256 (a size over the cap is
    refused before anything is read), and no other file under ``code/`` (cached bytecode
    included)."""
    code = manifest.get("code")
    files = code.get("files") if isinstance(code, dict) else None
    if files is None:
        return
    for orig, info in files.items():
        rel = info.get("path") if isinstance(info, dict) else None
        if not stored_path_ok(rel) or not isinstance(info.get("sha256"), str) or \
                not is_uint(info.get("bytes")):
            raise BadInput(f"bundle '{p}': the manifest's stored copy of {show(orig, 80)} is "
                           f"not {{path: 'code/...py' inside the bundle, sha256, bytes}}; {_FIX}")
    if not verify:
        return
    for orig, info in files.items():
        parts = info["path"].split("/")
        for i in range(1, len(parts)):
            d = p.joinpath(*parts[:i])
            if os.path.islink(d) or (os.path.lexists(d) and not d.is_dir()):
                raise BadInput(f"bundle '{p}': {'/'.join(parts[:i])} is a symbolic link or not a "
                               "directory; a bundle holds only plain files: copy the whole "
                               "bundle again or re-capture it")
        f = p.joinpath(*parts)
        if not os.path.lexists(f):
            raise BadInput(f"bundle '{p}': the stored copy of the code {info['path']} is missing; "
                           "copy the whole bundle directory (code/ included) or re-capture it")
        if info["bytes"] > MAX_FILE_BYTES:    # the cap before any byte of it is read
            raise BadInput(f"bundle '{p}': {info['path']} claims {info['bytes']} bytes, over "
                           f"the {MAX_FILE_BYTES}-byte cap of a stored file; {_FIX}")
        st = regular_file(f, f"bundle '{p}': {info['path']}")
        if st.st_size != info["bytes"] or _sha256_bounded(f, info["bytes"]) != info["sha256"]:
            raise BadInput(f"bundle '{p}': {info['path']} does not match its sha256 in the "
                           "manifest (truncated or altered); copy the bundle again or "
                           "re-capture it")
    _unlisted(p, {info["path"] for info in files.values()})


def _unlisted(p: Path, listed: set[str]) -> None:
    """`BadInput` naming the first file under ``p``'s ``code/`` that the manifest does not list,
    cached bytecode (``__pycache__/*.pyc``, a ``.pyc`` beside the sources) included: a replay of
    the stored copy could import it, unchecked, instead of the source a reader sees."""
    top = p / CODE_DIR
    if not top.is_dir() or os.path.islink(top):
        return
    for d, dirs, names in os.walk(top):
        dirs[:] = sorted(dirs)      # NB: __pycache__ too: a replay writes no bytecode there
        for name in sorted(names) + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            rel = Path(d, name).relative_to(p).as_posix()
            if rel not in listed:
                raise BadInput(f"bundle '{p}': {rel} is not a stored copy the manifest lists "
                               "(a replay could import it unchecked); remove it, or copy the "
                               "bundle again or re-capture it")


def _sha256_bounded(f: Path, size: int) -> str:
    """sha256 of at most ``size + 1`` bytes of ``f``, read in chunks (never all at once)."""
    h, left = hashlib.sha256(), size + 1
    with open(f, "rb") as fh:
        while left > 0 and (chunk := fh.read(min(left, 1 << 20))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def stored_copy(p: Path, manifest: dict, original: str | None) -> Path | None:
    """Where the bundle at ``p`` keeps its copy of the file ``original`` (None: not stored)."""
    code = manifest.get("code")
    files = code.get("files") if isinstance(code, dict) else None
    info = files.get(original) if isinstance(files, dict) and original else None
    if not isinstance(info, dict) or not stored_path_ok(info.get("path")):
        return None
    f = p.joinpath(*info["path"].split("/"))
    return f if f.is_file() else None


def carries_code(manifest: dict) -> bool:
    """Does the manifest list stored copies of its code (a bundle of this nanbisect)?"""
    code = manifest.get("code")
    return isinstance(code, dict) and bool(code.get("files"))


def import_roots(p: Path, manifest: dict) -> list[Path]:
    """The directories to put first on sys.path for a replay of the stored copy, in order."""
    code = manifest.get("code") or {}
    out = []
    for r in code.get("import_roots") or []:
        if root_ok(r):
            d = p / CODE_DIR if r == "." else p.joinpath(CODE_DIR, *PurePosixPath(r).parts)
            out.append(d)
    return out or [p / CODE_DIR]


def left_out_text(manifest: dict, limit: int = 3) -> str | None:
    """The files the bundle's code section left out, a few with their reasons, on one line."""
    code = manifest.get("code")
    left = code.get("left_out") if isinstance(code, dict) else None
    if not isinstance(left, dict) or not left:
        return None
    shown = "; ".join(f"{Path(k).name}: {v}" for k, v in list(left.items())[:limit])
    more = f" and {len(left) - limit} more" if len(left) > limit else ""
    return f"{len(left)} source file(s) not stored ({shown}{more})"
