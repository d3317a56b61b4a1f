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
This module is the whole ticket archive, one concept: its limits (`PACK_SCHEMA`,
`MAX_MEMBERS`, `default_max_bytes`, the chunk it streams in), the proof that an archive is one
`pack` wrote (`is_pack`, and `check_dest`, which refuses a destination that would replace or
change what nanbisect did not write), the reader of tar streams from anyone that `unpack` uses,
and `pack`/`unpack` themselves.
Guarantees of the proof: it is bounded (an archive over `FORCE_MAX_BYTES` is not read; one
expanding past `default_max_bytes` stops there; memory stays under a chunk plus pack.json); a
pack from before pack.json listed its members' hashes is never proven one.
Guarantees of the reader: the decompressed stream is chosen by its magic number (gzip, bzip2, xz
under a memory limit, plain tar) and capped at a byte count; tar headers that tarfile would read
whole or expand are refused, and so are member names that could escape the target; each member
is copied out with the first write error kept; every refusal is one `BadInput` naming the
archive, and nothing is written outside the file object it is given.
Not guaranteed: case-insensitive file systems (``A`` and ``a`` are two members here, one file
there), and a pack's contents being what its report claims (anyone can write a pack).
"""
from __future__ import annotations

import bz2
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
import stat
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Callable

from nanbisect import __version__
from nanbisect.bundle.atomic import rename_noreplace
from nanbisect.bundle.where import MANIFEST
from nanbisect.errors import BadInput
from nanbisect.util.numbers import NUMBERS, env
from nanbisect.util.files import file_sha256, remove_made
from nanbisect.util.staging import MARKER as STAGING_MARKER
from nanbisect.util.staging import make_staging_dir, staging_name, staging_path, unmark
from nanbisect.util.text import show


# ------------------------------------------- limits: what a pack may hold, written and read
PACK_SCHEMA = "nanbisect.pack/1"      # pack.json, the first member of every pack
MAX_MEMBERS = 100_000           # a full pack of a 1,000-rank bundle holds ~6,000
MAX_META_BYTES = 1 << 20        # one pax / GNU long-name header (tarfile reads it whole)
MAX_NAME_PARTS = 32
FLOOR_BYTES = 64 << 20          # what any archive may expand to
RATIO = 50                      # ... or this many times its own size,
CEILING_BYTES = 4 << 30         # ... but not past this, unless the archive itself is bigger:
BIG_RATIO = 2                   # then this many times its size (tensors barely compress)
XZ_MEMLIMIT = 256 << 20         # xz -9 needs 65 MiB to decompress
ENV_MAX_BYTES = "NANBISECT_UNPACK_MAX_BYTES"
_CHUNK = 1 << 20


def default_max_bytes(archive_bytes: int) -> int:
    """How many bytes an archive of ``archive_bytes`` may expand to by default.

    At least 64 MiB; else 50x the archive (reports, repro inputs and tensors compress far less),
    at most 4 GiB, unless the archive is over 2 GiB (a ``--full`` pack of a big model), then 2x
    its size. A 1 MiB gzip of 1 GiB of zeros stops after 64 MiB.

    >>> [default_max_bytes(n) >> 20 for n in (1 << 20, 10 << 20, 5 << 30)]
    [64, 500, 10240]
    """
    return max(FLOOR_BYTES, min(RATIO * archive_bytes, CEILING_BYTES), BIG_RATIO * archive_bytes)


# ------------------------------------------------ reading a tar stream from anyone (unpack)
class _Capped(io.RawIOBase):
    """The decompressed stream, refusing to yield more than ``cap`` bytes."""

    def __init__(self, f, cap: int, archive: Path):
        self.f, self.cap, self.archive, self.count = f, cap, archive, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        left = self.cap - self.count
        # NB: never ask for more than a chunk at once: the decompressor would build it in memory
        n = min(_CHUNK if n is None or n < 0 else n, _CHUNK, left + 1)
        data = self.f.read(n)
        self.count += len(data)
        if self.count > self.cap:
            raise BadInput(f"unpack: '{self.archive}' expands to more than {self.cap} bytes "
                           f"(a compression bomb, or a pack bigger than the default limit); "
                           f"nothing was kept; if you trust it, pass --max-bytes N (or set "
                           f"{ENV_MAX_BYTES})")
        return data


def _decompressed(raw, archive: Path):
    """``raw`` as a stream of tar bytes, by its magic number: gzip, bzip2, xz, or plain tar."""
    magic = raw.read(6)
    raw.seek(0)
    if magic[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")     # NB: checks CRC and length at the end
    if magic[:3] == b"BZh":
        return bz2.BZ2File(raw, "rb")
    if magic == b"\xfd7zXZ\x00":
        return _Xz(raw)
    return raw


class _Xz(io.RawIOBase):
    """An xz stream (or several, concatenated) decompressed under `XZ_MEMLIMIT`: an xz header
    may declare a 4 GiB dictionary, and lzma.LZMAFile offers no memory limit."""

    def __init__(self, raw):
        self.raw, self.d = raw, lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=XZ_MEMLIMIT)

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        n = _CHUNK if n is None or n < 0 else n
        while True:
            if self.d.eof:
                rest = self.d.unused_data or self.raw.read(_CHUNK)
                if not rest:
                    return b""
                self.d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=XZ_MEMLIMIT)
                chunk = rest
            elif self.d.needs_input:
                chunk = self.raw.read(_CHUNK)
                if not chunk:
                    raise EOFError("Compressed file ended before the end-of-stream marker was "
                                   "reached")
            else:
                chunk = b""
            out = self.d.decompress(chunk, max_length=n)
            if out:
                return out


def _strict_tarinfo(archive: Path, seen_end: list):
    """A TarInfo that refuses what tarfile would read whole into memory or expand (huge pax or
    GNU long-name headers, sparse files) and notes the end-of-archive block: tarfile takes a
    damaged header after the first member as the end of the archive, nanbisect does not."""

    class Strict(tarfile.TarInfo):
        @classmethod
        def fromtarfile(cls, tar):
            buf = tar.fileobj.read(tarfile.BLOCKSIZE)
            if buf == bytes(tarfile.BLOCKSIZE):
                seen_end.append(True)
            obj = cls.frombuf(buf, tar.encoding, tar.errors)
            obj.offset = tar.fileobj.tell() - tarfile.BLOCKSIZE
            return obj._proc_member(tar)

        def _proc_member(self, tar):
            if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                             tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE) \
                    and self.size > MAX_META_BYTES:
                raise BadInput(f"unpack: '{archive}' holds a {self.size}-byte extended header, "
                               "more than any pack has; refusing the whole archive")
            if self.type == tarfile.GNUTYPE_SPARSE:
                raise BadInput(f"unpack: '{archive}' holds {show(self.name)}, a sparse file; "
                               "refusing the whole archive")
            return super()._proc_member(tar)

    return Strict


def _check_name(m: tarfile.TarInfo, archive: Path) -> tuple[str, ...]:
    name = m.name
    shown = show(name)
    if name in ("", ".", "./"):
        raise BadInput(f"unpack: '{archive}' holds a member named {shown}; refusing the whole "
                       "archive")
    p = PurePosixPath(name)
    parts = tuple(name.split("/"))
    if p.is_absolute() or name.startswith(("/", "\\")) or ".." in parts or "\\" in name:
        raise BadInput(f"unpack: '{archive}' holds {shown}, a path outside the target "
                       "directory; refusing the whole archive")
    if any(part in ("", ".") for part in parts) or len(parts) > MAX_NAME_PARTS or not all(
            part.isprintable() and len(part.encode("utf-8", "surrogateescape")) <= 255
            for part in parts):
        raise BadInput(f"unpack: '{archive}' holds {shown}, not a plain relative path (empty or "
                       "'.' parts, control characters, too deep or too long); refusing the whole "
                       "archive")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"unpack: '{archive}' holds {shown}, a name that is not UTF-8; refusing "
                       "the whole archive") from None
    if m.sparse is not None or not (m.type in (tarfile.REGTYPE, tarfile.AREGTYPE)
                                    or m.type == tarfile.DIRTYPE):
        raise BadInput(f"unpack: '{archive}' holds {shown}, a link or special file; "
                       "refusing the whole archive")
    return parts


def _copy(src, out, dest: Path) -> int:
    """Write ``src`` (a member being read) into the file ``out`` and close it; return how many
    bytes. The first error wins: after a failed write (or a failed read of the archive) ``out``
    is closed quietly, since closing flushes what is buffered and a full disk fails there again,
    which must not replace the first error (it read "not a readable archive")."""
    written = 0
    try:
        while chunk := src.read(_CHUNK):
            try:
                out.write(chunk)
            except OSError as e:
                raise _cannot_write(dest, e) from None
            written += len(chunk)
        try:
            out.close()      # NB: the last buffered bytes meet a full disk here
        except OSError as e:
            raise _cannot_write(dest, e) from None
    finally:
        with contextlib.suppress(OSError):
            out.close()      # after an error: quietly (a no-op once closed)
    return written


def _cannot_write(dest: Path, e: OSError) -> BadInput:
    return BadInput(f"unpack: cannot write into '{dest}' ({e.strerror or e}); nothing was kept: "
                    "pass a directory you can write to, with room for the archive")


# ------------------ the proof that an archive is a pack (--force), and where pack may write
FORCE_MAX_BYTES = 4 << 30       # the biggest archive --force reads through to prove it a pack
MAX_PACK_JSON = 32 << 20        # pack.json of `MAX_MEMBERS` members, with their hashes
PAX_KEYS = frozenset({"path", "size", "mtime", "uid", "gid", "uname", "gname"})  # tarfile's
HEAD_KEYS = ("schema", "full", "left_out", "left_out_always", "members")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_BLOCK = tarfile.BLOCKSIZE
_OLDER = ("written by an older nanbisect: its pack.json records no size or sha256 of its "
          "members, so it cannot be proven to hold only what nanbisect wrote")



def check_dest(dest: Path, src: Path, force: bool = False) -> Path:
    """Refuse a ``pack -o`` that would replace or change what nanbisect did not write: an
    existing path (with ``force``: anything but a pack), a path inside ``src`` or inside any
    bundle. Returns the absolute path.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> check_dest(d, d / "src")
    Traceback (most recent call last):
    ...
    nanbisect.errors.BadInput: pack: -o '...' is a directory; pass a file path for the archive...
    """
    given, dest = Path(dest), Path(os.path.abspath(dest))
    real = dest.parent.resolve() / dest.name
    for d in real.parents:
        if _is_bundle(d):
            raise BadInput(f"pack: -o '{given}' is inside the bundle '{d}'; writing there "
                           "would change the bundle: pass a path outside any bundle")
    if _inside(real, Path(src).resolve()):
        raise BadInput(f"pack: -o '{given}' is inside '{src}', the directory being packed; "
                       "writing there would change what is packed: pass a path outside it")
    if dest.is_symlink():
        raise BadInput(f"pack: -o '{given}' is a symbolic link; pack does not replace links: "
                       "pass a new path")
    if dest.is_dir():
        raise BadInput(f"pack: -o '{given}' is a directory; pass a file path for the archive, "
                       f"e.g. '{given / 'nanbisect-ticket.tar.gz'}'")
    if dest.exists():
        if not dest.is_file():
            raise BadInput(f"pack: -o '{given}' exists and is not a plain file; pass a new path")
        if not force:
            raise BadInput(f"pack: -o '{given}' exists; pack never replaces a file: pass a new "
                           "path, or --force to replace an earlier pack")
        why = _not_a_pack(dest)
        if why is not None:
            raise BadInput(f"pack: -o '{given}' exists and is not a pack ({why}); --force "
                           "replaces only an archive nanbisect pack wrote, proven whole: pass "
                           "another -o, or move the file away")
    return dest


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _is_bundle(d: Path) -> bool:
    """Whether ``d`` holds a nanbisect manifest (its first 4 KiB name the bundle schema)."""
    try:
        with open(d / MANIFEST, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return re.search(r'"schema"\s*:\s*"nanbisect\.bundle/', head) is not None


def is_pack(path: str | Path) -> bool:
    """Whether ``path`` is an archive `pack` wrote, proven over the whole file (the only kind
    ``--force`` replaces): see `_not_a_pack`. A pack of a nanbisect from before pack.json
    listed each member's sha256 cannot be proven, and is not one here.

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "notes.tar.gz"
    >>> _ = f.write_text("my notes"); is_pack(f)
    False
    """
    return _not_a_pack(Path(path)) is None


def _not_a_pack(path: Path) -> str | None:
    """None for an archive `pack` wrote, proven over the whole file; else why ``path`` is not
    one (or cannot be proven to be one).

    Proven: one gzip stream (no second member, nothing after it; CRC and length checked) of a
    tar whose first member is pack.json, exactly as `pack` writes it, listing every other
    member with its size and sha256; every member is a file it lists, with that size and hash,
    each once; no member is missing; padding and the end-of-archive blocks are zeros, up to
    the record `tarfile` pads to, and nothing more. Bounded: an archive over `FORCE_MAX_BYTES`
    is not read, one that expands past `default_max_bytes` is refused there, and memory stays
    under a chunk plus pack.json (at most `MAX_PACK_JSON`). A pack from before members were
    listed with their hashes cannot be proven, and is refused so."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            return "not a plain file"
        size = st.st_size
        if size > FORCE_MAX_BYTES:
            return (f"it is {size} bytes, more than the {FORCE_MAX_BYTES} bytes --force reads "
                    "to prove an archive is a pack")
        with open(path, "rb") as raw:
            head = raw.read(4)
            if head[:2] != b"\x1f\x8b":
                return "not a gzip file"
            if len(head) < 4 or head[2] != 8 or head[3] not in (0, 8):  # deflate; FNAME only
                return "a gzip file with a header nanbisect pack does not write"
            raw.seek(0)
            return _walk(_Gunzip(raw, default_max_bytes(size)))
    except _NotPack as e:
        return str(e)
    except OSError as e:
        return f"it cannot be read: {e.strerror or e}"
    except (zlib.error, tarfile.HeaderError, ValueError, RecursionError) as e:
        return f"it is damaged: {type(e).__name__}: {show(str(e), 80)[1:-1]}"


