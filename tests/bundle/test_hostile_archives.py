"""Hostile archives: links, paths outside, special files, compression bombs, truncated and
damaged streams, too many members. Each is refused whole (exit 2, one line), nothing written
half-way; valid archives of every compression unpack with the umask's modes."""
from __future__ import annotations

import gzip
import json
import os
import random
import struct
import tarfile
import time
import zlib
from pathlib import Path

import pytest

from helpers import invoke
from nanbisect import BadInput
from nanbisect.bundle import pack as pk
from nanbisect.bundle.format import read_bundle
from helpers.hostile import (_modes, measured, tar_gz, valid_archive)


# --------------------------------------------------------------------------------------------
# hostile archives: name -> builder(dir) -> (archive, phrase)


OUTSIDE = "a path outside the target directory"
NOT_PLAIN = "not a plain relative path"
LINK = "a link or special file"


def _member(name, phrase, kind=tarfile.REGTYPE, data=b"x", **extra):
    """An archive of a harmless file followed by one hostile member."""
    def build(d: Path):
        spec = {"name": name, "type": kind, **extra}
        if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
            spec.setdefault("linkname", "/etc/passwd")
        body = data if kind in (tarfile.REGTYPE, tarfile.GNUTYPE_SPARSE) else None
        return tar_gz(d / "a.tar.gz", [({"name": "ok.txt"}, b"fine"), (spec, body)]), phrase
    return build


def _zeros(opener, total: int, member: int | None):
    """``total`` bytes of zeros as tar members of ``member`` bytes (None: no tar at all), about
    1 KiB per MiB on disk: compressed streams, concatenated (still one .gz / .bz2 file, as RFC
    1952 and bzip2 allow and `gzip -d` / `bzip2 -d` read)."""
    mib = opener(bytes(1 << 20))
    out = []
    if member is None:
        return b"".join(mib for _ in range(total >> 20))
    for i in range(total // member):
        info = tarfile.TarInfo(f"zeros{i}.bin")
        info.size = member
        out.append(opener(info.tobuf(tarfile.USTAR_FORMAT)))
        out.extend(mib for _ in range(member >> 20))
    out.append(opener(bytes(1024)))
    return b"".join(out)


def _bomb(name, opener, member, phrase):
    def build(d: Path):
        (d / name).write_bytes(_zeros(opener, 1 << 30, member))
        assert (d / name).stat().st_size < 2 << 20
        return d / name, phrase
    return build


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=9, mtime=0)


def _xz(data: bytes) -> bytes:
    import lzma

    return lzma.compress(data, preset=9)


def _xz_4gib_dictionary(d: Path):
    """A valid xz file whose block header declares a 4 GiB dictionary (CRC32 recomputed)."""
    import lzma

    data = lzma.compress(b"hello" * 100, format=lzma.FORMAT_XZ)
    size = (data[12] + 1) * 4
    head = bytearray(data[12:12 + size])
    prop = head.index(b"\x21\x01", 2) + 2    # LZMA2 filter id, 1 property byte: dict size
    head[prop] = 40                            # 4 GiB - 1
    head[-4:] = struct.pack("<I", zlib.crc32(bytes(head[:-4])))
    (d / "dict.tar.xz").write_bytes(data[:12] + bytes(head) + data[12 + size:])
    return d / "dict.tar.xz", "Memory usage limit exceeded"


def _bz2(data: bytes) -> bytes:
    import bz2

    return bz2.compress(data, 9)


STREAM_CAP = "expands to more than 67108864 bytes"


def _claims_huge_member(d: Path):
    info = tarfile.TarInfo("big.bin")
    info.size = 10 << 30
    (d / "a.tar.gz").write_bytes(gzip.compress(info.tobuf(tarfile.PAX_FORMAT) + bytes(4096)))
    return d / "a.tar.gz", "claims 10737418240 bytes, past the 67108864-byte limit"


