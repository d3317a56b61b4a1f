"""One handle for a process or a group of processes, in the manner of torch elastic's
``PContext`` (``torch.distributed.elastic.multiprocessing.api``): the caller starts children
through it and then polls, waits (with a deadline), stops them (SIGTERM, then SIGKILL once a
grace period has passed), reaps them and reads what they said, and never touches a pid itself.

- start: `Processes.fork` (a fork of this process, `nanbisect.proc.supervisor.fork`),
  `Processes.exec` (a fresh interpreter or any program, `start_exec`), or `Processes.add` for a
  child started another way through `nanbisect.proc` (a fork server's `Child`);
- `poll`: each child's exit status (None while it runs); `wait`: until every child ended, or
  ``timeout``; with ``stop_on_failure`` the first failure stops the others (as torchrun's agent
  stops a failed group); `failed` keeps the failures seen first;
- `terminate` (SIGTERM now, SIGKILL after ``grace``: `poll` and `wait` send it), `stop` (the
  same, waiting for them), `kill` (SIGKILL now, no wait: a watchdog about to exit), `close`
  (SIGKILL and reap every child still running);
- `said`: what a child started with ``output=True`` wrote (`Output`).

Guarantees: a signal goes to a child's whole process group where it leads one, and never to a
child already reaped (its pid may be another process's by then); used as a context manager, an
exception (KeyboardInterrupt and SystemExit too) ends and reaps every child, and goes on
unchanged. The handle may be signalled from another thread (`kill`) while this one adds and
polls. Not guaranteed: a grandchild that left its parent's process group is not found here
(`nanbisect.proc.scratch.kill_named` finds those by name).
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable, Hashable, Iterator

from nanbisect.proc.reap import Handle, signal_child, stop
from nanbisect.proc.supervisor import Output, fork, start_exec


class Processes:
    """A process or a group of processes this process started, supervised as one.

    ``grace``: seconds between the SIGTERM of `terminate`/`stop` and the SIGKILL that follows.

    >>> import sys
    >>> with Processes(grace=0.5) as ps:
    ...     _ = ps.exec("ok", [sys.executable, "-c", "print('hi')"], output=True)
    ...     _ = ps.wait(timeout=120)      # it ends (on a busy machine, not within 0.2 s)
    ...     _ = ps.exec("hangs", [sys.executable, "-c", "import time; time.sleep(60)"])
    ...     ps.wait(timeout=0.2)          # past its deadline: None, the children go on
    ...     _ = ps.stop()
    ...     ps.codes["ok"], ps.codes["hangs"] == -signal.SIGTERM, ps.said("ok")[0]
    (0, True, 'hi\\n')
    """

    def __init__(self, grace: float = 30.0) -> None:
        self.grace = grace
        self.children: dict[Hashable, Handle | subprocess.Popen] = {}
        self.codes: dict[Hashable, int | None] = {}     # None while it runs
        self.outputs: dict[Hashable, Output] = {}
        # the failures the first poll that saw any saw (the root cause, not what stopping caused)
        self.failed: dict[Hashable, int] | None = None
        self._kill_at: float | None = None
        self._lock = threading.RLock()

    # -- start -----------------------------------------------------------------------------------
    def add(self, key: Hashable, child: Handle | subprocess.Popen) -> Handle | subprocess.Popen:
        """Supervise ``child`` (started through `nanbisect.proc`) under ``key``; gives it back."""
        with self._lock:
            self.children[key] = child
            self.codes[key] = None
        return child

    def fork(self, key: Hashable, body: Callable[[], int], *,
             defaults: tuple[int, ...] = ()) -> None:
        """A fork of this process running ``body`` (`nanbisect.proc.supervisor.fork`), stored
        under ``key`` before any signal handler of this process can run."""
        fork(body, lambda child: self.add(key, child), defaults=defaults)

    def exec(self, key: Hashable, argv: list[str], *, output: bool = False,
             **kw) -> subprocess.Popen:
        """``argv`` in a process of its own (`start_exec`, its keywords); ``output``: its
        stdout and stderr kept in files of their own (`said`)."""
        said = None
        if output:
            said = Output()
            kw.update(stdout=said.out, stderr=said.err)
        try:
            child = start_exec(argv, **kw)
        except BaseException:
            if said is not None:
                said.close()
            raise
        if said is not None:
            self.outputs[key] = said
        return self.add(key, child)

    def discard(self, key: Hashable) -> None:
        """No longer supervise ``key`` (its caller reaped it)."""
        with self._lock:
            self.children.pop(key, None)
            self.codes.pop(key, None)

    # -- poll and wait ---------------------------------------------------------------------------
    def poll(self) -> dict[Hashable, int | None]:
        """Every child's exit status (negative: the signal that killed it; None while it
        runs), reaping those that ended; past a `terminate`'s grace, SIGKILL to those still
        running. The first poll that sees failures (a status other than 0) keeps them in
        `failed`."""
        with self._lock:
            for key, child in list(self.children.items()):
                if self.codes.get(key) is None:
                    self.codes[key] = child.poll()
            failed = {k: c for k, c in self.codes.items() if c not in (None, 0)}
            if self.failed is None and failed:
                self.failed = failed
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                self._kill_at = None
                self.signal(signal.SIGKILL)
            return dict(self.codes)

    def running(self) -> list[Hashable]:
        """The keys of the children that had not ended at the last `poll`."""
        with self._lock:
            return [k for k, c in self.codes.items() if c is None]

    def wait(self, timeout: float | None = None, *, stop_on_failure: bool = False,
             every: float = 0.02) -> dict[Hashable, int] | None:
        """Every child's exit status once all ended; None when ``timeout`` seconds passed first
        (they go on running: `stop` or `close` them). ``stop_on_failure``: once one failed,
        the others are stopped (`terminate`) and waited for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        stopping = False
        while True:
            self.poll()
            if stop_on_failure and not stopping and self.failed:
                stopping = True
                self.terminate()
            if not self.running():
                return dict(self.codes)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(every)

    # -- stop ------------------------------------------------------------------------------------
    def signal(self, sig: int, keys: list[Hashable] | None = None) -> None:
        """``sig`` to the children of ``keys`` (default: all) that are not reaped, each to its
        process group where it leads one."""
        with self._lock:
            for key in (self.running() if keys is None else keys):
                child = self.children.get(key)
                if child is not None:
                    signal_child(child, sig)

    def terminate(self, grace: float | None = None) -> None:
        """SIGTERM to every child still running now, SIGKILL to those left once ``grace``
        (default: the handle's) has passed (`poll`/`wait` send it)."""
        with self._lock:
            self.poll()
            self.signal(signal.SIGTERM)
            self._kill_at = time.monotonic() + (self.grace if grace is None else grace)

    def stop(self, grace: float | None = None) -> dict[Hashable, int]:
        """Stop every child with grace (`terminate`) and reap them all; their exit statuses."""
        self.terminate(grace)
        return self.wait()

    def kill(self) -> None:
        """SIGKILL to every child not reaped (its group where it leads one), now, without
        waiting: for a watchdog about to end this process. Safe from another thread."""
        self.signal(signal.SIGKILL)

    def close(self) -> None:
        """End (SIGKILL) and reap every child still running; an interrupt while it waits is
        raised once all are reaped. Outputs not read are closed."""
        caught: list[BaseException] = []
        with self._lock:
            for key, child in list(self.children.items()):
                if self.codes.get(key) is None:
                    try:
                        stop(child)
                    except BaseException as e:  # noqa: BLE001 - the others are owed a reap too
                        caught.append(e)
                    self.codes[key] = child.returncode
        for said in self.outputs.values():
            said.close()
        if caught:
            raise caught[0]

    # -- output ----------------------------------------------------------------------------------
    def said(self, key: Hashable) -> tuple[str, str]:
        """(stdout, stderr) of the child ``key`` started with ``output=True``, once it ended."""
        return self.outputs.pop(key).said()

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self.children))

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, kind, value, tb) -> None:
        # every child the block left running is ended and reaped; after an error that error
        # goes on (not a later one) and the outputs are closed, else they stay readable (`said`)
        for key, child in list(self.children.items()):
            if self.codes.get(key) is None:
                stop(child, reraise=kind is None)
                self.codes[key] = child.returncode
        if kind is not None:
            for said in self.outputs.values():
                said.close()
