"""The fork server (`nanbisect.proc.forkserver`) that triage's workers and the tests' CLI runs
start their children from: real processes, real signals, real exit statuses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FIXTURES
from nanbisect import proc


@pytest.fixture(scope="module")
def server():
    return proc.ForkServer.get()       # this process's, as triage's worker uses it


def _start(server, tmp_path: Path, code: str, *args: str, **kw) -> tuple[proc.Child, Path]:
    script = tmp_path / "child.py"
    script.write_text(code)
    err = tmp_path / "err"
    with open(err, "wb") as f:
        child = server.start([str(script), *args], cwd=str(tmp_path),
                             env={"PATH": os.environ.get("PATH", ""), **kw.pop("env", {})},
                             stderr=f.fileno(), **kw)
    return child, err


@pytest.mark.slow
def test_a_child_is_a_process_of_its_own(server, tmp_path):
    """Exit status, argv, working directory, exactly the environment given, a session of its
    own, stdout where asked, and ps showing the command it runs."""
    out = tmp_path / "out"
    code = ("import json, os, sys\n"
            "print(json.dumps([sys.argv[1:], os.getcwd(), sorted(os.environ),\n"
            "                  os.getsid(0) == os.getpid()]))\n"
            "print(open('/proc/self/cmdline').read().replace(chr(0), ' '), file=sys.stderr)\n"
            "sys.exit(7)\n")
    with open(out, "wb") as f:
        child, err = _start(server, tmp_path, code, "a b", env={"ONLY": "1"}, stdout=f.fileno())
    assert child.wait(60) == 7
    argv, cwd, env, own_session = json.loads(out.read_text())
    assert argv == ["a b"] and cwd == str(tmp_path) and own_session
    assert "ONLY" in env and "HOME" not in env
    assert str(tmp_path / "child.py") in err.read_text()      # not the server's command line


@pytest.mark.slow
def test_a_signal_and_a_timeout_read_as_subprocess_reports_them(server, tmp_path):
    child, _ = _start(server, tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert child.wait(60) == -signal.SIGSEGV
    child, _ = _start(server, tmp_path, "import os, time\nos.fork()\ntime.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    assert child.poll() is None
    child.kill_group()                  # its own child too: the whole session's group
    assert child.wait(30) == -signal.SIGKILL


def test_a_kept_descriptor_arrives_under_the_number_its_variable_says(server, tmp_path):
    r, w = os.pipe()
    try:
        child, err = _start(server, tmp_path, "import os\nos.write(int(os.environ['FD']), b'hi')",
                            keep={"FD": w})
    finally:
        os.close(w)
    assert child.wait(60) == 0, err.read_text()
    assert os.read(r, 10) == b"hi"
    os.close(r)


@pytest.mark.slow
def test_the_server_goes_when_its_client_does(tmp_path):
    """A client killed -9 closes its end: the server ends (no orphan waiting for requests)."""
    code = ("import sys, time\nfrom nanbisect.proc import ForkServer\n"
            "print(ForkServer.get().proc.pid, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(p.stdout.readline())
        os.kill(pid, 0)                 # alive
    finally:
        p.kill()
        p.wait()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the fork server {pid} outlived its client")


@pytest.mark.slow
def test_triage_replays_bundles_in_forks_of_one_server(server, tmp_path, monkeypatch):
    """A worker's replays come from its one server (torch imported once); with
    ``NANBISECT_TRIAGE_FORK=0`` a fresh interpreter gives the same report."""
    import shutil

    from nanbisect.nightly import one_bundle as worker

    bundle = tmp_path / "b"
    shutil.copytree(FIXTURES / "fully_masked_row", bundle,
                    ignore=shutil.ignore_patterns("nanbisect-report"))
    rows = [worker.analyse_one(str(bundle), {}, 300, os.getppid())]
    assert proc.ForkServer.get() is server and server.proc.poll() is None
    monkeypatch.setenv("NANBISECT_TRIAGE_FORK", "0")
    rows.append(worker.analyse_one(str(bundle), {}, 300, os.getppid()))
    culprits = [r.get("report", r)["culprit"] for r in rows]
    assert culprits[0]["op"] and culprits[0] == culprits[1]


@pytest.mark.slow
def test_a_shared_child_forks_its_own_children_from_the_server(server, tmp_path):
    """A child started with ``share`` (a test's `nanbisect run`, a triage replay) forks the
    multi-rank spawner from the same server (`launcher._start_spawner`), not from a fresh
    interpreter, and its ranks still get torchrun's one thread each; with another value of what
    torch reads at import it starts a fresh interpreter."""
    # a value other than the server's (the suite may itself run under ATEN_CPU_CAPABILITY)
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default" else "default"
    rank = tmp_path / "rank.py"
    rank.write_text("import os, torch\n"
                    "def up(pid):\n"
                    "    stat = open(f'/proc/{pid}/stat').read()\n"
                    "    return int(stat.rsplit(')', 1)[1].split()[1])\n"
                    # NB: one write: under PYTHONUNBUFFERED print writes each piece on its
                    # own, and the two ranks' pieces interleaved ('rankrank 1 1...')
                    "os.write(1, f'rank {torch.get_num_threads()} {up(up(os.getppid()))}\\n'"
                    ".encode())\n")
    code = ("import os, sys\n"
            "from nanbisect.multirank.launcher import _start_spawner\n"
            f"for extra in ({{}}, {{'ATEN_CPU_CAPABILITY': {other!r}}}):\n"
            "    os.environ.update(extra)\n"
            "    p = _start_spawner([sys.executable, '-m', 'nanbisect.multirank.spawn',\n"
            f"                        '--world=2', '--group', '--', {str(rank)!r}], 1)\n"
            "    print('spawner', type(p).__name__, p.wait(120), flush=True)\n")
    out = tmp_path / "out"
    with open(out, "wb") as f:
        child, err = _start(server, tmp_path, code, env=dict(os.environ), stdout=f.fileno(),
                            share=True)
    assert child.wait(180) == 0, err.read_text()
    lines = [ln.split() for ln in out.read_text().splitlines()]
    assert [ln[0] for ln in lines] == ["rank", "rank", "spawner"] * 2, lines
    forked, fresh = lines[:3], lines[3:]
    assert forked[2][1:] == ["Child", "0"] and fresh[2][1:] == ["Popen", "0"]
    # rank -> spawner -> the server's reaper -> the server; one thread each, forked or not
    assert [r[2] for r in forked[:2]] == [str(server.proc.pid)] * 2
    assert str(server.proc.pid) not in (fresh[0][2], fresh[1][2])
    threads = os.environ.get("OMP_NUM_THREADS", "1")    # the spawner's default for a group
    assert [r[1] for r in forked[:2] + fresh[:2]] == [threads] * 4


def test_a_warmed_server_forks_children_with_the_replay_path_loaded(tmp_path):
    """`warm_fork_server` (the suite's servers and triage's use it): a child finds `nanbisect
    run`'s modules imported and the report page's template compiled, and its environment is its
    own (nothing the warm-up read was frozen in the server)."""
    from helpers import run_python

    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "from nanbisect.report.page import page_template\n"
        "print(all(m in sys.modules for m in ('nanbisect.pipeline.run', 'jinja2')),\n"
        "      page_template.cache_info().currsize, os.environ.get('PROBE'))\n")
    res = run_python([str(script)], cwd=tmp_path, env={**os.environ, "PROBE": "mine"})
    assert (res.code, res.stdout.split()) == (0, ["True", "1", "mine"]), res.stderr
    from nanbisect.pipeline.run import warm_fork_server

    assert proc.warm_name(warm_fork_server) == "nanbisect.pipeline.run:warm_fork_server"
