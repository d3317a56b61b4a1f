"""pack / unpack: small archive, repro runs after unpacking elsewhere, hostile archives refused;
`pack -o` never replaces or changes what nanbisect did not write (an existing path unless
--force and an earlier pack, anything inside a bundle or the directory packed); a destination
that cannot be written (full, read-only, busy, no permission) is one line, exit 2, nothing
left."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from helpers import FIXTURES, cli, invoke, one_line_exit_2, tree_digest
from helpers.mounts import mode_bits_apply, read_only, tmpfs

from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.pack import PACK_SCHEMA, is_pack
from nanbisect.util.staging import MARKER as STAGING_MARKER


@pytest.mark.slow
def test_pack_under_limit_and_repro_runs_after_unpack(fixture_bundle, tmp_path):
    bundle = fixture_bundle("forward_nan_behind_mask")
    assert cli("run", "--ckpt", bundle).code == 1
    archive = tmp_path / "ticket.tar.gz"
    res = cli("pack", bundle, "-o", archive)
    assert res.code == 0, res.stderr
    assert archive.stat().st_size < 10 * 1024 * 1024
    names = tarfile.open(archive).getnames()
    assert "report/repro/repro.py" in names and "report/report.md" in names
    assert "bundle/manifest.json" in names and "environment.json" in names
    assert "bundle/model.safetensors" not in names and "bundle/optimizer.safetensors" not in names
    fresh = tmp_path / "fresh"
    assert cli("unpack", archive, fresh).code == 0
    env = json.loads((fresh / "environment.json").read_text())
    assert env["torch"] and "variables" in env
    p = subprocess.run([sys.executable, str(fresh / "report" / "repro" / "repro.py")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 1 and "REPRODUCED" in p.stdout
    full = tmp_path / "full.tar.gz"
    assert cli("pack", bundle, "-o", full, "--full").code == 0
    assert "bundle/model.safetensors" in tarfile.open(full).getnames()


def test_a_ticket_round_trip_to_another_cpu_names_the_difference(travel_bundle, tmp_path):
    """pack here, unpack and run on another machine (simulated: the unpacked manifest's
    fingerprint names another CPU, as this machine's would there): the same culprit and
    classification, the difference named, never replay-mismatch."""
    from nanbisect import devices
    from nanbisect.bundle.pack import pack, unpack
    from nanbisect.pipeline import RunOptions, run_bundle

    bundle = tmp_path / "b"
    shutil.copytree(travel_bundle, bundle)
    here = run_bundle(bundle, RunOptions(run_repro=False))
    pack(bundle, tmp_path / "ticket.tar.gz", full=True)
    unpack(tmp_path / "ticket.tar.gz", tmp_path / "there")
    env = json.loads((tmp_path / "there" / "environment.json").read_text())
    assert env["hardware"] == devices.fingerprint()
    there = tmp_path / "there" / "bundle"
    m = json.loads((there / "manifest.json").read_text())
    m["environment"]["hardware"]["cpu"]["processor"] = "Some Other CPU @ 2.1GHz"
    (there / "manifest.json").write_text(json.dumps(m))
    r = run_bundle(there, RunOptions(run_repro=False))
    assert (r.verdict, r.classification, r.culprit.op, r.culprit.parameter) == (
        here.verdict, here.classification, here.culprit.op, here.culprit.parameter)
    now = devices.fingerprint()["cpu"].get("processor")
    assert r.facts.fidelity.hardware_changed == [
        f"cpu processor: Some Other CPU @ 2.1GHz at capture, {now} now"]
    assert r.facts.fidelity.tier == "bit-exact" and here.facts.fidelity.hardware_changed == []
    assert any("other hardware than the capture's" in n for n in r.notes)


def _hostile(path, name, kind=tarfile.REGTYPE):
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        if kind == tarfile.SYMTYPE:
            info.linkname = "/etc/passwd"
            tar.addfile(info)
        else:
            data = b"x"
            info.size = 1
            tar.addfile(info, io.BytesIO(data))


def test_unpack_refuses_escaping_members(tmp_path):
    for i, (name, kind) in enumerate([("../evil", tarfile.REGTYPE),
                                      ("/tmp/evil-abs", tarfile.REGTYPE),
                                      ("report/link", tarfile.SYMTYPE)]):
        a = tmp_path / f"h{i}.tar.gz"
        _hostile(a, name, kind)
        dest = tmp_path / f"d{i}"
        res = cli("unpack", a, dest)
        assert res.code == 2 and "refusing the whole archive" in res.stderr
        assert not dest.exists()
    assert not (tmp_path / "evil").exists()


def test_pack_without_report_is_bad_input(fixture_bundle, tmp_path):
    res = cli("pack", fixture_bundle("healthy"), "-o", tmp_path / "x.tar.gz")
    assert res.code == 2 and "run `nanbisect run " in res.stderr


def test_pack_refuses_paths_inside_a_bundle(reported, tmp_path):
    """`-o BUNDLE/model.safetensors` used to exit 0 and break the bundle's sha256."""
    other = tmp_path / "other"
    shutil.copytree(FIXTURES / "healthy", other, ignore=shutil.ignore_patterns("nanbisect-report"))
    before, before_other = tree_digest(reported), tree_digest(other)
    for dest, words in [(reported / "model.safetensors", "inside the bundle"),
                        (reported / "new.tar.gz", "inside the bundle"),
                        (reported / "nanbisect-report" / "t.tar.gz", "inside"),
                        (other / "t.tar.gz", "inside the bundle"),
                        (other / "sub" / "t.tar.gz", "inside the bundle")]:
        one_line_exit_2(invoke("pack", reported, "-o", dest, "--force"), words)
    assert tree_digest(reported) == before and tree_digest(other) == before_other
    read_bundle(reported)
    read_bundle(other)
    # a report directory outside its bundle: not inside itself either
    report = tmp_path / "report"
    shutil.copytree(reported / "nanbisect-report", report)
    one_line_exit_2(invoke("pack", report, "-o", report / "t.tar.gz"), "being packed")
    assert not (report / "t.tar.gz").exists()


def test_pack_never_replaces_a_file_a_directory_or_a_link(reported, tmp_path):
    mine = tmp_path / "thesis.tar.gz"
    mine.write_text("years of work")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "data.csv").write_text("1,2")
    os.symlink(mine, tmp_path / "ln.tar.gz")
    one_line_exit_2(invoke("pack", reported, "-o", mine), "exists", "--force")
    one_line_exit_2(invoke("pack", reported, "-o", mine, "--force"), "is not a pack")
    one_line_exit_2(invoke("pack", reported, "-o", tmp_path / "results", "--force"),
                    "is a directory")
    one_line_exit_2(invoke("pack", reported, "-o", tmp_path / "ln.tar.gz", "--force"),
                    "symbolic link")
    assert mine.read_text() == "years of work"
    assert (tmp_path / "results" / "data.csv").read_text() == "1,2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ln.tar.gz", "results",
                                                         "thesis.tar.gz"]


