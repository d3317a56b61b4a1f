"""nanbisect triage through the CLI: groups, counts, exit protocol, a corrupted bundle, what is
skipped and left over, and the JSON cache (hits, and misses when the code changes)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, ROOT, TEST_TASKS, cli, invoke
from helpers.mounts import read_only, tmpfs

from nanbisect.nightly import normalise_module
from nanbisect.util.staging import make_staging_dir


def make_tree(root):
    for name in ["forward_nan_behind_mask", "backward_nan_custom_function", "nan_batch",
                 "healthy"]:
        shutil.copytree(FIXTURES / name, root / name,
                        ignore=shutil.ignore_patterns("nanbisect-report"))
    shutil.copytree(FIXTURES / "forward_nan_behind_mask", root / "night2" / "same_fault",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    broken = root / "corrupted"
    shutil.copytree(FIXTURES / "healthy", broken, ignore=shutil.ignore_patterns("nanbisect-report"))
    (broken / "model.safetensors").write_bytes(b"truncated")
    # not bundles: a log directory, an empty job directory, a foreign manifest
    (root / "logs" / "rank0").mkdir(parents=True)
    (root / "logs" / "rank0" / "train.log").write_text("step 5: loss nan\n")
    (root / "night2" / "job_without_bundle").mkdir()
    (root / "other_tool").mkdir()
    (root / "other_tool" / "manifest.json").write_text('{"schema": "other.tool/2"}')
    # what a capture killed half-way leaves: listed as a leftover, never triaged as a bundle
    left = make_staging_dir(root / "night2" / ".step000001.tmp-0123abcd")   # with its marker
    (left / "model.safetensors").write_bytes(b"12345")
    return root


def test_normalise_module():
    assert normalise_module("layers.3.mlp") == normalise_module("layers.17.mlp") == "layers.N.mlp"
    assert normalise_module("blocks.0.attn.qkv") == "blocks.N.attn.qkv"
    assert normalise_module("fc1") == "fc1"


def test_reports_are_replaced_whole_and_an_error_row_removes_last_nights(tmp_path):
    from nanbisect.nightly.reports import place
    from nanbisect.nightly.summary import NightState

    def report(verdict):
        src = Path(tempfile.mkdtemp(dir=tmp_path))
        (src / "report.json").write_text(json.dumps({"verdict": verdict}))
        return src

    state = NightState([tmp_path], set(), tmp_path / "out", {}, "loky", 10.0)
    dest = state.report_path(str(tmp_path / "job" / "step1"))
    assert dest.parent == tmp_path / "out" / "reports" and dest.name.startswith("job-step1-")
    # a worker that does not see OUT (a cluster without it) keeps nothing, makes nothing
    assert not place(report("culprit"), dest) and not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()                      # as triage makes it before any replay
    for verdict in ("culprit", "clean"):
        src = report(verdict)
        assert place(src, dest) and not src.exists()
        assert json.loads((dest / "report.json").read_text())["verdict"] == verdict
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]     # nothing staged is left
    # a directory that is not a report is never replaced, nor removed
    foreign = state.report_path(str(tmp_path / "other"))
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert not place(report("clean"), foreign) and (foreign / "notes.txt").exists()
    # tonight the bundle is an error row: last night's report must not stay linked
    state.add({"bundle": str(tmp_path / "job" / "step1"), "error": "boom", "kind": "crash"}, False)
    state.add({"bundle": str(tmp_path / "other"), "error": "boom", "kind": "crash"}, False)
    assert not dest.exists() and (foreign / "notes.txt").exists()


def cache_entries(out) -> dict[str, float]:
    """What the cache holds: one JSON file per cached analysis, with its mtime."""
    return {f.name: f.stat().st_mtime_ns for f in (out / "cache").glob("*.json")}


@pytest.mark.slow
def test_triage_groups_counts_errors_skips_and_cache(tmp_path):
    root = make_tree(tmp_path / "night")
    out = tmp_path / "t"
    res = cli("triage", root, "--out", out, "--jobs", "2")
    assert res.code == 3, res.stdout + res.stderr                  # new signatures
    data = json.loads((out / "triage.json").read_text())
    assert data["finished"] and data["interrupted"] is None and data["pending"] == []
    sigs = {g["signature"]: g for g in data["signatures"]}
    sqrt = next(g for s, g in sigs.items() if s.startswith("aten.sqrt @ "))
    assert sqrt["count"] == 2 and "blocks.N.mlp.act" in sqrt["signature"]
    # a backward culprit: its autograd node (the op, aten.div, without one) and the function
    # of the user line (the custom Function's apply, in the module that calls it)
    assert any(s.startswith(("_LogReLUFnBackward @ backward_nan_custom_function.",
                             "aten.div @ backward_nan_custom_function."))
               and " · blocks.N.mlp.act · backward · float32 · " in s for s in sigs), sigs
    assert "input-nonfinite · data" in sigs
    assert [e["bundle"].endswith("corrupted") for e in data["errors"]] == [True]
    assert "sha256" in data["errors"][0]["error"]
    assert {b["bundle"].rsplit("/", 1)[1]: b["verdict"] for b in data["bundles"]}["healthy"] \
        == "clean"
    md = (out / "triage.md").read_text()
    assert "| 2 | `aten.sqrt @ " in md and "corrupted" in md
    # every bundle counted once: 5 replayed (the copy too) and the corrupted one
    assert "6 bundle(s): 5 replayed, 1 error(s); 3 signature(s)" in md, md

    _reports_kept_and_linked(root, out, data)
    _skipped_and_leftovers_listed(root, data, md)

    # one cache entry per distinct bundle content (same_fault is a copy: it shares its entry,
    # and its replay: copies in one night are replayed once)
    assert not any(b["cached"] for b in data["bundles"])
    same = {b["bundle"][len(str(root)) + 1:]: b.get("same_as") for b in data["bundles"]}
    assert same["night2/same_fault"] == str(root / "forward_nan_behind_mask")
    assert sum(v is None for v in same.values()) == len(same) - 1
    entries = cache_entries(out)
    assert len(entries) == len(data["bundles"]) - 1

    # second run: the cache answers, and with every signature known the exit code says so
    (tmp_path / "known.json").write_text((out / "triage.json").read_text())
    res2 = cli("triage", root, "--out", out, "--known", tmp_path / "known.json", "--jobs", "2")
    assert res2.code == 2, res2.stdout                 # known only, but an error remains
    again = json.loads((out / "triage.json").read_text())
    assert all(b["cached"] for b in again["bundles"]) and len(again["bundles"]) == 5
    assert cache_entries(out) == entries               # nothing recomputed, nothing rewritten
    # the cache brought each report back; every signature was in last night's summary
    for b in again["bundles"]:
        assert b["report_dir"] and (out / b["report_dir"] / "report.html").is_file(), b
    index = (out / "index.html").read_text()
    assert "seen before" in index and "first night" not in index and ">new<" not in index
    shutil.rmtree(root / "corrupted")
    assert cli("triage", root, "--out", out, "--known", tmp_path / "known.json").code == 1


def _reports_kept_and_linked(root: Path, out: Path, data: dict) -> None:
    """Each bundle's report is kept under out/reports, never in the bundle; the index links it."""
    assert not list(root.rglob("nanbisect-report"))
    dirs = {b["bundle"][len(str(root)) + 1:]: b["report_dir"] for b in data["bundles"]}
    assert dirs["night2/same_fault"] == dirs["forward_nan_behind_mask"]   # one replay, one report
    for name, rel in dirs.items():
        assert rel.startswith("reports/"), (name, rel)
        kept = json.loads((out / rel / "report.json").read_text())
        assert kept["verdict"] == {b["bundle"]: b["verdict"] for b in data["bundles"]}[
            str(root / name)] and (out / rel / "report.html").is_file()
    assert (out / dirs["forward_nan_behind_mask"] / "repro" / "repro.py").is_file()
    index = (out / "index.html").read_text()
    assert "6 bundle(s): 5 replayed, 1 error(s)" in index and "first night" in index
    assert all(f'href="{rel}/report.html"' in index for rel in dirs.values())
    assert "corrupted" in index.split("Errors (no report)")[1]


