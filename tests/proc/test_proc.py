"""`nanbisect.proc`, the one supervisor of child processes: its layering, its handles (a fork, a
fresh program, a fork server's child) ended and reaped on every path, the deadline, what a child
said, the locked scratch directory, its sweep and its janitor; real processes throughout."""
from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanbisect import proc
from nanbisect.util import lockdir
from helpers.layout import PKG, imports, module_name, stage

# the process code every starter shares: none of these may repeat a block of proc's
PROCESS_FILES = ["report/rerun.py", "multirank/spawn.py", "multirank/launcher.py",
                 "multirank/rundir.py", "multirank/worker.py", "multirank/diagnose.py",
                 "compiler/launch.py", "nightly/night.py", "nightly/one_bundle.py",
                 "guard/keep.py", "guard/agree.py"]
# callers not moved onto `nanbisect.proc` yet (none: add one here only with a reason)
PENDING: set[str] = set()
# modules that only re-export proc for old imports (none)
SHIMS: set[str] = set()


def test_proc_imports_only_errors_util_and_itself():
    wrong = [f"{module_name(p)} imports {o}" for p in (PKG / "proc").rglob("*.py")
             for o in imports(p) if o != "nanbisect.errors"
             and not o.startswith(("nanbisect.util", "nanbisect.proc"))]
    assert not wrong, "\n".join(wrong)


def test_no_stage_names_a_later_stage_by_string():
    """A ``module:function`` or ``nanbisect.X`` string pointing up the stages is an import the
    layout test cannot see: a later stage passes what it wants called (`proc.warm_name`)."""
    wrong = []
    for path in PKG.rglob("*.py"):
        me = module_name(path)
        if me in SHIMS or me == "nanbisect":
            continue
        _, mine = stage(me)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for name in re.findall(r"^nanbisect\.([a-z_]+)[.:][\w.:]*$", node.value.strip()):
                if name in {"util", "proc"} or f"nanbisect.{name}" == me.rsplit(".", 1)[0]:
                    continue
                try:
                    _, theirs = stage(f"nanbisect.{name}")
                except KeyError:
                    continue
                if theirs > mine:
                    wrong.append(f"{me} names {node.value.strip()!r}")
    assert not wrong, "\n".join(wrong)


def _blocks(path: Path, size: int = 6) -> set[tuple[str, ...]]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    code = [ln for ln in lines if ln and not ln.startswith(("#", '"', "'", ">>>", "..."))]
    return {tuple(code[i:i + size]) for i in range(len(code) - size + 1)
            if sum(len(x) for x in code[i:i + size]) > 200}


def test_no_starter_repeats_a_block_of_the_supervisor():
    theirs = set().union(*(_blocks(p) for p in (PKG / "proc").glob("*.py")))
    gone = [f for f in PROCESS_FILES if not (PKG / f).is_file()]
    assert not gone, f"PROCESS_FILES names modules that moved: {gone}"
    copied = {f: b for f in PROCESS_FILES if f not in PENDING
              for b in _blocks(PKG / f) & theirs}
    assert not copied, copied


def _exits(code: int) -> int:
    return code


def test_a_fork_reports_its_status_its_signal_and_its_deadline():
    kept: list = []
    proc.fork(lambda: _exits(7), kept.append)
    proc.fork(lambda: os.kill(os.getpid(), signal.SIGTERM) or 0, kept.append)
    proc.fork(lambda: time.sleep(60) or 0, kept.append)
    seven, segv, sleeper = kept   # segv: killed by a signal
    assert proc.finish(seven, 30) == 7 and proc.finish(segv, 30) == -signal.SIGTERM
    t0 = time.monotonic()
    assert proc.finish(sleeper, 0.2) is None and time.monotonic() - t0 < 10
    assert sleeper.returncode == -signal.SIGKILL        # killed at the deadline, and reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(sleeper.pid, os.WNOHANG)


def test_an_exception_in_a_fork_is_exit_1_and_never_returns_into_the_parent(tmp_path):
    out = proc.Output()
    kept: list = []

    def body() -> int:
        sys.stderr = open(out.err.fileno(), "w", closefd=False)   # not pytest's capture
        raise RuntimeError("in the child")
    proc.fork(body, kept.append)
    assert proc.finish(kept[0], 30) == 1
    assert "RuntimeError: in the child" in out.said()[1]


