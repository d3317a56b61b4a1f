"""The bundle on disk: a directory with ``manifest.json`` and ``.safetensors`` files.

Guarantees: a bundle is written into a hidden temporary directory beside its final path and renamed
into place only when every file and the manifest are on disk, so a crash never leaves a directory
that looks valid. Every file's sha256 is in the manifest and checked on load. Reading a bundle
parses JSON and safetensors only: it never unpickles and never imports user code.
Not guaranteed: protection against a deliberately forged manifest whose checksums were recomputed.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nanbisect import __version__
from nanbisect.errors import BadInput
from nanbisect.bundle.atomic import place
from nanbisect.bundle.state import Tensors

SCHEMA = "nanbisect.bundle/1"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# Tensor files by role; a role with no tensors gets no file.
ROLES = ("model", "optimizer", "batch", "rng")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def environment() -> dict:
    """Versions that decide whether a replay can be bit-exact."""
    import numpy
    import safetensors

    return {"nanbisect": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "numpy": numpy.__version__, "safetensors": safetensors.__version__,
            "platform": platform.platform(), "torch_threads": torch.get_num_threads()}


def write_bundle(path: Path, manifest: dict, tensors: dict[str, Tensors],
                 unique: bool = False) -> Path:
    """Write ``tensors`` (role -> flat tensor dict) and ``manifest`` atomically to ``path``.

    >>> import tempfile
    >>> path = write_bundle(Path(tempfile.mkdtemp()) / "b", {"entry": "m:f"},
    ...                     {"batch": {"batch": torch.ones(2)}})
    >>> sorted(p.name for p in path.iterdir())
    ['batch.safetensors', 'manifest.json']
    """
    path = Path(path)
    if path.exists() and not unique:
        raise FileExistsError(f"{path} already exists; choose a new bundle path or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        for role in ROLES:
            if not tensors.get(role):
                continue
            name = f"{role}.safetensors"
            save_file(tensors[role], str(tmp / name))
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        full = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "environment": environment(), **manifest, "files": files}
        _fsync_write(tmp / MANIFEST, json.dumps(full, indent=1, allow_nan=False).encode())
        # never over an existing path; with ``unique`` a taken name gets the next free NAME-N,
        # so two processes writing the same step both keep their bundle
        path = place(tmp, path, unique=unique)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


@dataclass(frozen=True)
class Bundle:
    """A bundle whose manifest and checksums have been verified."""

    path: Path
    manifest: dict

    def tensors(self, role: str) -> Tensors:
        name = f"{role}.safetensors"
        if name not in self.manifest["files"]:
            return {}
        try:
            return load_file(str(self.path / name))
        except (SafetensorError, OSError, ValueError) as e:
            raise BadInput(f"bundle '{self.path}': {name} is not a readable safetensors file "
                           f"({e}); re-capture the bundle") from None

    def all_tensors(self) -> Tensors:
        out: Tensors = {}
        for role in ROLES:
            out.update(self.tensors(role))
        return out

    @property
    def world_size(self) -> int:
        return int(self.manifest.get("world_size") or 1)

    @property
    def multi_rank(self) -> bool:
        return self.manifest.get("kind") == "multi-rank"

    def part(self, rank: int) -> "Bundle":
        """The verified part of one rank of a multi-rank bundle."""
        return read_bundle(self.path / self.manifest["ranks"][str(rank)]["dir"])


def read_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Open and verify a bundle directory; raise `BadInput` naming the problem and the fix.

    >>> read_bundle("fixtures/bundles/healthy").manifest["entry"]
    'fixtures/tasks/healthy.py:task'
    """
    p = Path(path)
    if not p.exists():
        raise BadInput(f"bundle '{p}' does not exist; pass the directory written by "
                       "nanbisect.capture or Guard (it holds manifest.json)")
    if not p.is_dir():
        raise BadInput(f"bundle '{p}' is a file, not a directory; pass the bundle directory "
                       "that holds manifest.json")
    mpath = p / MANIFEST
    if not mpath.is_file():
        raise BadInput(f"bundle '{p}' has no manifest.json; it is not a nanbisect bundle or its "
                       "capture did not finish; re-capture it")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"bundle '{p}': manifest.json is not valid JSON ({e.__class__.__name__}: "
                       f"{str(e)[:80]}); re-capture the bundle") from None
    if not isinstance(manifest, dict) or not str(manifest.get("schema", "")).startswith(
            "nanbisect.bundle/"):
        raise BadInput(f"bundle '{p}': manifest.json has no 'nanbisect.bundle/N' schema; it was "
                       "not written by nanbisect; re-capture the bundle")
    try:
        version = int(manifest["schema"].split("/", 1)[1])
    except ValueError:
        raise BadInput(f"bundle '{p}': unreadable schema {manifest['schema']!r}; re-capture the "
                       "bundle") from None
    if version > SCHEMA_VERSION:
        raise BadInput(f"bundle '{p}' uses schema {version}, newer than this nanbisect "
                       f"({__version__}, schema {SCHEMA_VERSION}) reads; upgrade nanbisect")
    if manifest.get("kind") == "multi-rank":
        return _read_multi(p, manifest, verify)
    for key in ("entry", "files", "model", "batch", "rng"):
        if key not in manifest:
            raise BadInput(f"bundle '{p}': manifest.json lacks '{key}'; re-capture the bundle")
    if verify:
        for name, info in manifest["files"].items():
            f = p / name
            if Path(name).name != name or not f.is_file():
                raise BadInput(f"bundle '{p}': file '{name}' listed in the manifest is missing; "
                               "copy the whole bundle directory or re-capture it")
            if _sha256(f) != info.get("sha256"):
                raise BadInput(f"bundle '{p}': {name} does not match its sha256 in the manifest "
                               "(truncated or altered); copy the bundle again or re-capture it")
    return Bundle(p, manifest)


def _read_multi(p: Path, manifest: dict, verify: bool) -> Bundle:
    """A multi-rank bundle: the top manifest names one verified part per rank."""
    ranks = manifest.get("ranks")
    world = manifest.get("world_size")
    if not isinstance(ranks, dict) or not isinstance(world, int) or sorted(ranks) != sorted(
            str(r) for r in range(world)):
        raise BadInput(f"bundle '{p}': the top manifest does not list one part per rank of its "
                       f"world size {world}; re-capture the bundle")
    if verify:
        for r, info in ranks.items():
            m = p / info["dir"] / MANIFEST
            if Path(info["dir"]).name != info["dir"] or not m.is_file():
                raise BadInput(f"bundle '{p}': the part of rank {r} ({info['dir']}) is missing; "
                               "copy the whole bundle directory or re-capture it")
            if _sha256(m) != info.get("manifest_sha256"):
                raise BadInput(f"bundle '{p}': the manifest of rank {r} does not match its "
                               "sha256 in the top manifest; re-capture the bundle")
            read_bundle(p / info["dir"], verify=True)
    return Bundle(p, manifest)
