"""`pack --force` replaces only an archive nanbisect wrote, proven over the whole file (issue 39):
every member listed in pack.json with its size and sha256, no other member, nothing after the
end of the archive. And the first error wins when a disk fills: `unpack` and `pack` report the
write that failed, never a second failure of closing the half-written file.

Real files, real archives (`tarfile`, `gzip`), real tmpfs mounts (`tests/helpers/mounts.py`, skipped with
the reason where mount(2) is refused); the CLI in a process of its own where the process is the
point (the attack as a user types it), in-process otherwise."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import tarfile
import time

import pytest
from helpers import cli, invoke, one_line_exit_2
from helpers.mounts import tmpfs

from nanbisect.bundle import pack as pk


@pytest.fixture
def ticket(reported, tmp_path):
    """A pack of ``reported`` written by this nanbisect."""
    t = tmp_path / "ticket.tar.gz"
    assert invoke("pack", reported, "-o", t).code == 0
    return t


def _members(archive) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(archive) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar]


def _write(path, members) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, None if data is None else io.BytesIO(data))


def _state(path) -> tuple:
    """What shows a file untouched: its bytes (a huge one: inode, size, mtime, first MiB)."""
    st = path.stat()
    if st.st_size > 64 << 20:
        with open(path, "rb") as f:
            return st.st_ino, st.st_size, st.st_mtime_ns, f.read(1 << 20)
    return (path.read_bytes(),)


def _refused(reported, archive, *words) -> str:
    """``pack --force`` over ``archive``: exit 2, one line naming it, the words and the fix;
    the archive byte for byte as it was."""
    before = _state(archive)
    line = one_line_exit_2(invoke("pack", reported, "-o", archive, "--force"), str(archive),
                           "is not a pack", "another -o", "move", *words)
    assert _state(archive) == before
    assert not pk.is_pack(archive)
    return line


def test_force_refuses_a_retarred_ticket_with_the_users_notes(reported, ticket, tmp_path):
    """The issue's attack, as typed: unpack, add notes, re-tar with pack.json first (before:
    exit 0 and the notes were gone)."""
    u = tmp_path / "u"
    assert invoke("unpack", ticket, u).code == 0
    (u / "notes").mkdir()
    (u / "notes" / "analysis.md").write_text("three days of analysis\n")
    mine = tmp_path / "mine.tar.gz"
    with tarfile.open(mine, "w:gz") as tar:
        tar.add(u / "pack.json", arcname="pack.json")
        for p in sorted(u.iterdir()):
            if p.name != "pack.json":
                tar.add(p, arcname=p.name)
    assert tarfile.open(mine).getnames()[0] == "pack.json"
    before = mine.read_bytes()
    res = cli("pack", reported, "-o", mine, "--force")
    one_line_exit_2(res, str(mine), "'notes/analysis.md', which nanbisect did not write",
                    "pass another -o, or move the file away")
    assert mine.read_bytes() == before
    # the same files re-tarred without the notes, but with tar's directory members: refused too
    plain = tmp_path / "plain.tar.gz"
    shutil.rmtree(u / "notes")
    with tarfile.open(plain, "w:gz") as tar:
        tar.add(u / "pack.json", arcname="pack.json")
        for p in sorted(u.iterdir()):
            if p.name != "pack.json":
                tar.add(p, arcname=p.name)
    _refused(reported, plain, "'bundle', a directory; nanbisect writes only files")


def test_force_refuses_a_pack_with_an_appended_archive_or_bytes(reported, ticket, tmp_path):
    """`cat t.tar.gz notes.tar.gz`: a second gzip member, which gunzip and tar read as one
    archive with the notes in it; trailing bytes of any other kind (zeros too)."""
    notes = io.BytesIO()
    with tarfile.open(fileobj=notes, mode="w:gz") as tar:
        data = b"my notes\n"
        info = tarfile.TarInfo("notes/todo.md")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    appended = tmp_path / "appended.tar.gz"
    appended.write_bytes(ticket.read_bytes() + notes.getvalue())
    with tarfile.open(appended, "r:gz", ignore_zeros=True) as tar:
        assert "notes/todo.md" in tar.getnames()     # tar -xzi would give the notes back
    _refused(reported, appended, "a second gzip stream follows")
    for i, tail in enumerate([b"the user's text, appended\n", bytes(512)]):
        trailing = tmp_path / f"trailing{i}.tar.gz"
        trailing.write_bytes(ticket.read_bytes() + tail)
        _refused(reported, trailing, "bytes follow the end of its gzip stream")
    # inside the gzip stream: a member after the end-of-archive blocks (tar -i reads it)
    raw = gzip.decompress(ticket.read_bytes())
    inner = tmp_path / "inner.tar.gz"
    inner.write_bytes(gzip.compress(raw + gzip.decompress(notes.getvalue())))
    _refused(reported, inner, "after its end-of-archive blocks")


def test_force_refuses_a_pack_whose_member_was_edited_or_removed(reported, ticket, tmp_path):
    members = _members(ticket)
    i = next(i for i, (m, _) in enumerate(members) if m.name == "report/report.md")
    info, data = members[i]
    edited = tmp_path / "edited.tar.gz"
    same_size = bytes(data[:-2]) + b"!\n" if data[-2:] != b"!\n" else bytes(data[:-2]) + b"?\n"
    assert len(same_size) == len(data) and same_size != data
    _write(edited, [*members[:i], (info, same_size), *members[i + 1:]])
    _refused(reported, edited, "'report/report.md' is not the file its pack.json records",
             "edited since nanbisect wrote it")
    longer = tmp_path / "longer.tar.gz"
    grown = tarfile.TarInfo(info.name)
    grown.size = len(data) + 5
    _write(longer, [*members[:i], (grown, data + b"more\n"), *members[i + 1:]])
    _refused(reported, longer, f"is {len(data) + 5} bytes, not the {len(data)}")
    fewer = tmp_path / "fewer.tar.gz"
    _write(fewer, [*members[:i], *members[i + 1:]])
    _refused(reported, fewer, "'report/report.md', listed in its pack.json, is missing")
    # pack.json itself edited: a field added (a note), or a listed hash changed
    head = json.loads(members[0][1])
    for j, changed in enumerate([{**head, "notes": "call Bob"},
                                 {**head, "members": [{**m, "sha256": "0" * 64}
                                                      for m in head["members"]]}]):
        data = json.dumps(changed, indent=1).encode()
        pj = tarfile.TarInfo("pack.json")
        pj.size = len(data)
        path = tmp_path / f"head{j}.tar.gz"
        _write(path, [(pj, data), *members[1:]])
        _refused(reported, path, ["'notes', a field nanbisect does not write",
                                  "not the file its pack.json records"][j])


def test_force_refuses_an_older_pack_that_cannot_be_proven(reported, ticket, tmp_path):
    """A pack from before pack.json listed sizes and hashes: pack.json first with the schema but
    no members (before: replaced), and the oldest (pack.json last, no schema; before: replaced)."""
    members = _members(ticket)
    head = json.loads(members[0][1])
    head.pop("members", None)
    data = json.dumps(head, indent=1).encode()
    pj = tarfile.TarInfo("pack.json")
    pj.size = len(data)
    older = tmp_path / "older.tar.gz"
    _write(older, [(pj, data), *members[1:]])
    _refused(reported, older, "written by an older nanbisect",
             "records no size or sha256 of its members", "cannot be proven")
    oldest = tmp_path / "oldest.tar.gz"
    _write(oldest, [*members[1:], members[0]])
    _refused(reported, oldest, "its first member is 'environment.json', not pack.json")


def test_force_refuses_a_huge_file_without_reading_it(reported, ticket, tmp_path):
    """A 5 GiB file that starts as a pack (sparse: no disk used) is refused from its size, at
    once (before: its first member said pack, and it was replaced)."""
    huge = tmp_path / "huge.tar.gz"
    shutil.copyfile(ticket, huge)
    with open(huge, "r+b") as f:
        f.truncate(5 << 30)
    t0 = time.monotonic()
    _refused(reported, huge, "it is 5368709120 bytes, more than the 4294967296 bytes --force "
             "reads to prove an archive is a pack")
    assert time.monotonic() - t0 < 10
    assert huge.stat().st_size == 5 << 30


def test_force_replaces_a_genuine_pack_and_the_new_one_is_provable(reported, ticket, tmp_path):
    head = json.loads(_members(ticket)[0][1])
    names = [m.name for m, _ in _members(ticket)]
    assert names[0] == "pack.json" and [m["name"] for m in head["members"]] == names[1:]
    for m, data in _members(ticket)[1:]:
        entry = next(e for e in head["members"] if e["name"] == m.name)
        assert entry["size"] == len(data) == m.size
    assert pk.is_pack(ticket)
    res = invoke("pack", reported, "-o", ticket, "--force")
    assert res.code == 0 and pk.is_pack(ticket), res.stderr
    # the same members re-tarred as files, pack.json first, by another tool: still only what
    # nanbisect wrote, so replaced
    again = tmp_path / "again.tar.gz"
    _write(again, _members(ticket))
    assert pk.is_pack(again) and invoke("pack", reported, "-o", again, "--force").code == 0
    # over the CLI in a process of its own, as a user runs it
    res = cli("pack", reported, "-o", ticket, "--force")
    assert res.code == 0 and "wrote" in res.stdout, res.stderr
    assert os.listdir(tmp_path).count("ticket.tar.gz") == 1
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []


def test_unpack_onto_a_disk_that_fills_names_the_full_disk(tmp_path):
    """The first error wins: a 3 MiB member onto a 1 MiB tmpfs (the staging marker takes one
    page, so a 1 MiB chunk is written short and its last 4 KiB wait in the buffer; the next
    write fails, and so does the close that flushes them). Before: "is not a readable archive,
    or is truncated or damaged (OSError: [Errno 28] ...)"."""
    archive = tmp_path / "big.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = os.urandom(3 << 20)
        info = tarfile.TarInfo("report/big.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    for size in ("1m", "1028k", "256k"):
        with tmpfs(tmp_path / f"fs{size}", size) as fs:
            line = one_line_exit_2(invoke("unpack", archive, fs / "u"), f"'{fs / 'u'}'",
                                   "(No space left on device)", "nothing was kept")
            assert "not a readable archive" not in line
            assert list(fs.iterdir()) == []


def _fill(fs) -> None:
    with open(fs / "filler", "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(os.urandom(1 << 16))
                f.flush()
    assert (fs / "filler").stat().st_size > 0


def test_pack_onto_a_full_disk_reports_the_first_error(reported, tmp_path, monkeypatch):
    """A file that changes while it is packed, onto a full disk: the change is reported (the
    half-written archive fails to close on the full disk too, and that must not replace it);
    nothing left there."""
    orig = getattr(pk, "_file_digest", None)

    def then_changed(f):
        got = orig(f)
        if f.name == "report.md":       # a writer appends just after pack read it
            with open(f, "ab") as out:
                out.write(b"appended while packing\n")
        return got

    monkeypatch.setattr(pk, "_file_digest", then_changed, raising=False)
    with tmpfs(tmp_path / "full", "64k") as fs:
        _fill(fs)
        one_line_exit_2(invoke("pack", reported, "-o", fs / "t.tar.gz"),
                        "report.md' changed while it was packed", "nothing was written")
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]
    monkeypatch.setattr(pk, "_file_digest", orig, raising=False)
    with tmpfs(tmp_path / "full2", "64k") as fs:       # and the full disk alone: named
        _fill(fs)
        one_line_exit_2(invoke("pack", reported, "-o", fs / "t.tar.gz"),
                        "(No space left on device)", "nothing was written")
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]


