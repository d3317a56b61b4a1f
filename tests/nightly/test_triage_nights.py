"""Triage as a nightly job runs it: night after night into dated folders that share one
``--cache``, the first night's ``--known`` file not there yet, reports that a full disk will not
take, the Python API's argument types, and the nightly script of docs/guide/triage.md itself,
run as it is there for three nights. Real `python -m nanbisect triage` processes where only they
can show it; a tiny tmpfs (tests/helpers/mounts.py) for the full disk."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nanbisect
from helpers import ROOT, cli, invoke, one_line_exit_2
from helpers.mounts import tmpfs
from nanbisect import BadInput
from nanbisect.nightly.reports import report_name
from test_triage_faults import copy_fixture, nothing_left, scratch_env

# the signatures of the two small fixture bundles these nights replay
SQRT = ("aten.sqrt @ forward_nan_behind_mask.SoftClamp.forward · blocks.N.mlp.act · forward · "
        "float32 · unknown")
BATCH = "input-nonfinite · data"
GUIDE = ROOT / "docs" / "guide" / "triage.md"


def summary(out: Path) -> dict:
    return json.loads((out / "triage.json").read_text())


def fill(fs: Path) -> None:
    """Write into ``fs`` until its file system is full (ENOSPC)."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 1024)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# a full disk: every report not written says why


def _each_report_says_why(res, out: Path, fs: Path, cached: bool) -> None:
    """The night on a full ``out/reports``: exit 2 (every signature known, but reports missing),
    one line on stderr naming the count and the first reason, each row's ``report_error``."""
    assert res.code == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("nanbisect: warning: the report of 2 of 2 bundle(s) could not be "
                           "written (") and "No space left on device" in line, line
    assert str(out / "reports") in line and "run triage again" in line, line
    data = summary(out)
    assert data["exit_code"] == 2 and data["errors"] == []
    for row in data["bundles"]:
        assert row["report_dir"] is None and row["cached"] is cached, row
        where = out / "reports" / report_name(row["bundle"])
        assert row["report_error"] == f"No space left on device: '{where}'", row
    assert sorted(row["signature"] for row in data["bundles"]) == sorted([SQRT, BATCH])
    md = (out / "triage.md").read_text()
    assert "## Reports not written" in md and md.count("No space left on device") == 2, md
    assert [p.name for p in fs.iterdir()] == ["filler"]         # nothing half-written left


@pytest.mark.slow
def test_reports_a_full_disk_cannot_take_are_named_and_the_night_is_not_clean(tmp_path):
    """Today: exit 1 (as if all were well), nothing on stderr, ``report_dir`` null with no
    reason. Now each row says why, stderr says it once, and the night exits 2."""
    night = tmp_path / "night"
    copy_fixture("forward_nan_behind_mask", night / "job1" / "step3")
    copy_fixture("nan_batch", night / "job2" / "step5")
    known = tmp_path / "known.txt"
    known.write_text(f"{SQRT}\n{BATCH}\n")          # a text file of signatures, as ever
    out = tmp_path / "t"
    env = scratch_env(tmp_path)

    def night_run():
        return cli("triage", night, "--out", out, "--known", known, "--jobs", "1",
                   "--timeout", "300", env=env)

    with tmpfs(out / "reports", "16k") as fs:      # the replays' reports: ENOSPC
        fill(fs)
        _each_report_says_why(night_run(), out, fs, cached=False)
    # room again: the analyses were cached without their reports, so they are replayed
    res = night_run()
    assert res.code == 1 and res.stderr.strip() == "", res.stdout + res.stderr
    assert all(r["report_dir"] and not r["cached"] and r["report_error"] is None
               for r in summary(out)["bundles"])
    with tmpfs(out / "reports", "16k") as fs:      # the cache's copies of them: ENOSPC too
        fill(fs)
        _each_report_says_why(night_run(), out, fs, cached=True)
    nothing_left(tmp_path)


# --------------------------------------------------------------------------------------------
# --known


def test_a_known_file_that_does_not_exist_yet_is_an_empty_list_with_a_note(tmp_path):
    """The first night of a nightly job: last night's triage.json is not there yet. Today: exit
    2, "No such file or directory", nothing written."""
    (tmp_path / "night").mkdir()
    missing = tmp_path / "latest" / "triage.json"
    note = f"--known '{missing}' does not exist yet: every signature is new tonight"
    res = cli("triage", tmp_path / "night", "--out", tmp_path / "t", "--known", missing)
    assert res.code == 0, res.stdout + res.stderr
    assert res.stderr.strip() == f"nanbisect: note: {note}"
    assert summary(tmp_path / "t")["notes"] == [note]
    assert f"Note: {note}" in (tmp_path / "t" / "triage.md").read_text()
    found = nanbisect.triage(tmp_path / "night", out=tmp_path / "t2", known=missing)
    assert found.exit_code == 0 and found.to_json()["notes"] == [note]
    assert not missing.parent.exists()              # a note, nothing made where it points


