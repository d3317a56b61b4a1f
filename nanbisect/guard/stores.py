"""Where `nanbisect.guard.keep.Keeper` keeps a snapshot's tensors: a safetensors file in a
locked scratch directory of the system's temporary directory (`Scratch`, which the kept steps'
spill shares: `nanbisect.guard.spill`) when the state lives in host memory (`FileStore`: a copy
in memory would double it), else host memory, pinned and filled without a host synchronisation
where the device allows (`HostStore`). Both stage a new snapshot
beside the current one and `commit` it, so the current one is whole until then.

Guarantees: a file store's directory is private (``mkdtemp``: mode 0700) and removed when its Guard
closes or is collected, by the process that made it only (never by a child forked from it), or
by the next Guard of the same user anywhere on the machine once its owner is dead (`_sweep`).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import weakref

import torch

from nanbisect import devices
from nanbisect.bundle.state import Tensors
from nanbisect.util import lockdir

SCRATCH = "nanbisect-guard-"    # the snapshot file's directory, in the temporary directory


class Scratch:
    """A private directory of the system's temporary directory (``TMPDIR``), made when first
    asked for, that this process holds a lock in (`nanbisect.util.lockdir`): removed by `close`,
    when its owner is collected, or by the next Guard anywhere on the machine once its owner is
    dead (a killed run)."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self._finalizer = None

    def path(self, name: str) -> str:
        if self.dir is None:
            _sweep()
            path, fd = lockdir.make(f"{SCRATCH}{os.getpid()}-")
            self.dir = str(path)
            self._finalizer = weakref.finalize(self, _drop_dir, self.dir, fd, os.getpid())
        return os.path.join(self.dir, name)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.dir = self._finalizer = None


class FileStore:
    """The snapshot's tensors in one safetensors file (read back one tensor at a time), in a
    `Scratch` directory (shared with the kept steps' spill, `nanbisect.guard.spill`)."""

    def __init__(self, scratch: Scratch | None = None) -> None:
        self.scratch = scratch if scratch is not None else Scratch()

    @property
    def _dir(self) -> str | None:
        return self.scratch.dir

    def _path(self) -> str:
        return self.scratch.path("state.safetensors")

    def prepare(self) -> None:
        self._path()

    def stage(self, tensors: Tensors) -> None:
        """Write the new snapshot beside the current one (`commit` puts it in its place)."""
        from safetensors.torch import save_file

        seen: set = set()
        out = {}
        for k, t in tensors.items():
            t = t.detach().to(devices.HOST)
            ptr = t.untyped_storage().data_ptr() if t.numel() else None
            # NB: safetensors refuses tensors sharing storage: those are cloned, one by one
            if not t.is_contiguous() or (ptr is not None and ptr in seen):
                t = t.contiguous().clone()
            elif ptr is not None:
                seen.add(ptr)
            out[k] = t
        path = self._path()
        try:
            save_file(out, path + ".tmp")
        except BaseException:
            self.abort()           # a half-written file takes no room
            raise

    def commit(self) -> None:
        path = self._path()
        # NB: not os.replace: ext4 (auto_da_alloc) writes a file renamed over another out to
        # disk before the rename returns (6 ms for 7 MB, every snapshot); an old file
        # unlinked first is only dropped. The new one is whole before the old one goes.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rename(path + ".tmp", path)

    def abort(self) -> None:
        if self.scratch.dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path() + ".tmp")

    def settle(self) -> None:
        pass

    def get(self) -> "LazyFile":
        return LazyFile(self._path())

    def close(self) -> None:
        self.scratch.close()


def _drop_dir(path: str, fd: int, owner: int) -> None:
    """Remove the snapshot's directory, in the process that made it only: a child forked from
    it (a data-loader worker, a checkpoint writer) runs this at its exit too, and must leave its
    parent's live snapshot alone (it closes its copy of the lock, which the parent still holds)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(fd)


def _sweep() -> None:
    """Remove the snapshot directories of this user's Guards whose process is gone (their lock
    is free); another user's are never touched."""
    tmp = tempfile.gettempdir()
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return
    for e in entries:
        if re.fullmatch(rf"{SCRATCH}\d+-[a-z0-9_]{{8}}", e.name) and \
                e.is_dir(follow_symlinks=False) and _mine(e) and \
                lockdir.state(e.path) == "free":
            shutil.rmtree(e.path, ignore_errors=True)


def _mine(e: os.DirEntry) -> bool:
    try:
        return e.stat(follow_symlinks=False).st_uid == os.getuid()
    except OSError:
        return False


class LazyTensors(dict):
    """A read-only mapping whose tensors are each read when asked for (`_read`), over the keys
    ``_keys`` (a subclass sets both): what `decode` and a rebuild read as a snapshot's or a kept
    step's tensors without loading them all."""

    _keys: set

    def _read(self, k):
        raise NotImplementedError

    def __contains__(self, k) -> bool:
        return k in self._keys

    def __getitem__(self, k):
        if k not in self._keys:
            raise KeyError(k)
        return self._read(k)

    def get(self, k, default=None):
        return self[k] if k in self._keys else default

    def keys(self):
        return set(self._keys)

    def items(self):
        return ((k, self[k]) for k in sorted(self._keys))

    def values(self):
        return (self[k] for k in sorted(self._keys))

    def __iter__(self):
        return iter(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)


class LazyFile(LazyTensors):
    """A safetensors file's tensors, each read when asked for."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        super().__init__()
        self._f = safe_open(path, framework="pt")
        self._keys = set(self._f.keys())

    def _read(self, k):
        return self._f.get_tensor(k)

    def shape(self, k) -> tuple:
        """A tensor's shape, from the file's header (the tensor is not read)."""
        return tuple(self._f.get_slice(k).get_shape())


class HostStore:
    """The snapshot's tensors in (pinned) host memory, kept from one snapshot to the next while
    they fit, copied without a host synchronisation (ordered before the optimizer on the
    device's stream)."""

    def __init__(self) -> None:
        self._held: Tensors = {}
        self._staged: dict = {}
        self._pending: set = set()     # the types whose asynchronous copies are not waited for

    def prepare(self) -> None:
        pass

    def stage(self, tensors: Tensors) -> None:
        """Allocate what the new snapshot needs (what can fail: pinned memory), copying
        nothing: the current snapshot is whole until `commit`."""
        staged = {}
        for k, t in tensors.items():
            t = t.detach()
            h = self._held.get(k)
            if h is None or h.shape != t.shape or h.dtype != t.dtype:
                h = torch.empty(t.shape, dtype=t.dtype, device=devices.HOST,
                                pin_memory=devices.entry(t.device).pinned_host_memory)
            staged[k] = (h, t)
        self._staged = staged

    def commit(self) -> None:
        staged, self._staged = self._staged, {}
        pending = set()
        for h, t in staged.values():
            dt = devices.entry(t.device)
            h.copy_(t, non_blocking=dt.pinned_host_memory)
            if dt.pinned_host_memory:
                pending.add(dt)
        self._held = {k: h for k, (h, _) in staged.items()}
        self._pending = pending

    def abort(self) -> None:
        self._staged = {}

    def settle(self) -> None:
        """Wait for the copies (timed: the transfer is what a snapshot costs)."""
        for dt in self._pending:
            dt.synchronize()
        self._pending = set()

    def get(self) -> Tensors:
        self.settle()          # the asynchronous copies, complete
        return dict(self._held)

    def close(self) -> None:
        self._held, self._staged = {}, {}
