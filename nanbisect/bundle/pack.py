"""`nanbisect pack` / `nanbisect unpack`: one archive for a bug ticket, and a safe way to open one.

A pack holds report.md and report.json, the standalone repro, the bundle's manifest(s) and an
environment summary (Python, torch, devices and driver versions, the environment variables that
change numerics or communication), and the stored copies of the user's code (the bundle's
``code/``, `nanbisect.bundle.codestore`). By default it leaves out the model and optimizer state
and stays under `LIMIT` bytes; ``full=True`` adds the whole bundle; `pack` says what it left
out and why. `pack` writes a hidden temporary
file beside the archive and renames it into place (removed on any error, with any directory it
created for it). Its first member, pack.json, lists every other member with its size and
sha256.

Guarantees of `pack` (it never replaces or deletes what it did not write): it refuses a
destination that exists (a directory, a link, a special file, or a file: only with
``force=True``, and then only a file proven, over the whole file, to be an archive `pack`
wrote and nothing else, `is_pack`; checked again just before it is replaced), one inside the
directory being packed or inside any bundle; a failure to write (no room, a read-only or busy
file system, no permission) is a one-line `BadInput` and leaves nothing behind, and the first
error is the one reported (a full disk failing again as the half-written file is closed never
replaces it); a file that changes while it is packed is refused, not packed half-old.

Guarantees of `unpack` (archives from anyone): it streams (decompresses and writes one chunk at a
time, memory stays flat whatever the archive holds); it reads at most ``max_bytes`` uncompressed
bytes (default `default_max_bytes`: 50x the archive, at least 64 MiB, at most 4 GiB unless the
archive is over 2 GiB, then 2x its size; ``--max-bytes`` or `ENV_MAX_BYTES` override), so a
compression bomb stops early having written at most that; it refuses the whole archive for an
absolute or ``..`` path, an empty or ``.`` name, a link, device or sparse file, a duplicate
member, an oversized extended header, more than `MAX_MEMBERS` members, a truncated or damaged
stream (gzip CRC and length are checked to the end; a tar without its end-of-archive marker is
truncated); a write that fails (no room, read-only, no permission) is that one-line error,
never masked by the same failure again as the file is closed; it writes into a hidden staging
directory beside ``dest`` and renames it only when everything is written, so a refusal leaves
nothing behind; it never writes into a ``dest`` that exists and is not an empty directory;
files get the user's umask (never the archive's modes).
Not guaranteed: case-insensitive file systems (``A`` and ``a`` are two members here, one file
there), and a pack's contents being what its report claims (anyone can write a pack).
"""
from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import re
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import Callable

from nanbisect import __version__
from nanbisect.bundle.atomic import rename_noreplace
from nanbisect.bundle.packlimits import (_CHUNK, BIG_RATIO, CEILING_BYTES,  # noqa: F401
                                         ENV_MAX_BYTES, FLOOR_BYTES, MAX_MEMBERS, MAX_META_BYTES,
                                         MAX_NAME_PARTS, PACK_SCHEMA, RATIO, XZ_MEMLIMIT,
                                         default_max_bytes)
from nanbisect.bundle.packproof import (FORCE_MAX_BYTES, MAX_PACK_JSON,  # noqa: F401
                                        _not_a_pack, check_dest, is_pack)
from nanbisect.bundle.untar import (_cannot_write, _Capped, _check_name,  # noqa: F401
                                    _copy, _decompressed, _strict_tarinfo)
from nanbisect.bundle.where import MANIFEST
from nanbisect.errors import BadInput
from nanbisect.util.numbers import NUMBERS, env
from nanbisect.util.files import file_sha256, remove_made
from nanbisect.util.staging import MARKER as STAGING_MARKER
from nanbisect.util.staging import make_staging_dir, staging_name, staging_path, unmark
from nanbisect.util.text import show

LIMIT = 10 * 1024 * 1024
CODE_DIR = "code"     # the stored code (`nanbisect.bundle.codestore.CODE_DIR`; not imported
                      # here: it imports torch, and pack's checks answer without it)