class _NotPack(Exception):
    """Why an archive is not one `pack` wrote: the proof stops there."""


class _Gunzip:
    """The decompressed bytes of the one gzip member at the start of ``raw``, counted and
    capped at ``cap``; `end` proves nothing follows it."""

    def __init__(self, raw, cap: int):
        self.raw, self.cap, self.pos = raw, cap, 0
        self.d = zlib.decompressobj(wbits=31)     # NB: checks the gzip CRC and length at the end

    def read(self, n: int) -> bytes:
        """``n`` bytes, fewer only at the end of the gzip member."""
        out = bytearray()
        while len(out) < n and not self.d.eof:
            data = self.d.unconsumed_tail or self.raw.read(_CHUNK)
            if not data:
                raise _NotPack("it is truncated (its gzip stream ends early)")
            out += self.d.decompress(data, n - len(out))
        self.pos += len(out)
        if self.pos > self.cap:
            raise _NotPack(f"it expands to more than {self.cap} bytes, more than its members "
                           "or a pack of its size hold")
        return bytes(out)

    def exact(self, n: int) -> bytes:
        data = self.read(n)
        if len(data) < n:
            raise _NotPack("it is truncated (the tar ends inside a member)")
        return data

    def skip(self, n: int) -> None:
        while n > 0:
            n -= len(self.exact(min(n, _CHUNK)))

    def end(self) -> None:
        """Nothing after the gzip member: no second member, no other bytes."""
        if self.read(1):
            raise _NotPack("it holds more after its end-of-archive blocks (data added inside "
                           "its gzip stream)")
        rest = self.d.unused_data or self.raw.read(_CHUNK)
        if rest[:2] == b"\x1f\x8b":
            raise _NotPack("a second gzip stream follows the pack's (an archive appended to it)")
        if rest:
            raise _NotPack("bytes follow the end of its gzip stream (data appended to it)")


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def _zeros(g: _Gunzip, n: int, what: str) -> None:
    while n > 0:
        chunk = g.exact(min(n, _CHUNK))
        if chunk.count(0) != len(chunk):
            raise _NotPack(f"it holds data in {what}, where nanbisect pack writes zeros")
        n -= len(chunk)


