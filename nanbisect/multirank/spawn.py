"""Start the ranks of one multi-rank run from one interpreter, and supervise them.

``python -m nanbisect.multirank.spawn --world N [options] -- (-m MODULE | SCRIPT) ARG...``

torchrun starts an agent (an interpreter that imports torch) and then a fresh interpreter per
rank, and each one imports torch again: about 2 s of CPU apiece here, plus 1.4 s for
``torch._dynamo``, which building an optimizer imports. This process imports torch (and every
``--preload`` module) once, without running a single op or starting a thread, then forks every
rank from there; a rank starts in milliseconds and shares the imported pages. It then does what
torchrun does for ``--max-restarts=0``:

- each rank gets torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, and
  ``OMP_NUM_THREADS=1`` when unset and several ranks share the host (set before ``import torch``:
  OpenMP reads it once, when it loads);
- ``--group``: the ranks form a process group. This process hosts its TCPStore (as torchrun's
  agent does: ``TORCHELASTIC_USE_AGENT_STORE``, so ``init_process_group``'s ``env://`` finds it),
  created after the forks (no thread of it is copied into a rank) on a port the kernel chose, which
  each rank reads from a pipe before it runs; when one rank fails, the others are sent SIGTERM
  (SIGKILL 30 s later), as torchrun's agent stops a failed group;
- ``--statuses FILE``: every rank's exit status (negative: the signal that killed it) and the first
  rank that failed (the root cause), as JSON, written before this process exits (1 if any rank
  failed, else 0);
- ``--logs DIR``: each rank's stdout and stderr go to ``DIR/rank<r>.log`` (else they are this
  process's);
- ``--exec``: each rank is a fresh interpreter instead of a fork, for a device whose extension
  cannot be used in a forked child (`nanbisect.devices` says which: ``DeviceType.forkable``).

Every rank keeps this process's command line (a fork does not change it), so the run directory
named there is on every rank's too: `nanbisect.multirank.rundir` kills a run by that name. The
ranks share this process's session: killing its process group kills them all.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from nanbisect import proc
from nanbisect.util.numbers import omp_threads

_STOP_GRACE = 30.0     # seconds between SIGTERM and SIGKILL for the ranks of a failed group


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("spawn: usage: ... -- (-m MODULE | SCRIPT) ARG...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m nanbisect.multirank.spawn")
    ap.add_argument("--world", type=int, required=True, help="WORLD_SIZE")
    ap.add_argument("--ranks", default=None, help="the ranks to start (default: all)")
    ap.add_argument("--per-host", type=int, default=0,
                    help="LOCAL_RANK = the rank's place among those started, modulo this "
                         "(default: the number started)")
    ap.add_argument("--group", action="store_true")
    ap.add_argument("--statuses", default=None)
    ap.add_argument("--logs", default=None)
    ap.add_argument("--preload", action="append", default=[])
    ap.add_argument("--exec", action="store_true")
    a = ap.parse_args(argv[:cut])
    target = argv[cut + 1:]
    if not target or (target[0] == "-m" and len(target) < 2):
        raise SystemExit("spawn: give -m MODULE or a script after --")
    return a, target


def _rank_env(a: argparse.Namespace, rank: int, local: int, count: int) -> dict[str, str]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(a.world),
           "LOCAL_WORLD_SIZE": str(count), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
           "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(a.world), "ROLE_NAME": "default",
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": "none"}
    if a.group:
        env.update({"MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    return env


def _fork_rank(env: dict[str, str], target: list[str], log: Path | None,
               port_pipe: int | None, close: list[int], rank: int,
               ranks: proc.Processes) -> None:
    """Fork rank ``rank``, noted in ``ranks`` before any signal handler can run."""
    ranks.fork(rank, lambda: _rank_main(env, target, log, port_pipe, close))


def _rank_main(env: dict[str, str], target: list[str], log: Path | None,
               port_pipe: int | None, close: list[int]) -> int:
    """A forked rank: its environment, then its target; its exit status."""
    import random

    for fd in close:                  # the other ranks' pipe ends and the parent's write ends:
        os.close(fd)                  # EOF when the parent is gone before it wrote the port

    random.seed()                     # a fresh interpreter's would differ from its peers'
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(env)
    if port_pipe is not None:
        with os.fdopen(port_pipe, "r") as f:
            port = f.readline().strip()
        if not port:                  # the store never came up: the parent said why
            os._exit(1)
        os.environ["MASTER_PORT"] = port
    threads = omp_threads()
    if threads is not None:
        # what OpenMP would have read had it loaded after the variable was set: this
        # spawner may itself be a fork of a server that imported torch before it was
        import torch

        torch.set_num_threads(threads)
    return proc.run_main(target)


def _exec_rank(env: dict[str, str], target: list[str], log: Path | None, port: int | None,
               rank: int, ranks: proc.Processes) -> None:
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - the child's own copy
    try:
        full = {**os.environ, **env, **({"MASTER_PORT": str(port)} if port is not None else {})}
        ranks.exec(rank, [sys.executable, *target], env=full, stdout=out,
                   stderr=subprocess.STDOUT if out else None)
    finally:
        if out is not None:
            out.close()


def _root(failed: dict[int, int] | None) -> int | None:
    """The rank that failed first, of those seen failed at once: a rank killed by a signal (a
    crash, the OOM killer) before one that exited, which is usually a peer raising "connection
    closed"."""
    if not failed:
        return None
    return min(failed, key=lambda r: (not (failed[r] < 0 and failed[r] != -signal.SIGTERM), r))