def _skipped_and_leftovers_listed(root: Path, data: dict, md: str) -> None:
    """The topmost directories without a bundle are skipped with the reason; leftovers listed."""
    skipped = {s["path"][len(str(root)) + 1:]: s["reason"] for s in data["skipped"]}
    assert set(skipped) == {"logs", "night2/job_without_bundle", "other_tool"}, skipped
    assert "other.tool/2" in skipped["other_tool"] and "no manifest" in skipped["logs"]
    left = root / "night2" / ".step000001.tmp-0123abcd"
    written = sum(f.stat().st_size for f in left.iterdir())
    assert [(x["path"].endswith("night2/.step000001.tmp-0123abcd"), x["bytes"], x["kind"])
            for x in data["leftovers"]] == [(True, written, "tmp")]
    assert not any(".tmp-" in b["bundle"] for b in data["bundles"] + data["errors"])
    assert "job_without_bundle" in md and ".step000001.tmp-0123abcd" in md


@pytest.mark.slow
def test_triage_all_clean_and_bad_input(tmp_path):
    import nanbisect
    import triage_faults       # tests/tasks: `fine` is a tiny step without a fault

    nanbisect.capture(triage_faults.fine(), triage_faults.batch(), tmp_path / "h" / "b",
                      entry=f"{TEST_TASKS / 'triage_faults.py'}:fine")
    res = cli("triage", tmp_path / "h", "--out", tmp_path / "o")
    assert res.code == 0, res.stdout + res.stderr
    assert [b["verdict"] for b in json.loads((tmp_path / "o" / "triage.json").read_text())[
        "bundles"]] == ["clean"]
    for args, words in [((tmp_path / "nope",), "does not exist"),
                        ((tmp_path / "h", "--timeout", "0"), "--timeout"),
                        ((tmp_path / "h", "--backend", "spark"), "unknown --backend"),
                        ((tmp_path / "h", "--scheduler", "tcp://127.0.0.1:1"), "--backend dask"),
                        ((tmp_path / "h", "--backend", "dask"), "needs --scheduler")]:
        res = cli("triage", *args, "--out", tmp_path / "o2")
        assert res.code == 2 and words in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "o2").exists()                # bad input: nothing written
    (tmp_path / "file").write_text("x")
    res = cli("triage", tmp_path / "h", "--out", tmp_path / "file")
    assert res.code == 2 and "is a file" in res.stderr


