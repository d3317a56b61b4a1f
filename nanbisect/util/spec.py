"""The forms of the strings a user passes: entries (``pkg.module:function``,
``path/to/file.py:function``), device strings (``cuda:1``, ``cpu:float64``, ``cuda:1:float64``,
``none``: `DeviceSpec`) and rank lists (``0,3``). Checked here without torch, so the command line
answers a malformed one at once.

Guarantees: each check accepts every string of its form that the full parse accepts (the device
grammar is c10's own: a type of letters and ``_``, an optional index ``0`` or ``[1-9][0-9]*``;
then an optional floating dtype name), and raises the `BadInput` the full parse would.
Not checked here: whether the device type exists or this machine has it, whether the dtype
exists in this torch, whether an entry resolves (`nanbisect.devices.parse`,
`nanbisect.task.load_task` do that, after torch is imported).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from nanbisect.errors import BadInput
from nanbisect.util.text import show

# c10/core/Device.cpp parses "TYPE[:INDEX]" with this grammar; the type's name is checked there
_DEVICE = re.compile(r"[a-zA-Z_]+(:(0|[1-9][0-9]*))?")
# torch's floating dtypes by name: float, double, half, bfloat16, float16/32/64, float8_*, ...
_FLOAT_DTYPE = re.compile(r"(b?float[0-9a-z_]*|double|half)")
MAX_RANK = (1 << 20) - 1      # nanbisect.bundle.bounded.MAX_WORLD_SIZE - 1


def split_entry(entry: str) -> tuple[str, str]:
    """``"pkg.mod:fn"`` -> ``("pkg.mod", "fn")``; `BadInput` for any other form.

    >>> split_entry("train.py:make_task")
    ('train.py', 'make_task')
    """
    target, sep, func = entry.rpartition(":")
    if not sep or not target or not func.isidentifier():
        raise BadInput(f"entry {show(entry)} is not of the form 'pkg.module:function' or "
                       "'path/to/file.py:function'; pass --entry with that form")
    return target, func


NONE = "none"      # the device string of no reference


@dataclass(frozen=True)
class DeviceSpec:
    """A device string as a value: the device (``"cuda:1"``; None for ``none``, no reference)
    and the floating dtype to replay at (``"float64"``; None: the bundle's). `parse` and `str`
    are inverse; torch resolves it later (`nanbisect.devices.parse`).

    >>> s = DeviceSpec.parse("cuda:1:float64")
    >>> s, str(s), str(DeviceSpec.parse("none")), DeviceSpec.parse("none").none
    (DeviceSpec(device='cuda:1', dtype='float64'), 'cuda:1:float64', 'none', True)
    """

    device: str | None
    dtype: str | None = None

    @classmethod
    def parse(cls, text: str) -> "DeviceSpec":
        """The spec of ``text``; `BadInput` (what `check_device` says) for a malformed one."""
        if text == NONE:
            return cls(None)
        return cls(*check_device(text))

    @property
    def none(self) -> bool:
        """No device: no reference side."""
        return self.device is None

    @property
    def type(self) -> str | None:
        """The device type (``"cuda"`` of ``"cuda:1"``)."""
        return None if self.device is None else self.device.split(":")[0]

    def __str__(self) -> str:
        if self.device is None:
            return NONE
        return self.device + (f":{self.dtype}" if self.dtype else "")


def check_device(spec: str) -> tuple[str, str | None]:
    """``"cuda:1"`` -> ``("cuda:1", None)``, ``"cpu:float64"`` -> ``("cpu", "float64")``,
    ``"cuda:1:float64"`` -> ``("cuda:1", "float64")``: the device part and the dtype name;
    `BadInput` (the message `nanbisect.devices.parse` gives) when the string cannot be a
    device string.

    >>> check_device("cpu:float64"), check_device("cuda:1"), check_device("cuda:1:float64")
    (('cpu', 'float64'), ('cuda:1', None), ('cuda:1', 'float64'))
    """
    dev, _, dtype_name = spec.rpartition(":")
    if dev and dtype_name and not dtype_name.isdigit():
        if not _FLOAT_DTYPE.fullmatch(dtype_name):
            raise BadInput(f"device {show(spec)}: {show(dtype_name)} is not a floating dtype; "
                           "use e.g. cpu:float64")
    else:
        dev, dtype_name = spec, None
    if not _DEVICE.fullmatch(dev):
        raise BadInput(f"device {show(spec)} is not a torch device string; use e.g. cpu, cuda, "
                       "cuda:1")
    return dev, dtype_name


def check_ranks(spec: str) -> list[int]:
    """``"3, 1"`` -> ``[1, 3]``; `BadInput` unless it is rank numbers separated by commas (which
    ranks the bundle has is checked against its manifest later).

    >>> check_ranks("3, 1")
    [1, 3]
    """
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts or not all(x.isascii() and x.isdigit() for x in parts):
        raise BadInput(f"--ranks {show(spec)}: give rank numbers (0 to {MAX_RANK}) separated by "
                       "commas, e.g. --ranks 1 or --ranks 0,3")
    if any(len(x.lstrip("0")) > 7 or int(x) > MAX_RANK for x in parts):
        raise BadInput(f"--ranks {show(spec)}: a rank past the largest a bundle can have "
                       f"({MAX_RANK}); give the ranks of the bundle's world")
    ranks = sorted({int(x) for x in parts})
    return ranks
