"""Hold a process's asynchronous signals around an ``os.fork()`` and the line that stores its
pid, so that no handler (a KeyboardInterrupt, a timer's) can lose the child between the two.

Guarantees: the parent's mask is restored on the way out; the synchronous signals a fault raises
are never held. Not guaranteed: ``_thread.interrupt_main`` sends no signal and cannot be held.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

# the synchronous signals a fault raises, never held
_FAULTS = ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS",
           "SIGABRT")


@contextlib.contextmanager
def held() -> Iterator[set | None]:
    """Around an ``os.fork()`` and the line that stores its pid: the asynchronous signals are
    held (blocked, not lost) so that no handler runs between the fork's return and that line;
    the parent's mask is restored on the way out. Gives the mask to restore (None where there
    are no masks): the child never leaves the block (it ends with ``os._exit``) and restores it
    itself (`unheld`) inside its own ``try``, so that no exception of its unwinds into the
    parent's code.

    >>> with held() as mask:
    ...     pass
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield None
        return
    faults = {getattr(signal, name) for name in _FAULTS if hasattr(signal, name)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [])   # read only: an interrupt here is harmless
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - faults)
        yield old
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unheld(mask: set | None) -> None:
    """In a child forked inside `held`: the signal mask its parent had before."""
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
