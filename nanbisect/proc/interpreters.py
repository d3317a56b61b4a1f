"""Fresh interpreters started ahead of the work they will run, and the pool that keeps one.

A fresh interpreter pays its start and its imports (``import torch``: seconds) before it runs
anything; started ahead, that cost overlaps its starter's own work. `Waiting` is one such
interpreter: it runs ``code``, which reads what to do from one line of its stdin (`hand`), with
its stdout and stderr in files of their own (`Output`). `Spares` keeps one started for the next
taker and ends, when this process exits, the one nobody took.

Guarantees: a `Waiting` that could not start, or died before it was handed its line, says so
(``proc`` None, `hand` False), so that its caller can run the work another way; `close` ends and
reaps it (its group too where it leads one). Not guaranteed: what ``code`` does with the line.
"""
from __future__ import annotations

import atexit
import subprocess
import sys
from typing import Callable, Generic, TypeVar

from nanbisect.proc.reap import stop
from nanbisect.proc.supervisor import Output, start_exec


class Waiting:
    """A fresh interpreter running ``code`` (``python -c``), started by `start`, that waits for
    one line on its stdin (`hand`). ``proc``: its `subprocess.Popen` (None before `start`, when
    it could not start, and once taken for its wait or closed); ``output``: what it says.

    >>> w = Waiting("import sys; print(sys.stdin.readline().upper(), end='')").start()
    >>> w.hand("hello\\n"), w.proc.wait(30), w.output.said()
    (True, 0, ('HELLO\\n', ''))
    """

    def __init__(self, code: str) -> None:
        self.code = code
        self.proc: subprocess.Popen | None = None
        self.output: Output | None = None

    def start(self) -> Waiting:
        """Launch it (its working directory is this process's: ``code`` moves where it must)."""
        try:
            self.output = Output()
            self.proc = start_exec([sys.executable, "-c", self.code], stdin=subprocess.PIPE,
                                   stdout=self.output.out, stderr=self.output.err)
        except OSError:
            self.proc = None
        return self

    def hand(self, line: str) -> bool:
        """Write ``line`` to its stdin and close it; False when it is not running (never
        started, or it died before or while the line was handed over)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return False
        handed = False
        try:
            p.stdin.write(line.encode())
            p.stdin.close()
            handed = True
        except (BrokenPipeError, OSError):   # it died while the line was handed over
            try:
                p.stdin.close()
            except OSError:
                pass
        p.stdin = None      # closed (a later close must not flush it again)
        return handed

    def close(self) -> None:
        """End and reap it (nothing when it was never started), and drop what it said."""
        p, self.proc = self.proc, None
        said, self.output = self.output, None
        stop(p)
        if said is not None:
            said.close()


Started = TypeVar("Started")


class Spares(Generic[Started]):
    """A pool of one object started ahead (``make()`` gives it unstarted: it has ``start()``,
    which gives it back, and ``close()``): `keep` starts one, `take` hands it over (or starts a
    new one); one nobody took is closed when this process exits.

    >>> pool = Spares(lambda: Waiting("pass"))
    >>> pool.keep(); w = pool.take(); w.proc is not None and not pool.kept
    True
    >>> w.close()
    """

    def __init__(self, make: Callable[[], Started]) -> None:
        self.make = make
        self.kept: list[Started] = []
        self._at_exit = False

    def keep(self) -> None:
        """One started ahead now, unless one is kept already."""
        if self.kept:
            return
        self.kept.append(self.make().start())
        if not self._at_exit:
            atexit.register(self.close)
            self._at_exit = True

    def take(self) -> Started:
        """The one kept, or a new one started now."""
        return self.kept.pop() if self.kept else self.make().start()

    def close(self) -> None:
        """Close every one kept."""
        while self.kept:
            self.kept.pop().close()
