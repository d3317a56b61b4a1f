"""Signals, the one place that sets their handlers and masks.

- `held` / `unheld`: a process's asynchronous signals held around an ``os.fork()`` and the line
  that stores its pid, so that no handler (a KeyboardInterrupt, a timer's) can lose the child
  between the two;
- `install` and `handling`: a handler set (and, for `handling`, the previous one put back on the
  way out), e.g. triage's SIGTERM/SIGINT that stop a night cleanly;
- `deferred`: a signal held back by a handler for a block, then delivered to the handler that
  was there before (the multi-rank write's SIGTERM);
- `imports_whole`: a Ctrl-C that lands while a module is being imported held until that import
  is over (the Python API's run: an interrupted ``import torch``, or of one of its C-backed
  submodules, leaves C++ state registered by a module Python then forgets, and every later
  import of it fails until the interpreter restarts: ``partially initialized module 'torch'
  has no attribute 'fx'``, ``Only a single TORCH_LIBRARY ...``).

Guarantees: the parent's mask is restored on the way out of `held`; the synchronous signals a
fault raises are never held; `handling` and `deferred` put back the handler they found, however
the block ends. Not guaranteed: ``_thread.interrupt_main`` sends no signal and cannot be held;
handlers can only be set from the main thread (Python's rule: the callers check).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterable, Iterator

from nanbisect.util.library_internals import thread_frame


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


def install(sig: int, handler) -> object:
    """Set ``handler`` (a function of ``(signum, frame)``, ``signal.SIG_IGN`` or
    ``signal.SIG_DFL``) for ``sig``; the handler it replaced (as `signal.signal` gives it)."""
    return signal.signal(sig, handler)


@contextlib.contextmanager
def handling(sigs: Iterable[int], handler) -> Iterator[dict]:
    """``handler`` set for every signal of ``sigs`` while the block runs; the handlers found
    are put back on the way out, however it ends. Yields {signal: the handler it replaced}.

    >>> with handling([signal.SIGUSR2], signal.SIG_IGN) as old:
    ...     signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    True
    """
    sigs = list(sigs)
    old = {s: signal.getsignal(s) for s in sigs}
    try:
        for s in sigs:
            signal.signal(s, handler)
        yield old
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred(sig: int) -> Iterator[Callable[[], float | None]]:
    """Hold ``sig`` back inside the block; yields ``came()``: when it came (`time.monotonic`),
    or None. On leaving, the previous handler is put back and a held signal is delivered to it
    (for SIGTERM by default the process ends). Only in the main thread, and only over the
    default handler or a Python one (a handler set from C code, or SIG_IGN, is left alone:
    the block runs without holding)."""
    came: list[float] = []
    old = signal.getsignal(sig)
    if threading.current_thread() is not threading.main_thread() or old in (signal.SIG_IGN,
                                                                             None):
        yield lambda: None
        return

    def hold(signum, frame) -> None:
        came.append(time.monotonic())

    signal.signal(sig, hold)
    try:
        yield lambda: came[0] if came else None
    finally:
        signal.signal(sig, old)
        if came:
            os.kill(os.getpid(), sig)


POLL = 0.02     # seconds between `imports_whole`'s looks at the main thread's stack


def _importing(frame) -> bool:
    """Is an import on the stack from ``frame`` down (a frame of importlib's bootstrap)?"""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def imports_whole() -> Iterator[None]:
    """Inside the block, on the main thread, a SIGINT whose handler finds the main thread inside
    an import is held; a helper thread watches the main thread and sends the SIGINT again the
    moment no import is on its stack, so the block's handler (or, after the block, the one it
    put back) raises it there. A SIGINT outside an import goes at once to the handler that was
    there (Python's: `KeyboardInterrupt`). Off the main thread, or over SIG_IGN or a handler
    set from C code, the block changes nothing. Not guaranteed: an import that never ends
    holds the interrupt for as long.

    >>> before = signal.getsignal(signal.SIGINT)
    >>> with imports_whole():
    ...     import json
    >>> signal.getsignal(signal.SIGINT) is before
    True
    """
    old = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(old):
        yield
        return
    held_now = threading.Event()
    main = threading.main_thread().ident

    def redeliver() -> None:
        while _importing(thread_frame(main)):
            time.sleep(POLL)
        held_now.clear()
        os.kill(os.getpid(), signal.SIGINT)

    def handler(signum, frame) -> None:
        if _importing(frame):
            if not held_now.is_set():
                held_now.set()
                threading.Thread(target=redeliver, name="nanbisect-sigint", daemon=True).start()
            return
        old(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