OPTIONAL = ("rng.safetensors", "batch.safetensors")   # kept while the pack stays under LIMIT
ENV_PATTERN = re.compile(r"^(TORCH|CUDA|NCCL|HCCL|ASCEND|OMP|MKL|ATEN|CUBLAS|CUDNN|PYTORCH|NVIDIA|"
                         r"NANBISECT|XLA|HIP|ROCM)_|^(WORLD_SIZE|RANK|LOCAL_RANK|MASTER_ADDR|"
                         r"MASTER_PORT)$")


def environment_summary() -> dict:
    """What a maintainer asks first: versions, devices, drivers, relevant variables."""
    import torch    # NB: here, not above: pack's and unpack's checks answer without torch

    from nanbisect import devices
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "nanbisect": __version__,
           **devices.environment(), "threads": torch.get_num_threads()}
    env["hardware"] = devices.fingerprint()    # what a replay elsewhere is compared by
    env["variables"] = {k: v for k, v in sorted(os.environ.items()) if ENV_PATTERN.search(k)}
    return env


def _members(src: Path, full: bool) -> list[tuple[Path, str]]:
    """(file, name in archive) pairs for a bundle or a report directory."""
    src = src.resolve()
    if (src / "report.json").is_file():        # a report directory, inside its bundle or not
        report, bundle = src, src.parent if (src.parent / MANIFEST).is_file() else None
    elif (src / MANIFEST).is_file():
        report, bundle = src / "nanbisect-report", src
        if not (report / "report.json").is_file():
            raise BadInput(f"pack: '{src}' has no report yet; run `nanbisect run {src}` "
                           "first")
    else:
        raise BadInput(f"pack: '{src}' is neither a bundle nor a report directory; pass the "
                       "directory holding manifest.json or report.json")
    out = [(f, f"report/{f.relative_to(report).as_posix()}") for f in sorted(report.rglob("*"))
           if f.is_file() and not f.is_symlink()]
    if bundle is not None:
        code = _stored_code(bundle)
        for f in sorted(bundle.rglob("*")):
            rel = f.relative_to(bundle)
            if not f.is_file() or f.is_symlink() or rel.parts[0] == "nanbisect-report":
                continue
            if full or f.name == MANIFEST or f.name in OPTIONAL or rel.as_posix() in code:
                out.append((f, f"bundle/{rel.as_posix()}"))
    return out


