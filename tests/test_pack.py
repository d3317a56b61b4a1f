"""pack / unpack: small archive, repro runs after unpacking elsewhere, hostile archives refused."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

from conftest import cli


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
    assert res.code == 2 and "run `nanbisect run --ckpt" in res.stderr
