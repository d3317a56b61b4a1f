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

    # -- what a replay restores and checks -------------------------------------------------
    @property
    def model(self) -> dict:
        """The ``model`` section: parameter and buffer names, ``aliases``, train/eval modes.

        >>> Manifest({"model": {"params": ["w"], "buffers": []}}).model["params"]
        ['w']
        """
        return _section(self.data, "model")

    @property
    def aliases(self) -> dict[str, str]:
        """``model.aliases``: a tied parameter's name -> the name it is stored under.

        >>> Manifest({"model": {"aliases": {"head.w": "emb.w"}}}).aliases, Manifest({}).aliases
        ({'head.w': 'emb.w'}, {})
        """
        value = self.model.get("aliases")
        return value if isinstance(value, dict) else {}

    @property
    def optimizer(self) -> dict | None:
        """The ``optimizer`` section (class, state, param_groups); None when the capture had no
        optimizer or left its state out.

        >>> Manifest({"optimizer": None}).optimizer, Manifest({}).optimizer
        (None, None)
        >>> Manifest({"optimizer": {"class": "torch.optim.sgd.SGD"}}).optimizer["class"]
        'torch.optim.sgd.SGD'
        """
        value = self.data.get("optimizer")
        return value if isinstance(value, dict) else None

    @property
    def batch(self) -> Any:
        """The ``batch`` section: the batch's pytree with its tensors' names (for
        `nanbisect.bundle.state.decode`).

        >>> Manifest({"batch": {"t": "tensor", "name": "batch/0"}}).batch["name"]
        'batch/0'
        """
        return self.data.get("batch")

    @property
    def rng(self) -> dict:
        """The ``rng`` section: the generators' states by device (`nanbisect.replay.rng`).

        >>> Manifest({"rng": {"cpu": "rng/cpu"}}).rng, Manifest({}).rng
        ({'cpu': 'rng/cpu'}, {})
        """
        return _section(self.data, "rng")

    @property
    def history(self) -> Any:
        """The ``history`` section as written, None when absent (untrusted: checked by
        `nanbisect.history.parse`).

        >>> Manifest({}).history is None
        True
        """
        return self.data.get("history")

    @property
    def torch_threads(self) -> int | None:
        """``environment.torch_threads``: the capture's intra-op thread count, None when absent.

        >>> Manifest({"environment": {"torch_threads": 8}}).torch_threads
        8
        >>> Manifest({}).torch_threads is None
        True
        """
        value = self.environment.get("torch_threads")
        return value if isinstance(value, int) else None

    # -- the captured code -------------------------------------------------------------------
    @property
    def code(self) -> dict:
        """The ``code`` section: the captured sources' hashes and the stored copies
        (`nanbisect.bundle.codestore`); {} when absent."""
        return _section(self.data, "code")

    @property
    def code_root(self) -> str | None:
        """``code.root``: the directory the stored copies under ``code/`` were taken from.

        >>> Manifest({"code": {"root": "/home/me/repo"}}).code_root, Manifest({}).code_root
        ('/home/me/repo', None)
        """
        value = self.code.get("root")
        return value if isinstance(value, str) else None

    @property
    def sources(self) -> dict[str, str]:
        """``code.sources``: each captured user source file -> its sha256; {} when absent.

        >>> Manifest({"code": {"sources": {"/r/t.py": "ab" * 32}}}).sources["/r/t.py"][:4]
        'abab'
        """
        value = self.code.get("sources")
        return value if isinstance(value, dict) else {}

    @property
    def entry_file(self) -> str | None:
        """The entry file as captured: ``code.entry_file``, else the top-level ``entry_file``.

        >>> Manifest({"entry_file": "/r/t.py"}).entry_file
        '/r/t.py'
        >>> Manifest({"code": {"entry_file": "/s/t.py"}, "entry_file": "/r/t.py"}).entry_file
        '/s/t.py'
        """
        return self.code_entry_file or self.capture_entry_file

    # -- what a replay finds its entry and step shape by -------------------------------------
    @property
    def entry_target(self) -> str:
        """The entry's file or module: its text before the last ``:`` ('' when absent).

        >>> Manifest({"entry": "t.py:task"}).entry_target, Manifest({}).entry_target
        ('t.py', '')
        """
        return str(self.data.get("entry", "")).rpartition(":")[0]

    @property
    def entry_function(self) -> str:
        """The entry's function: its text after the last ``:`` ('' when absent).

        >>> Manifest({"entry": "pkg.mod:task"}).entry_function, Manifest({}).entry_function
        ('task', '')
        """
        return str(self.data.get("entry", "")).rpartition(":")[2]

    @property
    def capture_entry_file(self) -> str | None:
        """The top-level ``entry_file``: where the capturing process found its entry file (the
        code section's is `code_entry_file`; `entry_file` prefers that one). None when absent.

        >>> m = Manifest({"entry_file": "/r/t.py", "code": {"entry_file": "/s/t.py"}})
        >>> m.capture_entry_file, m.code_entry_file, m.entry_file
        ('/r/t.py', '/s/t.py', '/s/t.py')
        """
        return self.data.get("entry_file")

    @property
    def entry_file_from_bundle(self) -> str | None:
        """``entry_file_from_bundle``: the entry file's path relative to the bundle directory
        (checked by the schema: a relative ``.py`` path), None when absent.

        >>> Manifest({"entry_file_from_bundle": "../t.py"}).entry_file_from_bundle
        '../t.py'
        """
        return self.data.get("entry_file_from_bundle")

    @property
    def code_entry_file(self) -> str | None:
        """``code.entry_file``: the entry file among the captured sources, None when absent.

        >>> Manifest({}).code_entry_file is None
        True
        """
        return self.code.get("entry_file")

    @property
    def code_files(self) -> dict[str, dict]:
        """``code.files``: each stored source -> ``{path: 'code/...', sha256, bytes}``
        (`nanbisect.bundle.codestore`); {} when absent.

        >>> Manifest({"code": {"files": {"/r/t.py": {"path": "code/t.py"}}}}).code_files["/r/t.py"]
        {'path': 'code/t.py'}
        """
        value = self.code.get("files")
        return value if isinstance(value, dict) else {}

    @property
    def code_left_out(self) -> dict[str, str]:
        """``code.left_out``: each source the capture did not store -> why; {} when absent.

        >>> Manifest({"code": {"left_out": {"/r/big.py": "over the cap"}}}).code_left_out
        {'/r/big.py': 'over the cap'}
        """
        value = self.code.get("left_out")
        return value if isinstance(value, dict) else {}

    @property
    def grad_scaler(self) -> dict | None:
        """The ``grad_scaler`` section: the GradScaler's ``state_dict()`` ({} for a disabled
        scaler), None when the capture had none.

        >>> Manifest({"grad_scaler": {}}).grad_scaler, Manifest({}).grad_scaler
        ({}, None)
        """
        value = self.data.get("grad_scaler")
        return value if isinstance(value, dict) else None

    @property
    def compiled(self) -> dict | None:
        """``task.compiled``: the capture's ``torch.compile`` ({backend, mode, options}), None
        for an eager capture.

        >>> Manifest({"task": {"compiled": {"backend": "inductor"}}}).compiled["backend"]
        'inductor'
        >>> Manifest({"task": {"compiled": None}}).compiled is None
        True
        """
        return self.task.get("compiled") or None

    @property
    def scaler_skips(self) -> int:
        """``observed.scaler_skips``: the steps the GradScaler skipped in a row before the
        capture (a stall's bundle), 0 when absent.

        >>> Manifest({"observed": {"scaler_skips": 3}}).scaler_skips, Manifest({}).scaler_skips
        (3, 0)
        """
        return (self.observed or {}).get("scaler_skips") or 0

    @property
    def lookback_groups(self) -> Any:
        """``lookback_groups``: a lookback step's optimizer hyper-parameters, encoded (set on the
        step's view by `nanbisect.bundle.lookback.BundleView.with_step`); None otherwise.

        >>> Manifest({}).lookback_groups is None
        True
        """
        return self.data.get("lookback_groups")

    @property
    def ranks(self) -> list[int]:
        """The ranks whose parts a multi-rank top holds (its ``ranks``), sorted; [] for one
        process's bundle."""
        value = self.data.get("ranks")
        return sorted(int(r) for r in value) if isinstance(value, dict) else []

    @property
    def part_dirs(self) -> dict[int, str]:
        """A multi-rank top's parts: each rank whose part it holds -> that part's directory,
        relative to the top (``ranks[R].dir``); {} for one process's bundle.

        >>> Manifest({"ranks": {"1": {"dir": "rank1"}, "0": {"dir": "rank0"}}}).part_dirs
        {0: 'rank0', 1: 'rank1'}
        """
        value = self.data.get("ranks")
        if not isinstance(value, dict):
            return {}
        return {int(r): info["dir"] for r, info in sorted(value.items(), key=lambda kv: int(kv[0]))
                if isinstance(info, dict) and isinstance(info.get("dir"), str)}

    @property
    def part_observed(self) -> dict[str, dict | None]:
        """A multi-rank top's parts: each rank (as the manifest keys it, a string) -> what its
        Guard saw fail (``ranks[R].observed``; None: nothing recorded), in the manifest's order.

        >>> Manifest({"ranks": {"0": {"observed": {"loss": "nan"}}, "1": {}}}).part_observed
        {'0': {'loss': 'nan'}, '1': None}
        """
        value = self.data.get("ranks")
        if not isinstance(value, dict):
            return {}
        return {r: (info.get("observed") if isinstance(info, dict) else None)
                for r, info in value.items()}

    @property
    def backend(self) -> str | None:
        """A multi-rank top's process-group backend as captured (``gloo``, ``nccl``); None when
        absent."""
        value = self.data.get("backend")
        return value if isinstance(value, str) else None

    @property
    def replicas(self) -> dict | None:
        """A multi-rank top's ``replicas`` section (data-parallel copies compared at capture:
        ``out_of_sync``); None when absent."""
        value = self.data.get("replicas")
        return value if isinstance(value, dict) else None

    @property
    def dtypes(self) -> list[str]:
        """The floating dtypes the capture's state holds, by name (``dtypes``; [] when absent)."""
        return [d for d in self.data.get("dtypes") or [] if isinstance(d, str)]

    @property
    def lookback(self) -> dict | None:
        """The ``lookback`` section (the steps recorded before the failing one: a remedy's
        earlier batch, ``--steps``), as written; None when the capture kept none."""
        return self.data.get("lookback")

    @property
    def collectives(self) -> dict | None:
        """One rank's recorded collectives (the tape `nanbisect.bundle.tape.parse` reads), as
        written; None when the part records none (captured with ``capture``, or by an older
        nanbisect)."""
        return self.data.get("collectives")