HELPER = """
import torch


def act(x):
    return torch.sqrt(x - 10.0)      # BUG: sqrt of a negative number
"""

TASK = """
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
import helper_ops  # noqa: E402

import nanbisect  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return helper_ops.act(self.fc(x)).sum(-1)


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).mean())
"""


@pytest.mark.slow
def test_cache_key_follows_the_code_on_disk(tmp_path):
    """The cache key hashes the entry and user source files as they are now: fixing the bug in
    a helper module the entry imports makes the next triage replay again, not answer with the
    old culprit."""
    import torch

    import nanbisect
    from nanbisect.task import import_target

    code = tmp_path / "code"
    code.mkdir()
    (code / "helper_ops.py").write_text(textwrap.dedent(HELPER))
    (code / "job.py").write_text(textwrap.dedent(TASK))
    mod = import_target(str(code / "job.py"))
    nanbisect.capture(mod.task(), torch.randn(3, 4), tmp_path / "night" / "step1",
                      entry=f"{code / 'job.py'}:task")
    manifest = json.loads((tmp_path / "night" / "step1" / "manifest.json").read_text())
    assert str((code / "helper_ops.py").resolve()) in manifest["code"]["sources"]

    out = tmp_path / "t"
    first = cli("triage", tmp_path / "night", "--out", out, "--jobs", "1")
    data = json.loads((out / "triage.json").read_text())
    assert first.code == 3, first.stdout + first.stderr
    assert [(b["verdict"], b["cached"]) for b in data["bundles"]] == [("culprit", False)]
    assert data["signatures"][0]["signature"].startswith("aten.sqrt @ ")

    (code / "helper_ops.py").write_text(textwrap.dedent(HELPER).replace(
        "torch.sqrt(x - 10.0)", "torch.sqrt((x - 10.0).abs())"))
    second = cli("triage", tmp_path / "night", "--out", out, "--jobs", "1")
    data = json.loads((out / "triage.json").read_text())
    assert [b["cached"] for b in data["bundles"]] == [False], second.stdout
    assert data["bundles"][0]["verdict"] == "clean"               # the fix, not the old culprit
    assert data["signatures"] == [] and second.code == 0
    assert len(list((out / "cache").glob("*.json"))) == 2          # one entry per code version