def _stored_code(bundle: Path) -> set[str]:
    """The stored copies of the user's code in ``bundle`` (`nanbisect.bundle.codestore`): the
    paths, relative to ``bundle``, that its manifest's ``code.files`` (or a rank part's, in
    ``rankN/code/``) lists under ``code/``. Always packed: a ticket replays where the repository
    is not. A file under ``code/`` that no manifest lists is not packed (without ``--full``)."""
    out: set[str] = set()
    for m in [bundle / MANIFEST, *sorted(bundle.glob(f"*/{MANIFEST}"))]:
        try:
            files = json.loads(m.read_text(encoding="utf-8"))["code"]["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        prefix = "" if m.parent == bundle else f"{m.parent.name}/"
        for info in files.values() if isinstance(files, dict) else ():
            rel = info.get("path") if isinstance(info, dict) else None
            if isinstance(rel, str) and rel.startswith(f"{CODE_DIR}/") and rel.endswith(".py") \
                    and ".." not in rel.split("/"):
                out.add(prefix + rel)
    return out


def _code_left_out(src: Path) -> list[str]:
    """What a pack of ``src`` leaves out of the user's code, and why, from the bundle's (or its
    first part's) manifest: files over the caps or changed since the capture, or all of it
    when the bundle carries no copy (captured by an older nanbisect)."""
    # NB: here: they import torch
    from nanbisect.bundle.codestore import carries_code, left_out_text
    from nanbisect.bundle.format import read_manifest

    bundle = src.resolve()
    bundle = bundle if (bundle / MANIFEST).is_file() else bundle.parent
    if not (bundle / MANIFEST).is_file():
        return []
    try:
        manifest = read_manifest(bundle)
        if manifest.get("kind") == "multi-rank":
            first = min(manifest.get("ranks") or {"0": {}}, key=lambda r: int(r))
            manifest = read_manifest(bundle / f"rank{first}")
    except (BadInput, ValueError):
        return []
    if not carries_code(manifest):
        return ["the user's code: the bundle carries no copy of it (captured by an older "
                "nanbisect); the ticket replays only where the same code sits at the same path"]
    text = left_out_text(manifest, limit=5)
    return [f"the user's code: {text}"] if text else []


def pack(src: str | Path, dest: str | Path, full: bool = False, force: bool = False,
         say: Callable[[str], None] | None = None) -> Path:
    """Write ``dest`` (.tar.gz) for a ticket; refuse to exceed `LIMIT` unless ``full``.

    ``dest`` must be new; ``force`` replaces a file there only when it is a pack (`is_pack`).
    pack.json, the first member, lists every other member with its size and sha256. The
    stored copies of the user's code (``code/``) are packed also without ``full``. Once the
    archive is written, ``say`` (the command's stderr; default: nobody, pack.json's
    ``left_out`` holds the same) is told what was left out and why: the model and optimizer
    state without ``full``, the batch or RNG over `LIMIT`, code
    the bundle did not store.

    >>> import tempfile; from nanbisect.pipeline import RunOptions, run_bundle
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = run_bundle("fixtures/bundles/nan_batch", RunOptions(), d / "report")
    >>> pack(d / "report", d / "ticket.tar.gz").name
    'ticket.tar.gz'
    """
    src, given = Path(src), Path(dest)
    if not src.is_dir():
        raise BadInput(f"pack: '{src}' is not a directory; pass a bundle or report directory")
    dest = check_dest(given, src, force)
    members, left_out = _within_limit(_members(src, full), full)
    env = json.dumps(environment_summary(), indent=1).encode()
    listed = [{"name": "environment.json", "size": len(env),
               "sha256": hashlib.sha256(env).hexdigest()}]
    for f, name in members:    # NB: before writing: pack.json comes first and lists them all
        size, digest = _file_digest(f)
        listed.append({"name": name, "size": size, "sha256": digest})
    code = _code_left_out(src)
    head = {"schema": PACK_SCHEMA, "full": full, "left_out": [*left_out, *code],
            "left_out_always": [] if full else ["model and optimizer state (use --full)"],
            "members": listed}
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]  # innermost first
    tmp, done = staging_path(dest), False
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _write_tar(tmp, head, env, members)
        _place(tmp, dest, given, src, force)
        done = True
        for line in _left_out_lines(full, left_out, code) if say is not None else []:
            say(line)
    except OSError as e:
        raise BadInput(f"pack: cannot write '{given}' ({e.strerror or e}); nothing was "
                       "written: pass -o with a path you can write to, on a file system with "
                       "room for the archive") from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            remove_made(made)
    return dest


def _left_out_lines(full: bool, left_out: list[str], code: list[str]) -> list[str]:
    """What `pack` says it left out, one line each."""
    out = [] if full else ["nanbisect: pack: left out the model and optimizer state (without "
                           "--full): the ticket holds the repro (report/repro/repro.py); pass "
                           "--full for a ticket that replays with nanbisect run"]
    out += [f"nanbisect: pack: left out {name}: the ticket would exceed {LIMIT} bytes"
            for name in left_out]
    return out + [f"nanbisect: pack: left out {line}" for line in code]