def main(argv: list[str] | None = None) -> int:
    a, target = _args(sys.argv[1:] if argv is None else argv)
    started = ([int(x) for x in a.ranks.split(",")] if a.ranks else list(range(a.world)))
    per_host = a.per_host or len(started)
    if a.group and len(started) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")     # torchrun's; before OpenMP loads
    import torch  # noqa: F401 - once, for every rank
    import importlib

    for mod in a.preload:
        importlib.import_module(mod)
    logs = Path(a.logs) if a.logs else None
    envs = {r: _rank_env(a, r, i % per_host, min(per_host, len(started)))
            for i, r in enumerate(started)}
    ranks = proc.Processes(grace=_STOP_GRACE)
    pipes, store = [], None
    # an exception (KeyboardInterrupt, SystemExit too) ends and reaps every rank, and goes on:
    # no rank outlives this process
    with ranks:
        if a.exec:
            port = None
            if a.group:
                store = _store(a.world)
                port = store.port
            for r in started:
                _exec_rank(envs[r], target, logs / f"rank{r}.log" if logs else None, port, r,
                           ranks)
        else:
            ends = {r: os.pipe() for r in started} if a.group else {}
            for r in started:
                read = ends[r][0] if a.group else None
                others = [fd for q, pair in ends.items() for fd in pair if fd != read]
                _fork_rank(envs[r], target, logs / f"rank{r}.log" if logs else None, read,
                           others, r, ranks)
            for read, write in ends.values():
                os.close(read)
                pipes.append(write)
            if a.group:
                port = ""
                try:
                    store = _store(a.world)
                    port = str(store.port)
                finally:                      # an empty line: the rank exits 1
                    for w in pipes:
                        with os.fdopen(w, "w") as f:
                            f.write(port + "\n")
        # in a group, a failure stops the others: SIGTERM, SIGKILL after the grace
        ranks.wait(stop_on_failure=a.group)
        root = _root(ranks.failed)
    if a.statuses:
        path = Path(a.statuses)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"statuses": {str(r): c for r, c in ranks.codes.items()},
                                   "root": root}))
        os.replace(tmp, path)
    del store
    return 0 if root is None else 1


def _store(world: int):
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=3600),
                    wait_for_workers=False)


if __name__ == "__main__":
    sys.exit(main())
