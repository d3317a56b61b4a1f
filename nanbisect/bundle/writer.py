"""Writing a bundle: every tensor file and the manifest into a hidden staging directory beside
the final path, renamed into place only when all of it is on disk.

Guarantees: a crash never leaves a directory that looks like a bundle; files get the user's umask
(0644 under 022), the tensor files too, which safetensors itself writes 0600; every file's
sha256 and size are in the manifest (the stored copies of the user's code under ``code/`` in
its ``code.files``).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from nanbisect import __version__, devices
from nanbisect.bundle import codestore
from nanbisect.bundle.atomic import place
from nanbisect.bundle.schema import MANIFEST, ROLES, SCHEMA, SUFFIX, safe_name
from nanbisect.bundle.state import Tensors
from nanbisect.util.files import file_sha256 as _sha256
from nanbisect.util.staging import make_staging_dir, staging_path, unmark


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:   # Linux: read it without setting it
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)   # elsewhere: the only way to read it is to set it, and put it back
    os.umask(mask)
    return mask


def umask_mode(path: str | Path) -> None:
    """Give a file the permissions a new file gets under the user's umask (0644 under 022).

    safetensors >= 0.5 writes through a private temporary file, so its files are 0600 whatever the
    umask, which keeps a colleague from replaying a bundle; call this after every ``save_file``.
    """
    os.chmod(path, 0o666 & ~_umask())


def environment() -> dict:
    """Versions that decide whether a replay can be bit-exact, and the machine's hardware and
    library fingerprint (the device seam's `nanbisect.devices.fingerprint`)."""
    import numpy
    import safetensors

    return {"nanbisect": __version__, "torch": torch.__version__,
            "python": platform.python_version(), "numpy": numpy.__version__,
            "safetensors": safetensors.__version__,
            "platform": platform.platform(), "torch_threads": torch.get_num_threads(),
            "hardware": devices.fingerprint()}


# dtypes safetensors has no code for (it stores complex64, not complex128 or complex32)
_UNSTORABLE = (torch.complex128, torch.complex32)


def _storable(role: str, tensors: dict) -> None:
    """A tensor safetensors cannot store: a `ValueError` naming it and the way out, not the
    ``KeyError: torch.complex128`` safetensors raises."""
    for name, t in tensors.items():
        if t.dtype in _UNSTORABLE:
            dtype = str(t.dtype).removeprefix("torch.")
            raise ValueError(f"the {role} tensor '{name}' is {dtype}, which a bundle cannot hold "
                             "yet (safetensors stores complex64, not complex128): keep the "
                             "model's state and batch in complex64 or real tensors")


def write_bundle(path: Path, manifest: dict, tensors: dict[str, Tensors],
                 unique: bool = False, *, staging: Path | None = None,
                 claim: Callable[[], None] | None = None) -> Path:
    """Write ``tensors`` (role -> flat tensor dict) and ``manifest`` atomically to ``path``.

    Every role with tensors gets ``ROLE.safetensors`` (the `ROLES` first, then any other role,
    e.g. a part's ``collectives``, by name); a role with none gets no file. ``staging`` (a new
    directory's path, default ``.NAME.tmp-XXXXXXXX`` beside ``path``) is where it is written
    first; the files the manifest's ``code`` section plans to store (`codestore.plan`) are
    copied under ``code/`` and the section gets their sha256 and sizes; ``claim()`` runs when
    everything is on disk, just before the rename into place, and may refuse it by raising (the
    staging directory is then removed): a rank of a multi-rank bundle claims its place there
    (`nanbisect.guard.parts`).

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
    # its marker: `nanbisect clean` may remove it
    tmp = make_staging_dir(staging_path(path) if staging is None else Path(staging))
    try:
        files = {}
        for role in [*ROLES, *sorted(set(tensors) - set(ROLES))]:
            if not tensors.get(role):
                continue
            name = f"{role}{SUFFIX}"
            if not safe_name(name):
                raise ValueError(f"tensor role {role!r} is not a plain file name")
            _storable(role, tensors[role])
            save_file(tensors[role], str(tmp / name))
            umask_mode(tmp / name)   # NB: safetensors >= 0.5 writes 0600 whatever the umask
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        full = {"schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "environment": environment(), **manifest, "files": files}
        code = manifest.get("code")
        if isinstance(code, dict) and code.get("files"):   # the user's code (`codestore`)
            full["code"] = codestore.store(tmp, code, code.get("sources") or {})
        _fsync_write(tmp / MANIFEST, json.dumps(full, indent=1, allow_nan=False).encode())
        if claim is not None:
            claim()
        # never over an existing path; with ``unique`` a taken name gets the next free NAME-N,
        # so two processes writing the same step both keep their bundle
        unmark(tmp)
        path = place(tmp, path, unique=unique)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
