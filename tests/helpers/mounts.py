"""Real file systems that fail writes, for the output-path tests: a tiny tmpfs (ENOSPC), a
read-only bind mount (EROFS), an empty mount point (EBUSY on rename), and a thread without
CAP_DAC_OVERRIDE so that mode bits give EACCES even to root.

Each skips the test, with the reason, where the machine does not allow it (not root, no
mount(2) in a container, no capset)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    p = subprocess.run(["mount", *args], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount here (mount {' '.join(args)}: {p.stderr.strip()}); "
                    "needs root with CAP_SYS_ADMIN")


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "16k"):
    """A tmpfs of ``size`` mounted on the new directory ``path``: writes past it get ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` (a directory) bind-mounted read-only over itself: writes get EROFS."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(path), str(path))
    try:
        p = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True,
                           text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {p.stderr.strip()}")
        yield path
    finally:
        _umount(path)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_CAP_V3 = 0x20080522
_DAC = (1 << 1) | (1 << 2)        # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


@contextlib.contextmanager
def mode_bits_apply():
    """Within the block, this thread obeys file mode bits even as root: CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH are dropped from its effective set (capabilities are per thread on
    Linux) and restored after. Not root: nothing to drop."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    head, data = _CapHeader(_CAP_V3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(head), data) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    saved = data[0].effective
    data[0].effective = saved & ~_DAC
    if libc.capset(ctypes.byref(head), data) != 0:
        pytest.skip(f"cannot drop CAP_DAC_OVERRIDE here: {os.strerror(ctypes.get_errno())}; "
                    "as root, mode bits never refuse a write")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(head), data) == 0, "could not restore capabilities"