def _within_limit(members: list[tuple[Path, str]], full: bool
                  ) -> tuple[list[tuple[Path, str]], list[str]]:
    """(the members a pack holds, the names left out): without ``full``, the `OPTIONAL` files
    left out, largest first, until the pack fits `LIMIT` (the stored code not counted: it has
    caps of its own); `BadInput` when it still does not."""
    # NB: the stored code does not count: `codestore` caps it on its own
    size = sum(f.stat().st_size for f, name in members
               if CODE_DIR not in name.split("/")[1:3] or not name.endswith(".py"))
    left_out = []
    if not full:
        for f, name in sorted((m for m in members if m[0].name in OPTIONAL),
                              key=lambda m: -m[0].stat().st_size):
            if size <= LIMIT:
                break
            members.remove((f, name))
            size -= f.stat().st_size
            left_out.append(name)
    if not full and size > LIMIT:
        big = max(members, key=lambda m: m[0].stat().st_size)
        raise BadInput(f"pack: {size} bytes exceed the {LIMIT}-byte ticket limit (largest: "
                       f"{big[1]}); pass --full to include everything anyway")
    return members, left_out


def _write_tar(tmp: Path, head: dict, env: bytes, members: list[tuple[Path, str]]) -> None:
    """The archive at ``tmp``: pack.json (``head``) first, environment.json, then each member,
    checked against the size and sha256 ``head`` lists for it as it is written."""
    with _tar_gz(tmp) as tar:
        # NB: pack.json first: `is_pack` reads it before any other member
        for name, data in (("pack.json", json.dumps(head, indent=1).encode()),
                           ("environment.json", env)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
        for (f, name), entry in zip(members, head["members"][1:]):
            try:
                fobj = open(f, "rb")
            except OSError as e:
                raise _cannot_read(f, e) from None
            with fobj:
                info = tar.gettarinfo(arcname=name, fileobj=fobj)
                if info.size != entry["size"]:
                    raise _changed(f)
                reader = _Hashing(fobj, f, info.size)
                tar.addfile(info, reader)
                if reader.sha256.hexdigest() != entry["sha256"]:
                    raise _changed(f)


def _place(tmp: Path, dest: Path, given: Path, src: Path, force: bool) -> None:
    """Rename the written archive into place: over an earlier pack only with ``force`` (checked
    again just before), else only where nothing is."""
    if force and dest.exists():
        check_dest(given, src, force)    # NB: again, just before it is replaced
        os.replace(tmp, dest)
    else:
        try:
            rename_noreplace(tmp, dest)
        except FileExistsError:
            raise BadInput(f"pack: -o '{given}' was created by someone else while the pack "
                           "was written; nothing was replaced: pass a new path") from None


@contextlib.contextmanager
def _tar_gz(path: Path):
    """A new tar.gz at ``path`` (as ``tarfile.open(path, "w:gz")`` writes it, without the gzip
    file name): closed in full when the block ends; when the block raises, the half-written
    file is closed quietly, so the block's error is the one that is raised (a full disk fails
    again at close; that second error must not replace the first)."""
    raw = open(path, "xb")
    gz = None
    try:
        gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw)
        tar = tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT)
        yield tar
        tar.close()      # NB: end-of-archive blocks and record padding
        gz.close()       # the gzip trailer (CRC, length)
        raw.close()      # the last buffered bytes: a full disk may fail here
    except BaseException:
        for f in (gz, raw):      # NB: not tar.close(): it would write the end-of-archive blocks
            if f is not None:
                with contextlib.suppress(Exception):
                    f.close()
        raise


def _cannot_read(f: Path, e: OSError) -> BadInput:
    return BadInput(f"pack: cannot read '{f}' ({e.strerror or e}); nothing was written: check "
                    "the directory being packed")


def _changed(f: Path) -> BadInput:
    return BadInput(f"pack: '{f}' changed while it was packed; nothing was written: pack again "
                    "once nothing writes into the directory being packed")


def _file_digest(f: Path) -> tuple[int, str]:
    """(size, sha256) of the file ``f`` (`file_sha256`, streamed); one that changes meanwhile
    is caught as it is written into the archive (`_Hashing`: its size and hash again)."""
    try:
        return f.stat().st_size, file_sha256(f)
    except OSError as e:
        raise _cannot_read(f, e) from None


