"""`nanbisect pack` / `nanbisect unpack`: one archive for a bug ticket, and a safe way to open one.

A pack holds report.md and report.json, the standalone repro, the bundle's manifest(s) and an
environment summary (Python, torch, devices and driver versions, the environment variables that
change numerics or communication). By default it leaves out the model and optimizer state and
stays under `LIMIT` bytes; ``full=True`` adds the whole bundle. Unpacking refuses absolute paths,
``..``, links and anything else that is not a plain file or directory, before writing anything.
"""
from __future__ import annotations

import io
import json
import os
import platform
import re
import tarfile
from pathlib import Path, PurePosixPath

import torch

from nanbisect import __version__
from nanbisect.bundle.format import MANIFEST
from nanbisect.errors import BadInput

LIMIT = 10 * 1024 * 1024
OPTIONAL = ("rng.safetensors", "batch.safetensors")   # kept while the pack stays under LIMIT
ENV_PATTERN = re.compile(r"^(TORCH|CUDA|NCCL|HCCL|ASCEND|OMP|MKL|CUBLAS|CUDNN|PYTORCH|NVIDIA|"
                         r"NANBISECT|XLA|HIP|ROCM)_|^(WORLD_SIZE|RANK|LOCAL_RANK|MASTER_ADDR|"
                         r"MASTER_PORT)$")


def environment_summary() -> dict:
    """What a maintainer asks first: versions, devices, drivers, relevant variables."""
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "nanbisect": __version__,
           "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
           "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") \
                else None
        except Exception:  # noqa: BLE001 - absent on some builds
            env["driver"] = None
    env["variables"] = {k: v for k, v in sorted(os.environ.items()) if ENV_PATTERN.search(k)}
    return env


def _members(src: Path, full: bool) -> list[tuple[Path, str]]:
    """(file, name in archive) pairs for a bundle or a report directory."""
    src = src.resolve()
    if (src / "report.json").is_file():        # a report directory, inside its bundle or not
        report, bundle = src, src.parent if (src.parent / MANIFEST).is_file() else None
    elif (src / MANIFEST).is_file():
        report, bundle = src / "nanbisect-report", src
        if not (report / "report.json").is_file():
            raise BadInput(f"pack: '{src}' has no report yet; run `nanbisect run --ckpt {src}` "
                           "first")
    else:
        raise BadInput(f"pack: '{src}' is neither a bundle nor a report directory; pass the "
                       "directory holding manifest.json or report.json")
    out = [(f, f"report/{f.relative_to(report).as_posix()}") for f in sorted(report.rglob("*"))
           if f.is_file() and not f.is_symlink()]
    if bundle is not None:
        for f in sorted(bundle.rglob("*")):
            rel = f.relative_to(bundle)
            if not f.is_file() or f.is_symlink() or rel.parts[0] == "nanbisect-report":
                continue
            if full or f.name == MANIFEST or f.name in OPTIONAL:
                out.append((f, f"bundle/{rel.as_posix()}"))
    return out


def pack(src: str | Path, dest: str | Path, full: bool = False) -> Path:
    """Write ``dest`` (.tar.gz) for a ticket; refuse to exceed `LIMIT` unless ``full``.

    >>> import tempfile; from nanbisect.pipeline import RunOptions, run_bundle
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = run_bundle("fixtures/bundles/nan_batch", RunOptions(), d / "report")
    >>> pack(d / "report", d / "ticket.tar.gz").name
    'ticket.tar.gz'
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise BadInput(f"pack: '{src}' is not a directory; pass a bundle or report directory")
    members = _members(src, full)
    size = sum(f.stat().st_size for f, _ in members)
    left_out = []
    if not full:
        for f, name in sorted((m for m in members if m[0].name in OPTIONAL),
                              key=lambda m: -m[0].stat().st_size):
            if size <= LIMIT:
                break
            members.remove((f, name))
            size -= f.stat().st_size
            left_out.append(name)
    if not full and size > LIMIT:
        big = max(members, key=lambda m: m[0].stat().st_size)
        raise BadInput(f"pack: {size} bytes exceed the {LIMIT}-byte ticket limit (largest: "
                       f"{big[1]}); pass --full to include everything anyway")
    tmp = dest.with_name(f".{dest.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f, name in members:
            tar.add(str(f), arcname=name, recursive=False)
        for name, obj in (("environment.json", environment_summary()),
                          ("pack.json", {"full": full, "left_out": left_out,
                                         "left_out_always": [] if full else
                                         ["model and optimizer state (use --full)"]})):
            data = json.dumps(obj, indent=1).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, dest)
    return dest


def unpack(archive: str | Path, dest: str | Path) -> Path:
    """Extract a pack made by anyone; refuse it whole if any member could escape ``dest``."""
    archive, dest = Path(archive), Path(dest)
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise BadInput(f"unpack: '{archive}' is not a readable archive ({e}); pass a file "
                       "written by nanbisect pack") from None
    with tar:
        members = tar.getmembers()
        for m in members:
            p = PurePosixPath(m.name)
            if p.is_absolute() or ".." in p.parts or m.name.startswith(("/", "\\")):
                raise BadInput(f"unpack: '{archive}' holds '{m.name}', a path outside the target "
                               "directory; refusing the whole archive")
            if not (m.isfile() or m.isdir()):
                raise BadInput(f"unpack: '{archive}' holds '{m.name}', a link or special file; "
                               "refusing the whole archive")
        dest.mkdir(parents=True, exist_ok=True)
        for m in members:
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as f_in, open(target, "wb") as f_out:
                f_out.write(f_in.read())
    return dest