def test_summary_on_a_full_or_read_only_out_is_one_line_before_any_replay(tmp_path):
    """triage.json cannot be written: one line, exit 2, at the start (not after the night's
    replays), and the --out directories it made are removed again."""
    root = tmp_path / "night"
    shutil.copytree(FIXTURES / "nan_batch", root / "b",
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    with tmpfs(tmp_path / "full", "4k") as fs:
        (fs / "filler").write_bytes(b"x" * 4000)
        res = invoke("triage", root, "--out", fs / "t" / "night")
        line = res.stderr.strip()
        assert res.code == 2 and "\n" not in line and "No space left on device" in line, line
        assert [p.name for p in fs.iterdir()] == ["filler"]      # no t/, no cache
    with read_only(tmp_path / "ro") as ro:
        res = invoke("triage", root, "--out", ro)
        line = res.stderr.strip()
        assert res.code == 2 and "\n" not in line and "Read-only file system" in line, line
        assert list(ro.iterdir()) == []


# --------------------------------------------------------------------------------------------
# the sweep of what killed triage runs left in $TMPDIR: decided by a lock the live run holds
# (nanbisect.util.lockdir), never by the pid in a directory's name

# holds a scratch directory's lock as a live triage run does, until killed
_HOLD = """
import sys, time
from nanbisect.util import lockdir
path, fd = lockdir.make(sys.argv[1], sys.argv[2])
print(path, flush=True)
time.sleep(600)
"""


def hold_scratch(tmp: Path, prefix: str, pid_namespace: bool = False
                 ) -> tuple[subprocess.Popen, Path]:
    """A live process (in a PID namespace of its own with ``pid_namespace``: ``unshare``)
    holding the lock of a new ``tmp/PREFIX*`` directory: (the process, the directory)."""
    cmd = [sys.executable, "-c", _HOLD, prefix, str(tmp)]
    if pid_namespace:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline().strip()
    if not line:
        p.wait(30)
        raise OSError(p.stderr.read().strip() or f"exit {p.returncode}")
    return p, Path(line)


def _can_unshare_pid() -> str | None:
    """None when ``unshare --pid --fork`` works here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    p = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"unshare --pid: {p.stderr.strip()[:200]}"


def test_sweep_keeps_live_runs_and_removes_dead_ones_whatever_their_names(tmp_path,
                                                                          monkeypatch):
    from nanbisect.nightly.night import _sweep_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    holders = []
    try:
        # alive in another process, its name a pid that lives nowhere
        p, live = hold_scratch(tmp_path, "nanbisect-triage-999999999-")
        holders.append(p)
        # alive in another PID namespace (a container sharing $TMPDIR): the pid in its name
        # means nothing here
        why = _can_unshare_pid()
        live_ns = None
        if why is None:
            p, live_ns = hold_scratch(tmp_path, "nanbisect-triage-999999998-", True)
            holders.append(p)
        # a loose replay scratch directory whose starter is alive
        p, loose_live = hold_scratch(tmp_path, "nanbisect-triage-")
        holders.append(p)
        # dead: its holder killed by SIGKILL; its name an unrelated live pid (this one's)
        p, dead = hold_scratch(tmp_path, f"nanbisect-triage-{os.getpid()}-")
        p.kill()
        p.wait(10)
        p, loose_dead = hold_scratch(tmp_path, "nanbisect-triage-")
        p.kill()
        p.wait(10)
        # no lock (an older nanbisect's, or killed before its lock existed): by age only
        young = tmp_path / "nanbisect-triage-12345-abcd1234"
        old = tmp_path / "nanbisect-triage-12346-abcd1234"
        for d in (young, old):
            d.mkdir()
            (d / "stderr").write_text("x")
        os.utime(old, (time.time() - 3 * 86400,) * 2)
        other = tmp_path / "not-nanbisect-triage-1-abcd1234"    # not a name of ours
        other.mkdir()

        _sweep_scratch(timeout=60)

        kept = {live, loose_live, young, other} | ({live_ns} if live_ns else set())
        assert {d for d in kept if not d.is_dir()} == set()
        assert [d.name for d in (dead, loose_dead, old) if d.exists()] == []
        assert all(p.poll() is None for p in holders)     # the sweep touched no process
        if why is not None:
            pytest.skip(f"the other PID namespace was not tried: {why}")
    finally:
        for p in holders:
            p.kill()
            p.wait(10)
    _sweep_scratch(timeout=60)                 # their holders gone, the live ones go too
    assert not live.exists() and not loose_live.exists()


def test_workers_share_the_cores_and_each_replay_keeps_to_its_share(tmp_path):
    # two workers on the cores this test may use: each replay gets cores // 2 intra-op threads
    # (joblib's OMP_NUM_THREADS in its worker), never the capture's 2 beyond that, and says so
    from joblib import cpu_count

    cores = cpu_count()
    if cores < 2:
        pytest.skip("one core: two workers cannot share it")
    for name in ("backward_nan_custom_function", "forward_nan_behind_mask"):
        shutil.copytree(FIXTURES / name, tmp_path / "night" / name,
                        ignore=shutil.ignore_patterns("nanbisect-report"))
    res = cli("triage", tmp_path / "night", "--out", tmp_path / "o", "--jobs", "2")
    assert res.code in (1, 3), res.stdout + res.stderr
    data = json.loads((tmp_path / "o" / "triage.json").read_text())
    rows = data["bundles"]
    assert len(rows) == 2 and all(r["verdict"] == "culprit" for r in rows)
    share = cores // 2
    assert [r["threads"] for r in rows] == [share, share]   # two workers: their threads add
    #                                                         up to the cores, never beyond
    for r in rows:      # the replay ran with its share, and its report says so when that is less
        rep = json.loads((tmp_path / "o" / r["report_dir"] / "report.json").read_text())
        noted = [n for n in rep["notes"] if "intra-op thread" in n]
        if share < 2:     # the capture used 2
            assert noted and noted[0].startswith(f"replayed with {share} intra-op thread(s)")
            assert any(e.startswith("torch_threads 2 at capture, 1 now")
                       for e in rep["replay"]["environment_changed"]), rep["replay"]