def test_pack_of_an_unreadable_file_onto_a_full_disk_names_the_file(reported, tmp_path):
    """The file that cannot be read is the first error (before: the full disk's second
    failure, as the half-written archive was closed, replaced it)."""
    from helpers.mounts import mode_bits_apply

    secret = reported / "nanbisect-report" / "report.md"
    secret.chmod(0)
    try:
        with tmpfs(tmp_path / "full", "64k") as fs:
            _fill(fs)
            with mode_bits_apply():
                res = invoke("pack", reported, "-o", fs / "t.tar.gz")
            assert sorted(p.name for p in fs.iterdir()) == ["filler"]
    finally:
        secret.chmod(0o644)
    one_line_exit_2(res, f"cannot read '{secret}' (Permission denied)")


def test_force_replaces_a_full_pack_of_zeros_that_expands_past_the_ratio(tmp_path):
    """A `--full` pack whose state is mostly zeros (fresh Adam moments) expands far past the 50x
    a hostile file is held to: once its pack.json is read, the members it lists bound the
    proof instead (review of issue 39: refused as "expands to more than ... bytes")."""
    import hashlib

    big = bytes(96 << 20)         # 96 MiB of zeros: ~100 KiB compressed, past 64 MiB and 50x
    env = json.dumps(pk.environment_summary(), indent=1).encode()
    members = [("environment.json", env), ("bundle/model.safetensors", big)]
    head = {"schema": pk.PACK_SCHEMA, "full": True, "left_out": [], "left_out_always": [],
            "members": [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                        for n, d in members]}
    path = tmp_path / "full.tar.gz"
    with pk._tar_gz(path) as tar:
        for name, data in [("pack.json", json.dumps(head, indent=1).encode()), *members]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    assert path.stat().st_size * 50 < len(big)
    assert pk._not_a_pack(path) is None
    with open(path, "ab") as f:       # the members' bound still holds against more data
        f.write(b"x")
    assert "bytes follow the end of its gzip stream" in pk._not_a_pack(path)
