"""What `nanbisect pack` may replace and where it may write: `is_pack` proves, over the whole
file, that an archive is one `pack` wrote (the only kind ``--force`` replaces); `check_dest`
refuses a destination that would replace or change what nanbisect did not write.

Guarantees: the proof is bounded (an archive over `FORCE_MAX_BYTES` is not read; one expanding
past `nanbisect.bundle.packlimits.default_max_bytes` stops there; memory stays under a chunk plus
pack.json); a pack from before pack.json listed its members' hashes is never proven one.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tarfile
import zlib
from pathlib import Path

from nanbisect.bundle.packlimits import (_CHUNK, MAX_MEMBERS, MAX_META_BYTES, PACK_SCHEMA,
                                         default_max_bytes)
from nanbisect.bundle.where import MANIFEST
from nanbisect.errors import BadInput
from nanbisect.util.text import show

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