def _pax_header_bomb(d: Path):
    """An extended header claiming 1 GiB (tarfile would read it whole into memory)."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 1 << 30
    (d / "a.tar.gz").write_bytes(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT) + bytes(4096)))
    return d / "a.tar.gz", "1073741824-byte extended header"


def _gnu_longname_bomb(d: Path):
    info = tarfile.TarInfo("././@LongLink")
    info.type = tarfile.GNUTYPE_LONGNAME
    info.size = 1 << 30
    (d / "a.tar.gz").write_bytes(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT) + bytes(4096)))
    return d / "a.tar.gz", "1073741824-byte extended header"


def _truncated_gz(d: Path):
    data = valid_archive(d / "v.tar.gz").read_bytes()
    (d / "v.tar.gz").unlink()
    (d / "a.tar.gz").write_bytes(data[: len(data) // 2])
    return d / "a.tar.gz", "truncated"


def _truncated_tar_at_member_boundary(d: Path):
    """A plain tar cut right after a member: tarfile itself takes it as complete."""
    tar = tar_gz(d / "v.tar", [({"name": "a.txt"}, b"a" * 512), ({"name": "b.txt"}, b"b")],
                 mode="w")
    data = tar.read_bytes()
    tar.unlink()
    (d / "a.tar").write_bytes(data[:1024])    # header + one block of a.txt; b.txt and the end gone
    return d / "a.tar", "ends without the end-of-archive marker"


def _flipped_crc(d: Path):
    data = bytearray(valid_archive(d / "v.tar.gz").read_bytes())
    (d / "v.tar.gz").unlink()
    data[-6] ^= 0xFF    # inside the gzip trailer's CRC32
    (d / "a.tar.gz").write_bytes(bytes(data))
    return d / "a.tar.gz", "CRC check failed"


def _damaged_second_header(d: Path):
    tar = tar_gz(d / "v.tar", [({"name": "a.txt"}, b"a"), ({"name": "b.txt"}, b"b")], mode="w")
    data = bytearray(tar.read_bytes())
    tar.unlink()
    data[1024 + 100] ^= 0x55   # the second member's header: its checksum no longer matches
    (d / "a.tar").write_bytes(bytes(data))
    return d / "a.tar", "ends without the end-of-archive marker"


def _garbage(d: Path):
    (d / "a.tar.gz").write_bytes(random.Random(0).randbytes(4096))
    return d / "a.tar.gz", "is not a readable archive"


def _empty_file(d: Path):
    (d / "a.tar.gz").write_bytes(b"")
    return d / "a.tar.gz", "is not a readable archive"


def _duplicate(d: Path):
    return tar_gz(d / "a.tar.gz", [({"name": "x.txt"}, b"first"), ({"name": "x.txt"}, b"second")]
                  ), "holds 'x.txt' twice"


def _file_then_dir_inside(d: Path):
    return tar_gz(d / "a.tar.gz", [({"name": "x"}, b"a file"), ({"name": "x/y"}, b"below it")]
                  ), "holds 'x/y' twice (or a file and a directory of that name)"


def _dir_then_file(d: Path):
    return tar_gz(d / "a.tar.gz", [({"name": "x/y"}, b"a"), ({"name": "x"}, b"over the dir")]
                  ), "holds 'x' twice (or a file and a directory of that name)"


def _too_many_members(d: Path):
    members = [({"name": f"f{i}"}, b"") for i in range(pk.MAX_MEMBERS + 1)]
    return tar_gz(d / "a.tar.gz", members, fmt_=tarfile.USTAR_FORMAT), \
        f"more than {pk.MAX_MEMBERS} members"


HOSTILE_ARCHIVES = {
    "member-dotdot": _member("../evil", OUTSIDE),
    "member-absolute": _member("/tmp/evil-abs", OUTSIDE),
    "member-nested-dotdot": _member("report/../../evil", OUTSIDE),
    "member-backslash": _member("..\\evil", OUTSIDE),
    "member-dot": _member(".", "a member named '.'"),
    "member-empty-name": _member("", "a member named ''"),
    "member-dot-part": _member("report/./x", NOT_PLAIN),
    "member-double-slash": _member("report//x", NOT_PLAIN),
    "member-newline-in-name": _member("report/a\nb", NOT_PLAIN),
    "member-escape-in-name": _member("report/\x1b[2Jx", NOT_PLAIN),
    "member-name-256-bytes": _member("a" * 256, NOT_PLAIN),
    "member-40-deep": _member("/".join(["d"] * 40), NOT_PLAIN),
    "member-symlink": _member("report/link", LINK, tarfile.SYMTYPE),
    "member-hardlink": _member("report/hard", LINK, tarfile.LNKTYPE, linkname="ok.txt"),
    "member-char-device": _member("dev", LINK, tarfile.CHRTYPE, devmajor=1, devminor=3),
    "member-fifo": _member("fifo", LINK, tarfile.FIFOTYPE),
    "member-gnu-sparse": _member("sparse", "a sparse file", tarfile.GNUTYPE_SPARSE),
    "duplicate-member": _duplicate,
    "file-then-member-below-it": _file_then_dir_inside,
    "dir-then-file-over-it": _dir_then_file,
    "gzip-bomb-1GiB-one-member": _bomb("bomb.tar.gz", _gz, 1 << 30, "claims 1073741824 bytes, "
                                       "past the 67108864-byte limit"),
    "gzip-bomb-1GiB-16MiB-members": _bomb("bomb.tar.gz", _gz, 16 << 20, "claims 16777216 bytes, "
                                          "past the 67108864-byte limit"),
    "gzip-bomb-1GiB-3MiB-members": _bomb("bomb.tar.gz", _gz, 3 << 20, "claims 3145728 bytes, "
                                         "past the 67108864-byte limit"),
    "gzip-bomb-1GiB-no-tar": _bomb("zeros.gz", _gz, None, STREAM_CAP),
    "bz2-bomb-1GiB-no-tar": _bomb("zeros.bz2", _bz2, None, STREAM_CAP),
    "xz-bomb-1GiB-no-tar": _bomb("zeros.xz", _xz, None, STREAM_CAP),
    "xz-header-declares-4GiB-dictionary": _xz_4gib_dictionary,
    "bz2-bomb-1GiB-16MiB-members": _bomb("bomb.tar.bz2", _bz2, 16 << 20, "claims 16777216 "
                                         "bytes, past the 67108864-byte limit"),
    "member-claims-10GiB": _claims_huge_member,
    "pax-header-claims-1GiB": _pax_header_bomb,
    "gnu-longname-claims-1GiB": _gnu_longname_bomb,
    "truncated-gzip": _truncated_gz,
    "truncated-tar-at-member-boundary": _truncated_tar_at_member_boundary,
    "damaged-second-header": _damaged_second_header,
    "gzip-crc-flipped": _flipped_crc,
    "random-bytes": _garbage,
    "empty-file": _empty_file,
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ARCHIVES))
def test_hostile_archive_is_refused_whole(tmp_path, case):
    src = tmp_path / "src"
    src.mkdir()
    archive, phrase = HOSTILE_ARCHIVES[case](src)
    dest = tmp_path / "out" / "dest"
    t0 = time.monotonic()
    res = invoke("unpack", archive, dest)
    assert time.monotonic() - t0 < 10, case
    assert res.code == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0], res.stderr
    assert "refusing the whole archive" in lines[0] or "nothing" in lines[0] or \
        "truncated" in lines[0] or "not a readable archive" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()          # no dest, no staging, no parent made
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil-abs").exists()


def test_too_many_members(tmp_path, monkeypatch):
    monkeypatch.setattr(pk, "MAX_MEMBERS", 50)
    archive, phrase = _too_many_members(tmp_path)
    with pytest.raises(BadInput, match=phrase):
        pk.unpack(archive, tmp_path / "dest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar.gz"]


@pytest.mark.slow
def test_gzip_bomb_through_the_cli_stops_early(tmp_path):
    """1 GiB of zeros, about 1 MiB on disk: stopped by the stream's cap after 64 MiB, with flat
    memory; nothing kept."""
    src = tmp_path / "src"
    src.mkdir()
    archive, phrase = HOSTILE_ARCHIVES["gzip-bomb-1GiB-no-tar"](src)
    code, _, err, seconds, peak, _ = measured("unpack", archive, tmp_path / "dest")
    assert code == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
    assert seconds < 60 and peak < 1024, (seconds, peak)   # read 64 MiB of 1 GiB, in chunks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_max_bytes_override_lets_a_trusted_big_pack_through(tmp_path, monkeypatch):
    data = os.urandom(1 << 16) * 2                   # compresses ~2x: 128 KiB
    archive = tar_gz(tmp_path / "a.tar.gz", [({"name": "blob"}, data)])
    with pytest.raises(BadInput, match="'blob' claims 131072 bytes, past the 65536-byte limit"):
        pk.unpack(archive, tmp_path / "d1", max_bytes=1 << 16)
    assert not (tmp_path / "d1").exists()
    monkeypatch.setenv(pk.ENV_MAX_BYTES, str(1 << 16))
    assert invoke("unpack", archive, tmp_path / "d2").code == 2
    assert invoke("unpack", archive, tmp_path / "d3", "--max-bytes", 1 << 20).code == 0
    assert (tmp_path / "d3" / "blob").read_bytes() == data
    monkeypatch.setenv(pk.ENV_MAX_BYTES, "lots")
    res = invoke("unpack", archive, tmp_path / "d4")
    assert res.code == 2 and "NANBISECT_UNPACK_MAX_BYTES='lots' is not a number" in res.stderr


def test_default_cap_scales_with_the_archive():
    assert pk.default_max_bytes(0) == 64 << 20
    assert pk.default_max_bytes(10 << 20) == 500 << 20
    assert pk.default_max_bytes(1 << 30) == 4 << 30
    assert pk.default_max_bytes(3 << 30) == 6 << 30


def test_unpack_never_writes_into_a_non_empty_dest(tmp_path):
    archive = valid_archive(tmp_path / "a.tar.gz")
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    res = invoke("unpack", archive, dest)
    assert res.code == 2 and "exists and is not empty" in res.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["mine.txt"]
    assert (dest / "mine.txt").read_text() == "keep"
    f = tmp_path / "file"
    f.write_text("keep")
    assert invoke("unpack", archive, f).code == 2 and f.read_text() == "keep"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert invoke("unpack", archive, link).code == 2 and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar.gz", "dest", "file", "link"]


def test_unpack_valid_archive_into_empty_dir_with_umask_modes(tmp_path):
    archive = valid_archive(tmp_path / "a.tar.gz")
    dest = tmp_path / "dest"
    dest.mkdir()
    old = os.umask(0o022)
    try:
        assert pk.unpack(archive, dest) == dest
        pk.unpack(archive, tmp_path / "new" / "deeper")
    finally:
        os.umask(old)
    assert (dest / "report" / "repro" / "repro.py").read_text() == "print(1)\n"
    assert _modes(dest) == {("dir", 0o755), ("file", 0o644)}   # not the archive's 4777
    assert _modes(tmp_path / "new" / "deeper") == {("dir", 0o755), ("file", 0o644)}
    assert not [p for p in tmp_path.rglob(".*")]    # no staging left


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz", "w"])
def test_unpack_reads_every_compression(tmp_path, mode):
    members = [({"name": "report/report.json"}, b"{}"), ({"name": "big"}, os.urandom(3 << 20))]
    archive = tar_gz(tmp_path / "a", members, mode=mode)
    dest = pk.unpack(archive, tmp_path / "dest")
    assert (dest / "big").read_bytes() == members[1][1]
    assert (dest / "report" / "report.json").read_bytes() == b"{}"


def test_unpack_write_failure_leaves_nothing(tmp_path):
    """A destination that cannot be made (its parent is a file): one line, nothing kept."""
    archive = valid_archive(tmp_path / "a.tar.gz")
    (tmp_path / "f").write_text("keep")
    res = invoke("unpack", archive, tmp_path / "f" / "dest")
    assert res.code == 2 and "cannot write into" in res.stderr, res.stderr
    assert (tmp_path / "f").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar.gz", "f"]


def test_pack_round_trip_through_hardened_unpack(tmp_path, fixture_bundle):
    b = fixture_bundle("healthy")
    report = b / "nanbisect-report"
    (report / "repro").mkdir(parents=True)
    (report / "report.json").write_text('{"schema": "nanbisect.report/1"}')
    (report / "repro" / "repro.py").write_text("print('hi')\n")
    archive = pk.pack(b, tmp_path / "t.tar.gz", full=True)
    dest = pk.unpack(archive, tmp_path / "dest")
    assert (dest / "report" / "repro" / "repro.py").read_text() == "print('hi')\n"
    assert read_bundle(dest / "bundle").manifest["entry"] == read_bundle(b).manifest["entry"]
    assert json.loads((dest / "pack.json").read_text())["full"] is True