class _Hashing(io.RawIOBase):
    """``fobj`` read for the archive: hashed as it is read, and exactly ``size`` bytes (a file
    that shrank or cannot be read is one line, not tarfile's OSError)."""

    def __init__(self, fobj, path: Path, size: int):
        self.fobj, self.path, self.left, self.sha256 = fobj, path, size, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        try:
            data = self.fobj.read(n)
        except OSError as e:
            raise _cannot_read(self.path, e) from None
        if len(data) < n:
            raise _changed(self.path)
        self.left -= len(data)
        self.sha256.update(data)
        return data



# --------------------------------------------------------------------------------------------
# unpack: archives from anyone

def _cached_bytecode(parts: tuple[str, ...]) -> bool:
    """A ``__pycache__`` member or a ``.pyc``/``.pyo`` file: bytecode a reader cannot read, which
    Python would import instead of the source beside it."""
    return "__pycache__" in parts or parts[-1].endswith((".pyc", ".pyo"))


def _extract(stream, staging: Path, archive: Path, dest: Path, cap: int,
             dropped: list[str] | None = None) -> int:
    """Write every member of the tar ``stream`` under ``staging`` but cached bytecode (its names
    added to ``dropped``); return how many members it read."""
    seen_end: list = []
    named: set[tuple[str, ...]] = set()     # every member's path
    files: set[tuple[str, ...]] = set()
    parents: set[tuple[str, ...]] = set()   # directories made for members below them
    count = 0
    with tarfile.open(fileobj=stream, mode="r|", tarinfo=_strict_tarinfo(archive, seen_end)) \
            as tar:
        for m in tar:
            count += 1
            if count > MAX_MEMBERS:
                raise BadInput(f"unpack: '{archive}' holds more than {MAX_MEMBERS} members; no "
                               "pack has that many: refusing the whole archive")
            parts = _check_name(m, archive)
            if parts == (STAGING_MARKER,):
                raise BadInput(f"unpack: '{archive}' holds {show(m.name)}, a name nanbisect "
                               "reserves for its own staging directories; no pack holds it: "
                               "refusing the whole archive")
            if parts in named or any(parts[:i] in files for i in range(1, len(parts))) or (
                    not m.isdir() and parts in parents):
                raise BadInput(f"unpack: '{archive}' holds {show(m.name)} twice (or a file and a "
                               "directory of that name); refusing the whole archive")
            named.add(parts)
            parents.update(parts[:i] for i in range(1, len(parts)))
            if _cached_bytecode(parts):      # never kept: a replay imports sources only
                if dropped is not None and not m.isdir():
                    dropped.append("/".join(parts))
                continue
            if not m.isdir() and m.size > cap - stream.count:
                raise BadInput(f"unpack: '{archive}': {show(m.name)} claims {m.size} bytes, past "
                               f"the {cap}-byte limit on what the archive may expand to "
                               f"({stream.count} read before it); nothing was kept; if you trust "
                               f"the archive, pass --max-bytes N (or set {ENV_MAX_BYTES})")
            target = staging.joinpath(*parts)
            try:
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                files.add(parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                out = open(target, "xb")   # NB: exclusive, and the user's umask, not m.mode
            except OSError as e:
                raise _cannot_write(dest, e) from None
            written = _copy(tar.extractfile(m), out, dest)
            if written != m.size:
                raise BadInput(f"unpack: '{archive}' is truncated ({show(m.name)} holds "
                               f"{written} of {m.size} bytes); copy it again")
    if not seen_end:
        raise BadInput(f"unpack: '{archive}' is truncated or damaged (it ends without the "
                       "end-of-archive marker); copy it again")
    return count


def unpack(archive: str | Path, dest: str | Path, max_bytes: int | None = None,
           dropped: list[str] | None = None) -> Path:
    """Extract a pack made by anyone into the new or empty directory ``dest``; refuse it whole
    (nothing left behind) if any member could escape ``dest`` or it expands past ``max_bytes``.

    Streams: the archive is decompressed and written one chunk at a time, never held in memory,
    into a hidden ``.DEST.tmp-XXXXXXXX`` beside ``dest`` that is renamed to ``dest`` only once
    every member is written and the compressed stream checked to its end (CRC, length).
    ``max_bytes`` (default: `ENV_MAX_BYTES` when set, else `default_max_bytes`) bounds the
    uncompressed bytes read, tar headers included, so at most that much is ever written.
    Refused: a ``dest`` that exists and is not an empty directory, absolute or ``..`` paths,
    empty or ``.`` names, links, devices, sparse files, duplicate members, more than
    `MAX_MEMBERS` members, and truncated or damaged archives. Files get the user's umask, never
    the modes, owners or times stored in the archive. Cached bytecode (``__pycache__``, ``.pyc``)
    is never kept: its names go into ``dropped``.
    """
    archive, dest = Path(archive), Path(dest)
    _check_unpack_paths(archive, dest)
    cap = _max_bytes(archive, max_bytes)
    parent = Path(os.path.abspath(dest)).parent
    made = [d for d in (parent, *parent.parents) if not d.exists()]   # innermost first
    staging = parent / staging_name(dest.name)
    done = False
    try:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            make_staging_dir(staging)     # marked: `nanbisect clean` may remove it
        except OSError as e:
            raise _cannot_write(dest, e) from None
        with open(archive, "rb") as raw:
            stream = _Capped(_decompressed(raw, archive), cap, archive)
            _extract(stream, staging, archive, dest, cap, dropped)
            while stream.read(_CHUNK):   # to the end: gzip checks its CRC and length there
                pass
        _move_in(staging, dest)
        done = True
    except BadInput:
        raise
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, ValueError, RecursionError,
            OSError) as e:   # OSError here: reading (BadGzipFile, bz2's "Invalid data stream")
        raise BadInput(f"unpack: '{archive}' is not a readable archive, or is truncated or "
                       f"damaged ({type(e).__name__}: {show(str(e), 80)[1:-1]}); pass a file "
                       "written by nanbisect pack, copied whole") from None
    finally:
        if not done:
            shutil.rmtree(staging, ignore_errors=True)
            remove_made(made)
    return dest


