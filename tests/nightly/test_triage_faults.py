"""Triage survives anything: replays that crash, abort, are SIGKILLed or hang, manifests that are
malformed, and triage itself being interrupted or killed -9; then triage on a real Dask
LocalCluster (and a local Ray cluster when ray is installed). Real processes and signals only:
the faulting tasks are in tests/tasks/triage_faults.py, captured into bundles here."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FIXTURES, ROOT, TEST_TASKS, cli
from nanbisect.util import lockdir
from test_triage import hold_scratch

FAULTS = TEST_TASKS / "triage_faults.py"


def capture_fault(name: str, path: Path) -> Path:
    import nanbisect
    import triage_faults

    return nanbisect.capture(getattr(triage_faults, name)(), triage_faults.batch(), path,
                             entry=f"{FAULTS}:{name}")


def copy_fixture(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("nanbisect-report"))
    return dst


def processes_mentioning(text: str) -> dict[int, str]:
    """pid -> cmdline of every live process (zombies excepted) whose command line holds
    ``text``, read from /proc."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found[int(p.name)] = cmd
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children of children too), from /proc."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def scratch_env(tmp_path: Path) -> dict:
    """TMPDIR for the triage under test: the replays' scratch directories land in the test's
    own directory, where they can be counted."""
    (tmp_path / "scratch").mkdir(exist_ok=True)
    return {"TMPDIR": str(tmp_path / "scratch")}


def scratch_left(tmp_path: Path) -> list[str]:
    d = tmp_path / "scratch"
    return sorted(p.name for p in d.iterdir() if p.name.startswith("nanbisect-triage-")) \
        if d.is_dir() else []


def nothing_left(tmp_path: Path) -> None:
    """No process names the test's directory and no replay scratch directory is left (a
    replay's guardian goes a moment after its replay: allowed a few seconds under load)."""
    wait_for(lambda: not processes_mentioning(str(tmp_path)) and not scratch_left(tmp_path), 10,
             f"nothing left: {processes_mentioning(str(tmp_path))} {scratch_left(tmp_path)}")


