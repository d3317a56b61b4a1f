"""Property-based fuzzing of the ticket archive reader (`unpack`): bytes flipped, cut or
extended, tar streams mutated behind their checksum under every compression, archives of
random members. Each is unpacked whole or refused whole, in one line (the harness:
tests/bundle/test_fuzz.py)."""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import shutil
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanbisect.bundle.pack import unpack
from helpers.hostile import valid_archive
from test_fuzz import FUZZ, flip, flips, outcome  # noqa: F401 - the one harness


# --------------------------------------------------------------------------------------------
# archives


@pytest.fixture(scope="module")
def archive_bytes(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    return valid_archive(d / "a.tar.gz").read_bytes()


def _check_unpack(d: Path, data: bytes) -> str:
    for p in d.iterdir():    # each example starts from an empty directory
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (d / "a.tar.gz").write_bytes(data)
    dest = d / "out" / "dest"
    result = outcome(unpack, d / "a.tar.gz", dest)
    if result == "ok":
        for p in dest.rglob("*"):
            assert not p.is_symlink() and (p.is_file() or p.is_dir())
            assert dest.resolve() in p.resolve().parents
    else:
        assert not (d / "out").exists()   # nothing half-way: no dest, no staging, no parent
    return result


@FUZZ
@given(mutation=flips, cut=st.none() | st.integers(0, 4096), tail=st.binary(max_size=64))
def test_archive_bytes_flipped_cut_or_extended(tmp_path_factory, archive_bytes, mutation, cut,
                                               tail):
    d = tmp_path_factory.mktemp("u")
    data = flip(archive_bytes, *mutation)
    _check_unpack(d, (data[:cut] if cut is not None else data) + tail)
    shutil.rmtree(d)


CODECS = {"plain": lambda b: b, "gz": lambda b: gzip.compress(b, mtime=0), "bz2": bz2.compress,
          "xz": lzma.compress}


@FUZZ
@given(mutation=flips, cut=st.none() | st.integers(0, 1 << 14),
       codec=st.sampled_from(sorted(CODECS)), flip_compressed=st.booleans())
def test_archive_tar_stream_mutated_behind_the_crc(tmp_path_factory, archive_bytes, mutation,
                                                    cut, codec, flip_compressed):
    """Mutate the tar inside the compression (recompressed, so the checksum holds): the tar
    parser itself meets the damage; or flip the bz2 / xz stream itself."""
    d = tmp_path_factory.mktemp("u")
    tar = gzip.decompress(archive_bytes)
    if flip_compressed:
        data = flip(CODECS[codec](tar), *mutation)
    else:
        tar = flip(tar, *mutation)
        data = CODECS[codec](tar[:cut] if cut is not None else tar)
    _check_unpack(d, data)
    shutil.rmtree(d)


@FUZZ
@given(members=st.lists(st.tuples(
    st.sampled_from(["a", "b", "a/b", "a/b/c", ".", "", "..", "a/../b", "/abs", "a//b", "a/.",
                     "x" * 300, "rep\x00ort", "d\n", "a\\b", "ü", "a/", "./a"]),
    st.sampled_from([tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                     tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE, tarfile.CONTTYPE,
                     tarfile.GNUTYPE_SPARSE, b"Z"]),
    st.binary(max_size=8)), max_size=5),
    fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]))
def test_archive_of_random_members(tmp_path_factory, members, fmt):
    """Well-formed tars of odd members: names, types and duplicates the pack writer never
    makes."""
    d = tmp_path_factory.mktemp("u")
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w:gz", format=fmt) as tar:
            for name, kind, body in members:
                info = tarfile.TarInfo(name)
                info.type = kind
                if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                    info.linkname = "a"
                info.size = len(body) if kind in (tarfile.REGTYPE, tarfile.AREGTYPE,
                                                  tarfile.CONTTYPE, b"Z") else 0
                tar.addfile(info, io.BytesIO(body) if info.size else None)
    except (ValueError, tarfile.TarError):
        return   # a tar the standard library will not even write
    result = _check_unpack(d, buf.getvalue())
    if result == "ok":   # names as tarfile reads them (ustar cuts "rep\x00ort" to "rep")
        read = [m.name for m in tarfile.open(fileobj=io.BytesIO(buf.getvalue())).getmembers()]
        assert len(set(read)) == len(read), read
        assert set(read) <= {"a", "b", "a/b", "a/b/c", "ü", "rep"}, read
    shutil.rmtree(d)