def test_pack_force_replaces_only_an_earlier_pack(reported, tmp_path):
    ticket = tmp_path / "ticket.tar.gz"
    assert invoke("pack", reported, "-o", ticket).code == 0
    first = tarfile.open(ticket).getmembers()[0]
    assert first.name == "pack.json" and is_pack(ticket)
    assert json.loads(tarfile.open(ticket).extractfile(first).read())["schema"] == PACK_SCHEMA
    one_line_exit_2(invoke("pack", reported, "-o", ticket), "exists", "--force")
    res = invoke("pack", reported, "-o", ticket, "--force")
    assert res.code == 0 and is_pack(ticket), res.stderr
    # a pack of an older nanbisect (pack.json last, no schema) lists no hashes: it cannot be
    # proven to hold only what nanbisect wrote, so it is refused (issue 39; before: replaced)
    old = tmp_path / "old.tar.gz"
    with tarfile.open(old, "w:gz") as tar:
        for name in ("report/report.md", "environment.json", "pack.json"):
            data = b"{}"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    before = old.read_bytes()
    assert not is_pack(old)
    one_line_exit_2(invoke("pack", reported, "-o", old, "--force"), "is not a pack",
                    "not pack.json", "cannot be proven", "another -o")
    assert old.read_bytes() == before
    # the user's own archive with a pack.json in it is not
    notes = tmp_path / "notes.tar.gz"
    with tarfile.open(notes, "w:gz") as tar:
        for name in ("pack.json", "environment.json", "notes/todo.md"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    before = notes.read_bytes()
    assert not is_pack(notes)
    one_line_exit_2(invoke("pack", reported, "-o", notes, "--force"), "is not a pack",
                    "its pack.json does not name the schema nanbisect.pack/1")
    assert notes.read_bytes() == before
    # ... nor with a pack.json that names the schema (tests/bundle/test_pack_force.py: the rest)
    with tarfile.open(notes, "w:gz") as tar:
        for name, data in (("pack.json", json.dumps({"schema": PACK_SCHEMA}).encode()),
                           ("environment.json", b"{}"), ("notes/todo.md", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    before = notes.read_bytes()
    one_line_exit_2(invoke("pack", reported, "-o", notes, "--force"), "an older nanbisect")
    assert notes.read_bytes() == before


def no_staging_left(d):
    return [p.name for p in d.rglob("*") if ".tmp-" in p.name or p.name == STAGING_MARKER]


def test_pack_and_unpack_on_a_full_file_system_are_one_line(reported, tmp_path):
    ticket = tmp_path / "ticket.tar.gz"
    assert invoke("pack", reported, "-o", ticket).code == 0
    with tmpfs(tmp_path / "full", "4k") as fs:
        one_line_exit_2(invoke("pack", reported, "-o", fs / "new" / "t.tar.gz"),
                        "No space left on device", "nothing was written")
        assert list(fs.iterdir()) == []
        one_line_exit_2(invoke("unpack", ticket, fs / "u"), "No space left on device",
                        "nothing was kept")
        assert list(fs.iterdir()) == []


def test_pack_and_unpack_on_read_only_busy_or_locked_paths_are_one_line(reported, tmp_path):
    ticket = tmp_path / "ticket.tar.gz"
    assert invoke("pack", reported, "-o", ticket).code == 0
    with read_only(tmp_path / "ro") as ro:
        one_line_exit_2(invoke("pack", reported, "-o", ro / "t.tar.gz"), "Read-only file system")
        one_line_exit_2(invoke("unpack", ticket, ro / "u"), "Read-only file system")
        assert list(ro.iterdir()) == []
    with tmpfs(tmp_path / "mnt", "1m") as mnt:          # an empty mount point: EBUSY to rename
        one_line_exit_2(invoke("unpack", ticket, mnt), "is a mount point")
        assert list(mnt.iterdir()) == []
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with mode_bits_apply():
            packed = invoke("pack", reported, "-o", locked / "sub" / "t.tar.gz")
            unpacked = invoke("unpack", ticket, locked / "u")
    finally:
        locked.chmod(0o755)
    one_line_exit_2(packed, "Permission denied")
    one_line_exit_2(unpacked, "Permission denied")
    assert list(locked.iterdir()) == [] and no_staging_left(tmp_path) == []


def test_unpacked_pack_holds_no_staging_marker_and_a_member_named_so_is_refused(reported,
                                                                                 tmp_path):
    ticket = tmp_path / "ticket.tar.gz"
    assert invoke("pack", reported, "-o", ticket).code == 0
    assert invoke("unpack", ticket, tmp_path / "u").code == 0
    assert not (tmp_path / "u" / STAGING_MARKER).exists() and no_staging_left(tmp_path) == []
    a = tmp_path / "forged.tar.gz"
    _hostile(a, STAGING_MARKER)
    one_line_exit_2(invoke("unpack", a, tmp_path / "v"), "reserves")
    assert not (tmp_path / "v").exists()