def start_triage(tmp_path: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanbisect", "triage", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **scratch_env(tmp_path)})


def summary(out: Path) -> dict | None:
    try:
        return json.loads((out / "triage.json").read_text())
    except (OSError, ValueError):
        return None


def write_malformed(root: Path) -> dict[str, str]:
    """Bundles whose manifest is hostile; name -> a word its error row must hold."""
    base = json.loads((FIXTURES / "healthy" / "manifest.json").read_text())
    cases = {"deep": ("[" * 100_000 + "]" * 100_000, "deep"),
             "files_list": (json.dumps({**base, "files": []}), "files"),
             "garbage": (os.urandom(2000), "JSON"),
             "not_object": ("[1, 2]", "schema"),
             "entry_number": (json.dumps({**base, "entry": 7}), "entry")}
    for name, (text, _) in cases.items():
        d = copy_fixture("healthy", root / name)
        if isinstance(text, bytes):
            (d / "manifest.json").write_bytes(text)
        else:
            (d / "manifest.json").write_text(text)
    d = copy_fixture("healthy", root / "manifest_is_dir")
    (d / "manifest.json").unlink()
    (d / "manifest.json").mkdir()
    d = copy_fixture("healthy", root / "manifest_is_fifo")
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")           # opening it for reading would block forever
    return {**{k: w for k, (_, w) in cases.items()}, "manifest_is_dir": "plain file",
            "manifest_is_fifo": "plain file"}


@pytest.mark.slow
def test_crashes_and_malformed_bundles_are_error_rows(tmp_path):
    night = tmp_path / "night"
    crashes = {"segfault": "replay killed by signal SIGSEGV",
               "abort": "replay killed by signal SIGABRT",
               "sigkill": "replay killed by signal SIGKILL",
               "exit0": "replay exited with code 0 without a report",
               "raises": "the loss function broke"}
    for name in crashes:
        capture_fault(name, night / name)
    malformed = write_malformed(night)
    copy_fixture("nan_batch", night / "nan_batch")
    out = tmp_path / "t"
    t0 = time.monotonic()
    res = cli("triage", night, "--out", out, "--jobs", "2", "--timeout", "300",
              env=scratch_env(tmp_path))
    took = time.monotonic() - t0
    assert res.code == 3, res.stdout + res.stderr          # nan_batch is a new signature
    assert "Traceback" not in res.stderr + res.stdout
    data = json.loads((out / "triage.json").read_text())
    errors = {Path(e["bundle"]).name: e for e in data["errors"]}
    assert set(errors) == set(crashes) | set(malformed), errors.keys()
    for name, words in {**crashes, **malformed}.items():
        assert words in errors[name]["error"], (name, errors[name])
    assert errors["raises"]["kind"] == "bad-input" and errors["segfault"]["kind"] == "signal"
    assert all(errors[m]["kind"] in ("bad-input", "malformed") for m in malformed)
    # the other bundle is unaffected, and the markdown lists every row
    assert [(Path(b["bundle"]).name, b["signature"]) for b in data["bundles"]] == \
        [("nan_batch", "input-nonfinite · data")]
    md = (out / "triage.md").read_text()
    assert all(f"/{n}`" in md for n in errors)
    nothing_left(tmp_path)
    print(f"\n{len(errors) + 1} bundles in {took:.1f}s:", {n: (e["error"][:70], e["seconds"])
                                                           for n, e in errors.items()})


@pytest.mark.slow
def test_a_hanging_replay_is_killed_at_the_timeout(tmp_path):
    capture_fault("hang", tmp_path / "night" / "hang")
    out = tmp_path / "t"
    # what killed runs left: the scratch of a run whose lock is free goes (its name a live pid,
    # this one's), a live run's stays (its name a pid alive nowhere): test_triage.py has more
    env = scratch_env(tmp_path)
    holder, live = hold_scratch(tmp_path / "scratch", "nanbisect-triage-999999999-")
    dead, fd = lockdir.make(f"nanbisect-triage-{os.getpid()}-", str(tmp_path / "scratch"))
    os.close(fd)
    t0 = time.monotonic()
    try:
        res = cli("triage", tmp_path / "night", "--out", out, "--timeout", "4", env=env)
    finally:
        holder.kill()
        holder.wait(10)
    took = time.monotonic() - t0
    assert res.code == 2, res.stdout + res.stderr
    (err,) = json.loads((out / "triage.json").read_text())["errors"]
    assert err["error"] == "replay exceeded --timeout 4s and was killed" and \
        err["kind"] == "timeout"
    assert 4 <= err["seconds"] < 30 and took < 60, (err, took)
    assert not dead.exists() and live.exists()
    shutil.rmtree(live)
    nothing_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_kill_9_of_triage_leaves_no_process(tmp_path, jobs):
    """kill -9 of the triage process: its loky workers and the replays they run go within
    seconds (the workers watch their parent; each replay's guardian watches its starter), and
    the summary written after the first finished bundle stays."""
    night = tmp_path / "night"
    capture_fault("segfault", night / "a_segfault")          # sorted first: finishes first
    capture_fault("hang", night / "b_hang")
    out = tmp_path / "t"
    p = start_triage(tmp_path, night, "--out", out, "--jobs", jobs, "--timeout", "600")
    try:
        hang = str(night / "b_hang")
        # the replay and the guardian it forks first thing (a kill in the instant before that
        # leaves its scratch directory to the next run's sweep)
        wait_for(lambda: len(processes_mentioning(hang)) >= 2, 120,
                 "the hanging replay and its guardian to start")
        done = wait_for(lambda: (summary(out) or {}).get("errors"), 120,
                        "the summary after the first finished bundle")
        assert [Path(e["bundle"]).name for e in done] == ["a_segfault"]
        tree = descendants(p.pid)
        assert tree and processes_mentioning(hang)
        t0 = time.monotonic()
        p.kill()
        p.wait(10)
        wait_for(lambda: not alive(tree) and not processes_mentioning(str(tmp_path)), 15,
                 f"every process of the killed triage to go: {processes_mentioning(str(tmp_path))}")
        gone_after = time.monotonic() - t0
        nothing_left(tmp_path)          # the guardians also removed the replays' scratch
    finally:
        if p.poll() is None:
            p.kill()
    data = summary(out)
    assert data["finished"] is False and data["pending"] == [hang]
    assert data["exit_code"] == 2                  # an unfinished summary never reads clean
    print(f"\njobs={jobs}: {len(tree)} processes gone {gone_after:.1f}s after kill -9")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_write_what_is_known(tmp_path, sig):
    night = tmp_path / "night"
    capture_fault("hang", night / "hang")
    write_malformed(night)
    out = tmp_path / "t"
    p = start_triage(tmp_path, night, "--out", out, "--jobs", "2", "--timeout", "600")
    try:
        wait_for(lambda: processes_mentioning(str(night / "hang")), 120, "the replay to start")
        tree = descendants(p.pid)
        t0 = time.monotonic()
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 2, stderr
    assert "Traceback" not in stderr
    data = summary(out)
    assert data["finished"] and data["interrupted"] == sig.name
    rows = {Path(e["bundle"]).name: e for e in data["errors"]}
    assert rows["hang"]["kind"] == "interrupted" and sig.name in rows["hang"]["error"]
    assert len(rows) == 8                         # the malformed ones were known before
    assert f"interrupted by {sig.name}" in (out / "triage.md").read_text()
    wait_for(lambda: not alive(tree) and not processes_mentioning(str(tmp_path)), 15,
             "the workers and the replay to go")
    nothing_left(tmp_path)
    print(f"\n{sig.name}: exited {took:.1f}s after the signal")


# --------------------------------------------------------------------------------------------
# clusters


def two_bundles(root: Path) -> Path:
    copy_fixture("forward_nan_behind_mask", root / "forward_nan_behind_mask")
    copy_fixture("nan_batch", root / "nan_batch")
    capture_fault("segfault", root / "segfault")
    return root


def check_two_bundles(data: dict) -> None:
    sigs = sorted(g["signature"] for g in data["signatures"])
    # the code site: the function of the fixture's `torch.sqrt` line
    assert sigs == ["aten.sqrt @ forward_nan_behind_mask.SoftClamp.forward · blocks.N.mlp.act · "
                    "forward · float32 · unknown",
                    "input-nonfinite · data"], sigs
    assert [(Path(e["bundle"]).name, e["error"].split(" (")[0]) for e in data["errors"]] == \
        [("segfault", "replay killed by signal SIGSEGV")]


@pytest.mark.slow
def test_dask_local_cluster(tmp_path):
    distributed = pytest.importorskip("distributed")
    night = two_bundles(tmp_path / "night")
    out = tmp_path / "t"
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        worker_pids = set(client.run(os.getpid).values())
        res = cli("triage", night, "--out", out, "--backend", "dask", "--scheduler",
                  cluster.scheduler_address, "--timeout", "300")
        assert res.code == 3, res.stdout + res.stderr
        data = json.loads((out / "triage.json").read_text())
        check_two_bundles(data)
        # every replay ran on the cluster's worker, which survived the segfaulting replay
        ran_on = {int(r["worker"].rsplit(":", 1)[1]) for r in data["bundles"] + data["errors"]}
        assert ran_on == worker_pids
        assert set(client.run(os.getpid).values()) == worker_pids
        nothing_left(tmp_path)                  # no replay left running on the worker
    assert data["backend"] == "dask" and data["host"] not in {r["worker"] for r in data["bundles"]}


@pytest.mark.slow
def test_ray_cluster(tmp_path):
    ray = pytest.importorskip("ray")
    night = two_bundles(tmp_path / "night")
    out = tmp_path / "t"
    # 2 logical CPUs: with 1, joblib's Ray backend would replay in the triage process itself;
    # its session files in a directory of the test's own (short: it holds unix sockets)
    import tempfile

    ray_dir = tempfile.mkdtemp(prefix="nbray-")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", _temp_dir=ray_dir)
    try:
        address = ray.get_runtime_context().gcs_address
        res = cli("triage", night, "--out", out, "--backend", "ray", "--address", address,
                  "--timeout", "300",
                  env={"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})
        assert res.code == 3, res.stdout + res.stderr
        data = json.loads((out / "triage.json").read_text())
        check_two_bundles(data)
        # replayed by the cluster's workers, not by the triage process itself
        assert all(r["worker"] != data["host"] for r in data["bundles"] + data["errors"])
        nothing_left(tmp_path)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_cluster_is_one_line_in_bounded_time(tmp_path):
    (tmp_path / "night").mkdir()
    port = free_port()
    for args in (["--backend", "dask", "--scheduler", f"tcp://127.0.0.1:{port}"],
                 ["--backend", "ray", "--address", f"127.0.0.1:{port}"]):
        t0 = time.monotonic()
        res = cli("triage", tmp_path / "night", "--out", tmp_path / "t", *args, timeout=120)
        took = time.monotonic() - t0
        if "ray" in args and "needs ray" in res.stderr:
            continue                                    # ray not installed: the other test
        assert res.code == 2 and "cannot reach" in res.stderr and str(port) in res.stderr, \
            res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and took < 60, (res.stderr, took)
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_a_port_that_accepts_and_never_answers_is_one_line_in_bounded_time(tmp_path):
    """A listener that accepts and says nothing (a wrong port, a hung host): without a bound the
    client libraries wait for minutes. NANBISECT_CONNECT_TIMEOUT=2 keeps the test short."""
    (tmp_path / "night").mkdir()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)                           # the kernel accepts; nobody ever answers
        port = srv.getsockname()[1]
        for args in (["--backend", "dask", "--scheduler", f"tcp://127.0.0.1:{port}"],
                     ["--backend", "ray", "--address", f"127.0.0.1:{port}"]):
            t0 = time.monotonic()
            res = cli("triage", tmp_path / "night", "--out", tmp_path / "t", *args, timeout=120,
                      env={"NANBISECT_CONNECT_TIMEOUT": "2"})
            took = time.monotonic() - t0
            if "ray" in args and "needs ray" in res.stderr:
                continue
            assert res.code == 2 and str(port) in res.stderr, res.stderr
            assert len(res.stderr.strip().splitlines()) == 1 and took < 40, (res.stderr, took)
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
def test_missing_cluster_package_names_the_extra(tmp_path):
    """An environment without dask/ray (their imports fail, as on a plain install): one line
    naming the extra to install."""
    shadow = tmp_path / "shadow"
    for mod in ("distributed", "ray"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(
            f"raise ImportError(\"No module named '{mod}'\")\n")
    (tmp_path / "night").mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    for args in (["--backend", "dask", "--scheduler", "tcp://127.0.0.1:1"],
                 ["--backend", "ray", "--address", "127.0.0.1:1"]):
        res = cli("triage", tmp_path / "night", "--out", tmp_path / "t", *args, env=env)
        assert res.code == 2 and "pip install 'nanbisect[cluster]'" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
