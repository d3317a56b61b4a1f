"""What the launcher says when a rank hangs or dies: where each rank was (its faulthandler stacks,
classified as its own code, a library's, nanbisect's or a wait inside torch), its exit status
or signal as the spawner saw it (`nanbisect.multirank.spawn`), and the stage it reached.

What the launcher calls (the package's internal interface, see `nanbisect.multirank`):
`ask_stacks` (every rank asked for its stacks, read as `Where`), `hang` and `died` (the one line a
hang or a death becomes), `rank_stage` (the stage a rank's state file names), `PEER_GONE` (the
errors a rank sees when a peer died: consequences, not causes), `exit_statuses`, `where`.
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from nanbisect import proc
from nanbisect.errors import signal_name
from nanbisect.multirank.rundir import run_processes
from nanbisect.util import frames
from nanbisect.util import torch_internals as ti
from nanbisect.util.files import read_json as _read_json
from nanbisect.util.text import ranks_text

# errors a rank sees when a peer died or left: consequences, not causes
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


_WAIT = frames.OWN + os.path.join("replay", "collectives.py")
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def _category(path: str) -> str | None:
    """What a frame's file is: None for the standard library (looked through).

    >>> _category(frames.TORCH + "distributed/distributed_c10d.py"), _category("/u/train.py")
    ('collective', 'user')
    """
    k = frames.kind(path)
    if k == "nanbisect" and os.path.abspath(path) == _WAIT:
        return "collective"     # nanbisect waiting for a collective's output to be written
    if k == "torch":
        return "collective" if os.path.abspath(path).startswith(
            frames.TORCH + "distributed" + os.sep) else "torch"
    return {"stdlib": None, "installed": "library"}.get(k, k)


@dataclass(frozen=True)
class Where:
    """A rank's innermost frame that is not the standard library's."""

    category: str          # collective | torch | nanbisect | library | user
    at: str                # "file.py:12 in func"

    @property
    def waiting(self) -> bool:
        return self.category in ("collective", "torch")

    def __str__(self) -> str:
        return {"collective": "waited in a collective", "torch": "was inside torch",
                "nanbisect": "was still inside nanbisect",
                "library": "was still running library code",
                "user": "was still running its own code"}[self.category] + f" at {self.at}"


def where(dump: str) -> Where | None:
    """The main thread's innermost non-stdlib frame in a faulthandler dump (the last dump)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Current thread 0x", "Thread 0x")):
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].append((m[1], int(m[2]), m[3]))
    # the main thread is the one not started by `threading` (frames are innermost first)
    main = [t for t in threads if t and not any(
        f[2] in ("_bootstrap", "_bootstrap_inner") and f[0].endswith("threading.py") for f in t)]
    waiting = False    # inside nanbisect's wait for a collective: say where it was issued
    for path, line, func in (main[0] if main else []):
        cat = _category(path)
        if cat == "collective" and frames.kind(path) == "nanbisect":
            waiting = True
            continue
        if waiting and (cat in (None, "nanbisect") or path.startswith(ti.PLUMBING)):
            continue
        if cat is not None:
            return Where("collective" if waiting else cat, f"{Path(path).name}:{line} in {func}")
    return None


def ask_stacks(partial: Path, ranks: list[int]) -> dict[int, Where | None]:
    """Ask every rank in ``ranks`` for its stacks (SIGUSR1) and read where each one is."""
    def size(r: int) -> int:
        try:
            return (partial / f"rank{r}.stacks").stat().st_size
        except OSError:
            return 0

    before, live = {}, run_processes(partial)
    for r in ranks:
        state = _read_json(partial / f"rank{r}.state")
        pid = state.get("pid") if state else None
        if isinstance(pid, int) and pid in live:
            before[r] = size(r)
            proc.signal_pid(pid, signal.SIGUSR1)
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:   # until every dump is written and has stopped growing
        time.sleep(0.2)
        now = {r: size(r) for r in before}
        if all(now[r] > before[r] for r in before) and now == sizes:
            break
        sizes = now
    out = {}
    for r in ranks:
        text = ""
        if r in before:
            try:
                with open(partial / f"rank{r}.stacks", errors="replace") as f:
                    f.seek(before[r])
                    text = f.read()
            except OSError:
                pass
        out[r] = where(text) if text else None
    return out