def test_an_interrupt_while_waiting_ends_and_reaps_the_child():
    p = proc.start_exec([sys.executable, "-c", "import time; time.sleep(60)"],
                        start_new_session=True)
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            proc.finish(p, 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert p.returncode == -signal.SIGKILL


def test_what_a_child_said_is_kept_in_files_of_its_own():
    said = proc.Output()
    p = proc.start_exec([sys.executable, "-c", "import sys; print('out'); "
                         "print('x' * 200000, file=sys.stderr)"], stdout=said.out,
                        stderr=said.err)
    assert proc.finish(p, 60) == 0      # no pipe to fill: a large stderr does not block it
    out, err = said.said()
    assert out == "out\n" and len(err) == 200001


def test_no_server_to_fork_from_is_none():
    assert proc.from_server(["-c", "pass"], dict(os.environ), cwd=".", stderr=2) is None


def test_a_locked_directory_tells_whether_its_owner_lives(tmp_path):
    with proc.locked("nanbisect-t-", str(tmp_path)) as d:
        assert lockdir.state(d) == "held" and d.parent == tmp_path
    assert not d.exists()


def test_sweep_removes_only_what_dead_owners_left(tmp_path):
    dead, fd = lockdir.make("nanbisect-t-", str(tmp_path))
    os.close(fd)
    live, keep = lockdir.make("nanbisect-t-", str(tmp_path))
    old, new = tmp_path / "nanbisect-t-old", tmp_path / "nanbisect-t-new"
    old.mkdir()
    new.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    (tmp_path / "other").mkdir()
    try:
        assert sorted(proc.sweep(r"nanbisect-t-.*", tmp_path, unlocked_after=3600)) == \
            sorted([dead, old])
        assert live.is_dir() and new.is_dir() and (tmp_path / "other").is_dir()
    finally:
        os.close(keep)


WATCHED = """
import subprocess, sys, time
from nanbisect import proc
with proc.watched("nanbisect-twatch-") as d:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(d)],
                     start_new_session=True)
    print(d, flush=True)
    time.sleep(120)
"""


def test_a_watched_directory_and_its_processes_go_when_its_owner_is_killed(tmp_path):
    """kill -9 of the owner: its janitor kills every process naming the directory (one that
    left the owner's session too) and removes the directory."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owner = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        d = Path(owner.stdout.readline().strip())
        deadline = time.monotonic() + 30
        while not proc.processes_naming(d):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 20
    while (d.exists() or proc.processes_naming(d)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not d.exists() and proc.processes_naming(d) == []


GUARDED = """
import os, subprocess, sys, time
from nanbisect.proc import guard_group
fd, marker = int(sys.argv[1]), sys.argv[2]
guard_group(fd, int(sys.argv[3]), lambda said: open(marker, "wb").write(said or b"died"))
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(grandchild.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_a_guarded_child_and_its_group_end_when_the_starter_lets_go(tmp_path):
    """The guardian kills the child's whole group (its own children too) once the starter
    closes its end of the pipe, then runs the cleanup with what the starter wrote."""
    r, w = os.pipe()
    marker = tmp_path / "said"
    try:
        child = proc.start_exec([sys.executable, "-c", GUARDED, str(r), str(marker),
                                 str(os.getpid())], pass_fds=(r,), start_new_session=True,
                                stdout=subprocess.PIPE, text=True,
                                cwd=str(Path(__file__).resolve().parents[2]))
    finally:
        os.close(r)
    with proc.reaped(child):
        grandchild = int(child.stdout.readline())
        os.write(w, b"done")
        os.close(w)
        assert child.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while not (_gone(grandchild) and marker.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild) and marker.read_bytes() == b"done"


def test_a_child_exits_once_its_owner_lets_go_of_the_lock(tmp_path):
    d, fd = lockdir.make("nanbisect-t-", str(tmp_path))
    code = ("import sys, time\nfrom pathlib import Path\nfrom nanbisect.proc import "
            "exit_when_free\nexit_when_free(Path(sys.argv[1]), lambda: "
            "Path(sys.argv[1], 'gone').touch())\nprint('watching', flush=True)\ntime.sleep(60)\n")
    child = proc.start_exec([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE,
                            text=True, cwd=str(Path(__file__).resolve().parents[2]))
    with proc.reaped(child):
        assert child.stdout.readline() == "watching\n"
        time.sleep(0.2)
        assert child.poll() is None           # held: it waits
        os.close(fd)
        assert child.wait(30) == 1 and (d / "gone").exists()
