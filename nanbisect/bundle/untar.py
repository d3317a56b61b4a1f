"""Reading a tar stream from anyone for `nanbisect.bundle.pack.unpack`: the decompressed stream
by its magic number (gzip, bzip2, xz under a memory limit, plain tar), capped at a byte count;
tar headers that tarfile would read whole or expand refused; member names that could escape
the target refused; each member copied out with the first write error kept.

Guarantees: every refusal is one `BadInput` naming the archive; nothing here writes outside the
file object it is given.
"""
from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import tarfile
from pathlib import Path, PurePosixPath

from nanbisect.bundle.packlimits import (_CHUNK, ENV_MAX_BYTES, MAX_META_BYTES, MAX_NAME_PARTS,
                                         XZ_MEMLIMIT)
from nanbisect.errors import BadInput
from nanbisect.util.text import show


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