def _pax(data: bytes) -> dict[str, str]:
    """The records of a pax extended header ("LENGTH key=value\\n", LENGTH counting itself)."""
    out, pos = {}, 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0 or not data[pos:sp].isdigit():
            raise _NotPack("it holds a damaged extended header")
        end = pos + int(data[pos:sp])
        if end <= sp + 1 or end > len(data) or data[end - 1:end] != b"\n":
            raise _NotPack("it holds a damaged extended header")
        key, eq, value = data[sp + 1:end - 1].partition(b"=")
        if not eq:
            raise _NotPack("it holds a damaged extended header")
        out[key.decode("utf-8")] = value.decode("utf-8")
        pos = end
    return out


def _listed(data: bytes) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) of every member pack.json lists; `_NotPack` unless pack.json is
    byte for byte what `pack` writes."""
    try:
        head = json.loads(data)
    except (ValueError, RecursionError):
        raise _NotPack("its pack.json is not JSON") from None
    if not isinstance(head, dict) or head.get("schema") != PACK_SCHEMA:
        raise _NotPack(f"its pack.json does not name the schema {PACK_SCHEMA}")
    if "members" not in head:
        raise _NotPack(_OLDER)
    extra = [k for k in head if k not in HEAD_KEYS]
    if extra:
        raise _NotPack(f"its pack.json holds {show(extra[0])}, a field nanbisect does not write")
    members, out = head["members"], {}
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise _NotPack("its pack.json's members are not a list nanbisect writes")
    for m in members:
        if not (isinstance(m, dict) and list(m) == ["name", "size", "sha256"]
                and isinstance(m["name"], str) and m["name"] != "pack.json"
                and m["name"] not in out and type(m["size"]) is int and m["size"] >= 0
                and isinstance(m["sha256"], str) and _SHA256.fullmatch(m["sha256"])):
            raise _NotPack(f"its pack.json lists a member as nanbisect does not: {show(m, 80)}")
        out[m["name"]] = (m["size"], m["sha256"])
    if json.dumps(head, indent=1).encode() != data:
        raise _NotPack("its pack.json is not laid out as nanbisect writes it (edited)")
    return out


def _walk(g: _Gunzip) -> str | None:
    """The proof of `_not_a_pack` over the decompressed tar ``g``: None, or why not a pack. A
    file nanbisect did not write is named at once; any other reason, the first one, at the
    end (a user's re-tarred ticket lists its directories before its notes)."""
    listed: dict[str, tuple[int, str]] | None = None
    seen: set[str] = set()
    why, pax = None, None
    while True:
        block = g.exact(_BLOCK)
        if block.count(0) == _BLOCK:
            break
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        if info.type == tarfile.XHDTYPE and pax is None:
            if info.size > MAX_META_BYTES:
                raise _NotPack(f"it holds a {info.size}-byte extended header")
            data = g.exact(_padded(info.size))
            if data[info.size:].count(0) != len(data) - info.size:
                raise _NotPack("it holds data in an extended header's padding")
            pax = _pax(data[:info.size])
            continue
        pax, fields = None, pax or {}
        name, size = fields.get("path", info.name), info.size
        if "size" in fields:
            if not fields["size"].isdigit():
                raise _NotPack("it holds a damaged extended header")
            size = int(fields["size"])
        if listed is None:
            listed = _first_member(g, info, name, size)
            continue
        found = _member(g, info, name, size, fields, listed, seen)   # NB: read it whatever why is
        why = why or found
    if listed is None:
        raise _NotPack("it holds no member")
    if pax is not None:
        why = why or "it ends with an extended header and no member"
    return _ending(g, listed, seen, why)


def _first_member(g: _Gunzip, info: tarfile.TarInfo, name: str, size: int
                  ) -> dict[str, tuple[int, str]]:
    """pack.json, the first member: what it lists (`_listed`); the cap on what ``g`` may
    expand to raised to what the listed members take."""
    if name != "pack.json" or info.type != tarfile.REGTYPE:
        raise _NotPack(f"its first member is {show(name)}, not pack.json, with which "
                       "every pack nanbisect writes begins (an older nanbisect's pack, "
                       "pack.json last, cannot be proven)")
    if size > MAX_PACK_JSON:
        raise _NotPack(f"its pack.json is {size} bytes, more than nanbisect writes")
    data = g.exact(size)
    _zeros(g, _padded(size) - size, "padding")
    listed = _listed(data)
    # what the listed members take, headers and padding included: a --full pack of
    # zeros (fresh Adam moments) expands far past the ratio a hostile file is held to
    g.cap = max(g.cap, g.pos + sum(_padded(n) + 4 * _BLOCK for n, _ in listed.values())
                + tarfile.RECORDSIZE + 2 * _BLOCK)
    return listed


def _member(g: _Gunzip, info: tarfile.TarInfo, name: str, size: int, fields: dict,
            listed: dict[str, tuple[int, str]], seen: set[str]) -> str | None:
    """Read one member after pack.json: None when it is the file pack.json lists, else why
    not; `_NotPack` at once for a file nanbisect did not write, or one seen twice."""
    if info.type != tarfile.REGTYPE:
        kind = "a directory" if info.isdir() else "a link or special file"
        g.skip(_padded(size))
        return f"it holds {show(name)}, {kind}; nanbisect writes only files"
    if name not in listed:
        raise _NotPack(f"it holds {show(name)}, which nanbisect did not write")
    if name in seen:
        raise _NotPack(f"it holds {show(name)} twice")
    seen.add(name)
    extra = sorted(set(fields) - PAX_KEYS)
    why = None
    if extra:
        why = (f"{show(name)} has an extended header field nanbisect does not write "
               f"({show(extra[0])})")
    want_size, want_sha = listed[name]
    if size != want_size:
        g.skip(_padded(size))
        return why or (f"{show(name)} is {size} bytes, not the {want_size} its pack.json "
                       "records: changed since nanbisect wrote it")
    h, left = hashlib.sha256(), size
    while left:
        chunk = g.exact(min(left, _CHUNK))
        h.update(chunk)
        left -= len(chunk)
    _zeros(g, _padded(size) - size, "padding")
    if h.hexdigest() != want_sha:
        why = why or (f"{show(name)} is not the file its pack.json records (another "
                      "sha256): edited since nanbisect wrote it")
    return why


def _ending(g: _Gunzip, listed: dict[str, tuple[int, str]], seen: set[str], why: str | None
            ) -> str | None:
    """The end-of-archive blocks (zeros up to the record tarfile pads to) and nothing after
    them; then the first reason found, or a listed member that is missing."""
    end = g.pos - _BLOCK                            # where the end-of-archive blocks begin
    total = -(-(end + 2 * _BLOCK) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE
    _zeros(g, total - g.pos, "its end-of-archive blocks")
    g.end()
    missing = [n for n in listed if n not in seen]
    if missing:
        why = why or (f"{show(missing[0])}, listed in its pack.json, is missing"
                      + (f" ({len(missing)} members are)" if len(missing) > 1 else ""))
    return why


# -------------------------------------------------------------------------- pack and unpack
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