def exit_statuses(partial: Path) -> tuple[dict[int, int], int | None]:
    """(rank -> exit status, the first rank that failed), as `nanbisect.multirank.spawn` wrote
    them to ``partial/statuses.json``; a negative status is the signal that killed the rank.
    Empty when the spawner itself was killed before it wrote them."""
    got = _read_json(partial / "statuses.json") or {}
    try:
        statuses = {int(r): int(c) for r, c in (got.get("statuses") or {}).items()
                    if c is not None}
        root = got.get("root")
        return statuses, (int(root) if root is not None else None)
    except (TypeError, ValueError, AttributeError):
        return {}, None


def rank_stage(partial: Path, r: int) -> str:
    state = _read_json(partial / f"rank{r}.state")
    return f" ({state['stage']})" if state and state.get("stage") else ""


def died(partial: Path, r: int, status: int, then: str) -> str:
    """One line for a rank that ended without a result."""
    stage = rank_stage(partial, r)
    if status > 0:
        return (f"rank {r} exited with status {status} during the replay without a result"
                f"{stage}{then}: the entry's code ended the process (os._exit, exit() in a C "
                "library?); run that rank's code alone")
    name = signal_name(-status)
    dump = ""
    try:
        dump = (partial / f"rank{r}.stacks").read_text(errors="replace")
    except OSError:
        pass
    fatal = where(dump) if "Fatal Python error" in dump else None
    at = f" at {fatal.at}" if fatal else " during the replay"
    why = ("SIGKILL comes from outside the process: the kernel's OOM killer (see dmesg) or a "
           "kill -9" if -status == signal.SIGKILL else
           "a crash in native code (an extension, a kernel, ctypes) at that place"
           if -status in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE,
                          signal.SIGABRT) else f"something sent it {name}")
    return (f"rank {r} was killed by {name}{at}{stage}{then}; {why}; run that "
            "rank's code alone")


MAX_SAID = 4    # ranks a hang's message says where they were, then how many more


def _first(said: list[str], total: int) -> str:
    """The first ranks' whereabouts, and how many more ranks there are."""
    return "; ".join(said) + (f"; and {total - len(said):,} more ranks" if total > len(said)
                              else "")


def hang(partial: Path, world: int, timeout: float, finished: set[int],
          stacks: dict[int, Where | None]) -> str:
    """One line for a replay that outlived its deadline, naming the rank that hung: the one still
    running code (or never started) while the others waited."""
    def state(r: int) -> dict | None:
        return _read_json(partial / f"rank{r}.state")

    def said(r: int) -> str:
        if r in finished:
            return f"rank {r} had finished"
        if state(r) is None:
            return f"rank {r} had not started its replay"
        w = stacks.get(r)
        return f"rank {r} {w if w else 'did not say where it was'}{rank_stage(partial, r)}"

    running = [r for r in range(world) if r not in finished and (
        state(r) is None or (stacks.get(r) is not None and not stacks[r].waiting))]
    if running:
        rest = [r for r in range(world) if r not in running]
        return (f"{ranks_text(running)} hung: after {timeout:.0f}s " + _first(
                    [said(r) for r in running[:MAX_SAID]], len(running))
                + (", while " + _first([said(r) for r in rest[:MAX_SAID]], len(rest))
                   + ", waiting for it" if rest else "")
                + "; fix that code, or raise NANBISECT_RANK_TIMEOUT if it is only slow")
    return (f"no rank finished within {timeout:.0f}s: "
            + _first([said(r) for r in range(min(world, MAX_SAID))], world)
            + "; the ranks probably took different control paths (one skipped or added a "
            "collective), or a collective never completed; run those ranks' code alone, or "
            "raise NANBISECT_RANK_TIMEOUT")