def _check_unpack_paths(archive: Path, dest: Path) -> None:
    """`BadInput` unless ``archive`` is a file and ``dest`` new, or an empty directory that is
    not a mount point (the finished directory is renamed onto it)."""
    if not archive.is_file():
        raise BadInput(f"unpack: '{archive}' is not a file; pass the archive written by "
                       "nanbisect pack")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise BadInput(f"unpack: '{dest}' exists and is not a directory; pass a new or empty "
                       "directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise BadInput(f"unpack: '{dest}' exists and is not empty; unpack never writes over "
                       "files: pass a new or empty directory")
    if dest.is_dir() and os.path.ismount(dest):
        raise BadInput(f"unpack: '{dest}' is a mount point; unpack renames the finished "
                       "directory into place, which a mount point cannot be: pass a new "
                       f"directory inside it (e.g. {dest / 'pack'})")


def _move_in(staging: Path, dest: Path) -> None:
    """Rename the finished ``staging`` to ``dest`` (onto an empty directory, or where nothing
    is); `BadInput` when someone took ``dest`` meanwhile."""
    try:
        unmark(staging)
        if dest.is_dir():
            os.rename(staging, dest)     # replaces only an empty directory
        else:
            rename_noreplace(staging, dest)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise _cannot_write(dest, e) from None
        raise BadInput(f"unpack: '{dest}' was taken while unpacking ({e.strerror or e}); "
                       "nothing was written there: pass a new or empty directory") from None


def _max_bytes(archive: Path, max_bytes: int | None) -> int:
    if max_bytes is not None:
        return NUMBERS["--max-bytes"].check(max_bytes, "unpack")
    from_env = env(ENV_MAX_BYTES)
    return default_max_bytes(archive.stat().st_size) if from_env is None else from_env
