"""`Manifest`: a bundle's manifest.json read once through the bounded reader, seen through typed
properties, so each field that more than one stage asks is read by one rule.

>>> m = Manifest({"schema": "nanbisect.bundle/1", "entry": "t.py:task",
...               "devices": {"captured_on": "cuda:1"}})
>>> m.captured_on, m.captured_type, m.multi_rank, Manifest({}).captured_on
('cuda:1', 'cuda', False, 'cpu')

Guarantees: `Manifest.read` goes through `nanbisect.bundle.format.read_manifest` (size, JSON
values and depth bounded, schema checked: a bad file is one `BadInput`); a property never
raises on a manifest that passed that check (absent sections read as their documented default).
Not guaranteed: that the bundle's tensors match it (`nanbisect.bundle.format.read_bundle`
verifies them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanbisect.devices import HOST, on_host

HOST_TYPE = HOST.type      # the device a manifest that names none was captured on


def captured_on(devices: Any) -> str:
    """The device a bundle (or a part) was captured on, from its manifest's ``devices``
    section: its ``captured_on`` (a device string, checked by the schema), the host's type
    when the section or the field is absent or empty. The one rule every reader uses.

    >>> captured_on({"captured_on": "npu:3"}), captured_on(None), captured_on({})
    ('npu:3', 'cpu', 'cpu')
    """
    found = devices.get("captured_on") if isinstance(devices, dict) else None
    return str(found) if found else HOST_TYPE


def _section(data: dict, key: str) -> dict:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Manifest:
    """A checked manifest (``data``, as read) and the fields stages ask of it."""

    data: dict = field(repr=False)

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        """The manifest of the bundle (or multi-rank top) at ``path``, read once and checked."""
        from nanbisect.bundle.format import read_manifest
        return cls(read_manifest(path))

    @classmethod
    def of(cls, source: Any) -> "Manifest":
        """The view of a `Bundle` (its ``manifest``), of a manifest dict, or ``source`` itself."""
        if isinstance(source, Manifest):
            return source
        return cls(source if isinstance(source, dict) else source.manifest)

    # -- where and how it was captured -----------------------------------------------------
    @property
    def devices(self) -> dict:
        return _section(self.data, "devices")

    @property
    def captured_on(self) -> str:
        """``devices.captured_on``, the host's type when absent (`captured_on`)."""
        return captured_on(self.data.get("devices"))

    @property
    def captured_type(self) -> str:
        """The type of `captured_on` (``"cuda"`` for ``"cuda:1"``)."""
        return self.captured_on.split(":")[0]

    @property
    def captured_on_host(self) -> bool:
        """Whether it was captured on the host (the CPU: its type's entry `on_host`)."""
        return on_host(self.captured_type)

    @property
    def environment(self) -> dict:
        return _section(self.data, "environment")

    @property
    def hardware(self) -> dict | None:
        """``environment.hardware`` (the device seam's fingerprint), None when absent."""
        hw = self.environment.get("hardware")
        return hw if isinstance(hw, dict) else None

    # -- what it holds ---------------------------------------------------------------------
    @property
    def entry(self) -> str | None:
        return self.data.get("entry")

    @property
    def multi_rank(self) -> bool:
        """A multi-rank top (``kind: multi-rank``), not one process's bundle."""
        return self.data.get("kind") == "multi-rank"

    @property
    def observed(self) -> dict | None:
        """What the Guard saw fail (None: captured on demand, no failure recorded)."""
        obs = self.data.get("observed")
        return obs if isinstance(obs, dict) else None

    @property
    def step(self) -> int | None:
        return self.data.get("step")

    @property
    def world_size(self) -> int:
        return self.data.get("world_size") or 1

    @property
    def rank(self) -> int | None:
        return self.data.get("rank")

    @property
    def task(self) -> dict:
        return _section(self.data, "task")

    @property
    def runs_top_level(self) -> bool:
        """Did the capture's Task say its entry's top level may run (``run_top_level=True``)?"""
        return self.task.get("run_top_level") is True

    @property
    def partial(self) -> dict | None:
        value = self.data.get("partial")
        return value if isinstance(value, dict) else None

    @property
    def lookback(self) -> dict | None:
        """The ``lookback`` section (the steps recorded before the failing one: a remedy's
        earlier batch, ``--steps``), as written; None when the capture kept none."""
        return self.data.get("lookback")

    @property
    def grad_scaler(self) -> dict:
        """The ``grad_scaler`` section (the GradScaler's ``scale`` at capture), ``{}`` without
        one."""
        return _section(self.data, "grad_scaler")

    @property
    def collectives(self) -> dict | None:
        """One rank's recorded collectives (the tape `nanbisect.bundle.tape.parse` reads), as
        written; None when the part records none (captured with ``capture``, or by an older
        nanbisect)."""
        return self.data.get("collectives")

    @property
    def ranks(self) -> dict:
        """A multi-rank top's ``ranks``: each rank held (its number as a string) -> what the top
        says of it (``observed``: its own failure, if any); ``{}`` for one process's bundle."""
        return _section(self.data, "ranks")