def test_a_known_that_is_not_a_regular_file_is_refused_in_one_accurate_line(tmp_path):
    """Today: ``--known /dev/zero`` says "No such file or directory"."""
    (tmp_path / "night").mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                                 # reading it would block: never opened
    for path, what in [(tmp_path, "a directory"), (Path("/dev/zero"), "a character device"),
                       (fifo, "a FIFO (named pipe)")]:
        words = f"--known '{path}' is {what}, not a file; pass a triage.json or a text file"
        line = one_line_exit_2(invoke("triage", tmp_path / "night", "--out", tmp_path / "t",
                                      "--known", path), words)
        assert "No such file" not in line
        with pytest.raises(BadInput, match=re.escape(words)):
            nanbisect.triage(tmp_path / "night", out=tmp_path / "t", known=path)
    assert not (tmp_path / "t").exists()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


# --------------------------------------------------------------------------------------------
# --cache


@pytest.mark.slow
def test_a_cache_outside_out_is_shared_by_dated_folders(tmp_path):
    """``--cache`` (and the API's ``cache=``): the second night, in a folder of its own, is
    answered from the first night's cache, its report copied in; no cache inside either
    folder. A file there is refused like one at --out."""
    jobs = tmp_path / "jobs"
    copy_fixture("forward_nan_behind_mask", jobs / "job1" / "step3")
    reports = tmp_path / "triage"
    first, second, cache = reports / "2026-12-07", reports / "2026-12-08", reports / "cache"
    res = cli("triage", jobs, "--out", first, "--cache", cache, "--jobs", "1", "--timeout",
              "300", env=scratch_env(tmp_path))
    assert res.code == 3, res.stdout + res.stderr
    assert [(r["signature"], r["cached"]) for r in summary(first)["bundles"]] == [(SQRT, False)]
    assert list(cache.glob("*.json")) and not (first / "cache").exists()

    found = nanbisect.triage(jobs, out=second, cache=cache, known=[SQRT])
    assert found.exit_code == 1
    (row,) = found.to_json()["bundles"]
    assert row["cached"] and (second / row["report_dir"] / "report.html").is_file()
    assert not (second / "cache").exists()

    (tmp_path / "a_file").write_text("x")
    words = f"--cache '{tmp_path / 'a_file'}' is a file; pass a directory"
    one_line_exit_2(invoke("triage", jobs, "--out", tmp_path / "t", "--cache",
                           tmp_path / "a_file"), words)
    with pytest.raises(BadInput, match=re.escape(words)):
        nanbisect.triage(jobs, out=tmp_path / "t", cache=tmp_path / "a_file")
    assert not (tmp_path / "t").exists()
    nothing_left(tmp_path)


# --------------------------------------------------------------------------------------------
# the Python API's argument types, and an empty --out


def test_the_python_api_refuses_arguments_of_the_wrong_type_in_one_line(tmp_path, monkeypatch):
    """Today: ``triage(123)`` is a TypeError, ``out=''`` writes into the working directory,
    ``known=[None]`` is accepted."""
    monkeypatch.chdir(tmp_path)                     # where an empty out would have written
    night = tmp_path / "night"
    night.mkdir()
    for args, kw, words in [
            ((123,), {}, "triage: dirs=123 is neither a directory nor a list of them; pass"),
            ((None,), {}, "dirs=None is neither a directory nor a list"),
            (([night, 5],), {}, "dirs=5 is not a path"),
            ((night,), {"out": ""}, "out='' is empty; pass a directory"),
            ((night,), {"known": [None]}, "known=[None] holds None, not a signature; pass a "
                                          "list of str"),
            ((night,), {"known": 5}, "known=5 is neither a file nor a list of signatures"),
            ((night,), {"known": {"schema": "nanbisect.triage/1"}}, "is neither a file nor"),
            ((night,), {"cache": 7}, "cache=7 is not a path"),
            ((night,), {"cache": ""}, "cache='' is empty"),
            ((night,), {"target": 0}, "target=0 is not a str"),
            ((night,), {"backend": 5}, "backend=5 is not a str")]:
        with pytest.raises(BadInput) as e:
            nanbisect.triage(*args, **kw)
        assert words in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["night"]      # nothing written


