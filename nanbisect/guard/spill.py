"""The kept steps' batches written to a file off the training thread, so that the Guard's memory
stays small whatever the batch, and the snapshot's cadence follows its time cost alone
(`nanbisect.guard.keep.Keeper`).

A step's record copies its batch (a loop may refill its buffer), which a rebuild needs for
every step since the snapshot. When the copies held in memory outgrow their share of the state's
bytes, `Spill.put` hands a record to a writer thread that appends its tensors' bytes to a file in
the Guard's scratch directory (`nanbisect.guard.stores.Scratch`); the next `Spill.collect`, on
the training thread, swaps the record's tensors for a view of the file (`Spilled`, read back one
tensor at a time) and keeps the copies' storage for the next steps' copies (`Spill.buffer`: no
new allocation, no page faults, in a steady run).

Guarantees: everything a record holds is changed on the training thread only (the writer thread
writes bytes and reports what it wrote), so a rebuild reads either the copies or the file, never
half of each; a record whose write failed (a full disk) keeps its copies, and spilling stops
until the next snapshot (`reset`) tries again; the file holds raw bytes with their dtypes and
shapes kept in memory (nothing in it is ever unpickled); `close` waits for the writer at most
`CLOSE_WAIT` seconds (it is a daemon thread: it never holds the process up). Only host
tensors are spilled (a batch on an accelerator stays where it is, counted in memory).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import queue
import threading
import weakref
from typing import Any, Callable

import torch

from nanbisect import devices
from nanbisect.guard.stores import LazyTensors, Scratch
from nanbisect.util.files import read_at
from nanbisect.util.tensors import tensor_bytes

CLOSE_WAIT = 5.0        # seconds `close` waits for the writer thread
IOV_MAX = 512           # buffers in one write call (Linux takes at most 1024)


class Spilled(LazyTensors):
    """One spilled record's tensors, each read from the file when asked for (``entries``: key
    -> (offset, dtype, shape))."""

    def __init__(self, spill: "Spill", gen: int, entries: dict[str, tuple]) -> None:
        super().__init__()
        self._spill, self._gen, self._entries = spill, gen, entries
        self._keys = set(entries)

    def _read(self, k):
        return self._spill.read(self._gen, *self._entries[k])


def spillable(ts: dict[str, torch.Tensor]) -> bool:
    """Can these tensors be written as raw bytes (dense, contiguous, in host memory)?"""
    return all(devices.on_host(t.device) and t.layout == torch.strided and t.is_contiguous()
               and not t.is_quantized for t in ts.values())


class Spill:
    """The file of the kept steps' tensors and the thread that writes it (one per Keeper)."""

    def __init__(self, scratch: Scratch | None = None) -> None:
        self.scratch = scratch if scratch is not None else Scratch()
        self.failed: str | None = None     # why the last write failed (until `reset`)
        self.disk_bytes = 0                # written since the last `reset`
        self._gens = [0]       # [the generation], bumped by `reset`: earlier work is dropped
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque = collections.deque()   # the writer's reports
        self._queued: dict[int, tuple] = {}     # id(record) -> (record, its copies, bytes)
        self._pending = 0                  # their bytes
        self._thread: threading.Thread | None = None
        self._pool: dict[tuple, list[torch.Tensor]] = {}    # storage to copy into, by shape
        self._fd: int | None = None        # the training thread's descriptor (reads)

    @property
    def _gen(self) -> int:
        return self._gens[0]

    @_gen.setter
    def _gen(self, value: int) -> None:
        self._gens[0] = value

    # -- the training thread --------------------------------------------------------------
    def buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor shaped like ``t``, from the storage of copies already
        spilled when one fits, else new."""
        key = (t.dtype, tuple(t.shape))
        free = self._pool.get(key)
        return free.pop() if free else torch.empty(key[1], dtype=t.dtype)

    def put(self, record: Any, nbytes: int) -> bool:
        """Hand ``record`` (its ``tensors``: host copies) to the writer; False when it is not
        taken (a write failed since the last `reset`, or tensors that are not raw bytes)."""
        ts = record.tensors
        if self.failed is not None or isinstance(ts, Spilled) or id(record) in self._queued \
                or not spillable(ts):
            return False
        if self._thread is not None and not self._thread.is_alive():
            self.failed = "the writer thread ended"
            return False
        if self._thread is None:
            # a Spill dropped unclosed (a Guard left after its failure) ends its writer too;
            # at the interpreter's exit `_close_all` joins it first (not this finalizer alone:
            # a thread still running while the interpreter tears down may abort the process)
            self._ender = weakref.finalize(self, self._jobs.put, None)
            self._ender.atexit = False
            _LIVE.add(self)
            self._thread = threading.Thread(
                target=_write_loop, name="nanbisect-spill", daemon=True,
                args=(self.scratch.path("kept.bin"), self._jobs, self._done, self._gens))
            self._thread.start()
        try:
            items = [(k, t.dtype, tuple(t.shape), tensor_bytes(t))   # (host: no copy)
                     for k, t in ts.items()]
        except Exception:  # noqa: BLE001 - bytes it cannot take: the record keeps its copies
            return False
        self._queued[id(record)] = (record, ts, nbytes)
        self._pending += nbytes
        self._jobs.put((self._gen, id(record), items))
        return True

    def pending(self) -> int:
        """Bytes handed to the writer and not reported written yet."""
        return self._pending

    def collect(self, on_spilled: Callable[[Any, int], None]) -> None:
        """Take the writer's reports: each written record's tensors become a view of the file
        (``on_spilled(record, bytes)``), its copies' storage kept for reuse; a failed write
        stops spilling until `reset`."""
        while self._done:     # (empty: nothing to do, no call made)
            gen, rid, entries, error = self._done.popleft()
            job = self._queued.pop(rid, None) if gen == self._gen else None
            if job is None:
                continue           # dropped since (a new snapshot)
            record, copies, nbytes = job
            self._pending -= nbytes
            if error is not None:
                self.failed = error
                continue
            if record.tensors is copies:
                record.tensors = Spilled(self, gen, entries)
                self.disk_bytes += nbytes
                on_spilled(record, nbytes)
                self._recycle(copies)

    def _recycle(self, copies: dict[str, torch.Tensor]) -> None:
        """Keep the storage of the record just written for the next step's copies (it
        replaces what was kept: one step's worth at most, whatever the shapes)."""
        pool: dict[tuple, list[torch.Tensor]] = {}
        for t in copies.values():
            if t.untyped_storage().nbytes() == t.numel() * t.element_size():   # not a view
                pool.setdefault((t.dtype, tuple(t.shape)), []).append(t)
        self._pool = pool

    def read(self, gen: int, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """One spilled tensor, read back (a copy of its own)."""
        if gen != self._gen:
            raise RuntimeError("a spilled step was read after a newer snapshot dropped it")
        out = torch.empty(shape, dtype=dtype)
        buf = memoryview(tensor_bytes(out)).cast("B")    # read straight into it
        if not len(buf):
            return out
        if self._fd is None:
            self._fd = os.open(self.scratch.path("kept.bin"), os.O_RDONLY | os.O_CLOEXEC)
        got = read_at(self._fd, buf, offset)
        if got != len(buf):
            raise OSError(f"the kept steps' file ends at {offset + got} of {offset + len(buf)}")
        return out

    def reset(self, survivors: list) -> None:
        """A new snapshot: the records before it are dropped, the file emptied. A surviving
        record (a step run again) that was spilled is read back into memory first; one that
        waits for the writer keeps its copies."""
        for r in survivors:
            if isinstance(r.tensors, Spilled):
                r.tensors = {k: v for k, v in r.tensors.items()}
        self._forget()
        if self._thread is not None:
            self._jobs.put((self._gen, None, None))     # the writer makes a new, empty file

    def _forget(self) -> None:
        """A new generation: what was handed to the writer, what it wrote and why it failed
        are forgotten (its reports for them are dropped), the read descriptor too (the writer
        makes a new file)."""
        self._gen += 1
        self._queued.clear()
        self._pending = 0
        self._done.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.disk_bytes = 0
        self.failed = None

    def close(self) -> None:
        """Stop the writer (waiting at most `CLOSE_WAIT` s) and forget everything; the file
        goes with the scratch directory."""
        self._forget()
        if self._thread is not None:
            self._ender()                  # the writer's last job
            self._thread.join(CLOSE_WAIT)
            self._thread = None
        self._pool = {}
        self._jobs, self._done = queue.SimpleQueue(), collections.deque()


_LIVE: "weakref.WeakSet[Spill]" = weakref.WeakSet()   # the Spills whose writer was started


@atexit.register
def _close_all() -> None:
    """At the interpreter's exit (a loop that ended on `NonFiniteStep` without `Guard.close`):
    stop and join every writer while the interpreter is whole."""
    for spill in list(_LIVE):
        spill.close()


def _write_loop(path: str, jobs: queue.SimpleQueue, done: collections.deque,
                gens: list[int]) -> None:
    """The writer thread: append each job's bytes to the file and report where they went; it
    holds no reference to its `Spill` (which, dropped unclosed, sends its last job)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    except OSError as e:     # no room even for the file: every job says so
        fd, why = None, f"{type(e).__name__}: {e}"
    end = 0
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            gen, rid, items = job
            if gen != gens[0]:
                continue                    # dropped before it was written
            if fd is None and rid is not None:
                done.append((gen, rid, {}, why))
                continue
            if rid is None:                 # `reset`: a new, empty file
                # NB: not ftruncate(0): ext4 (auto_da_alloc) then writes the file out to
                # disk when it is closed; an unlinked one is only dropped
                if fd is not None:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                except OSError as e:
                    fd, why = None, f"{type(e).__name__}: {e}"
                end = 0
                continue
            entries, error, start = {}, None, end
            try:
                for key, dtype, shape, raw in items:
                    entries[key] = (end, dtype, shape)
                    end += len(raw)
                # one call for the record (the GIL let go once): a short write is finished
                bufs, at = [raw for *_, raw in items], start
                while bufs:
                    wrote = os.pwritev(fd, bufs[:IOV_MAX], at)
                    if wrote <= 0:
                        raise OSError("the kept steps' file took no bytes")
                    at += wrote
                    while bufs and wrote >= len(bufs[0]):
                        wrote -= len(bufs[0])
                        bufs.pop(0)
                    if bufs and wrote:
                        bufs[0] = bufs[0][wrote:]
            except Exception as e:  # noqa: BLE001 - a full disk: the record keeps its copies
                error, end = f"{type(e).__name__}: {e}", start
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
            done.append((gen, rid, entries, error))
            # hold no view of a record's copies while waiting: they belong to the training
            # thread, and their memory is torch's (freed on this thread otherwise)
            job = items = raw = bufs = None
    finally:
        if fd is not None:
            os.close(fd)