def test_an_empty_out_is_refused_not_the_working_directory(tmp_path):
    (tmp_path / "night").mkdir()
    here = tmp_path / "cwd"
    here.mkdir()
    for flags in (["--out", ""], ["--out="], ["--cache", ""]):
        res = cli("triage", tmp_path / "night", *flags, cwd=here)
        one_line_exit_2(res, "'' is empty; pass a directory")
    assert list(here.iterdir()) == []


# --------------------------------------------------------------------------------------------
# the guide's nightly script, as the guide shows it, for three nights


def guide_script() -> str:
    """The ```sh block of docs/guide/triage.md's "A nightly job" section, exactly."""
    section = GUIDE.read_text().split("\n## A nightly job\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, flags=re.S | re.M)
    assert len(blocks) == 1, "the section should hold one sh block: the nightly job"
    return blocks[0]


def _shims(bin_dir: Path, log: Path) -> None:
    """``nanbisect`` (this interpreter's), ``date`` (the night the test says) and
    ``notify-oncall`` (which logs what it was told), ahead of PATH."""
    bin_dir.mkdir()
    shims = {"nanbisect": f'exec "{sys.executable}" -m nanbisect "$@"\n',
             "date": 'echo "$NIGHTLY_TEST_DATE"\n',
             "notify-oncall": f'echo "$@" >> "{log}"\n'}
    for name, body in shims.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)


@pytest.mark.slow
def test_the_guides_nightly_script_runs_three_nights(tmp_path):
    """Night 1 (no `latest` yet: --known does not exist) finds a new signature; night 2 a new
    bundle of another bug is the only new signature; night 3, with one more bundle of a known
    bug, nothing new. Each night in its dated folder, one cache for all of them. Today the
    script never starts: night 1's --known is refused (exit 2, nothing written), and its case
    says "some bundles could not be triaged"."""
    script = tmp_path / "nightly.sh"
    script.write_text(guide_script())
    jobs, reports, log = tmp_path / "jobs", tmp_path / "triage", tmp_path / "oncall.log"
    _shims(tmp_path / "bin", log)
    env = {**os.environ, **scratch_env(tmp_path), "JOBS": str(jobs), "REPORTS": str(reports),
           "TRIAGE_FLAGS": "--jobs 1 --timeout 120",
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    def night(date: str) -> tuple[subprocess.CompletedProcess, dict]:
        # from the repository: the fixtures' entries are relative to it
        p = subprocess.run(["sh", str(script)], cwd=ROOT, capture_output=True, text=True,
                           timeout=240, env={**env, "NIGHTLY_TEST_DATE": date})
        assert "Traceback" not in p.stdout + p.stderr, p.stderr
        assert (reports / "latest").resolve() == (reports / date).resolve(), p.stdout + p.stderr
        assert not (reports / date / "cache").exists()           # the shared one is used
        return p, summary(reports / date)

    def new(data: dict) -> list[str]:
        return [g["signature"] for g in data["signatures"] if not g["known"]]

    t0 = time.monotonic()
    copy_fixture("forward_nan_behind_mask", jobs / "job1" / "step3")
    p, data = night("2026-12-07")
    assert p.returncode == 3, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == \
        f"NEW failure signature: see {reports}/2026-12-07/triage.md", p.stdout
    assert "nanbisect: note: --known" in p.stderr and "does not exist yet" in p.stderr
    assert data["notes"] and new(data) == [SQRT]

    copy_fixture("nan_batch", jobs / "job2" / "step5")
    p, data = night("2026-12-08")
    assert p.returncode == 3, p.stdout + p.stderr
    assert new(data) == [BATCH] and data["notes"] == []
    assert {r["signature"]: r["cached"] for r in data["bundles"]} == {SQRT: True, BATCH: False}

    copy_fixture("forward_nan_behind_mask", jobs / "job3" / "step9")    # a known bug again
    p, data = night("2026-12-09")
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1] == "failures, all with known signatures"
    assert new(data) == [] and all(r["cached"] for r in data["bundles"])
    assert [Path(line).parent.name for line in log.read_text().splitlines()] == \
        ["2026-12-07", "2026-12-08"]                   # on-call told of the new nights only
    assert sorted(p.name for p in reports.iterdir()) == ["2026-12-07", "2026-12-08",
                                                         "2026-12-09", "cache", "latest"]
    nothing_left(tmp_path)
    print(f"\nthree nights in {time.monotonic() - t0:.1f}s")
