"""The command line's first stage: the arguments and paths a command was given, checked before
anything heavy is imported (torch takes a second or more; a wrong path must not wait for it).

Guarantees: imports only the standard library and nanbisect modules that do the same (no torch,
numpy, safetensors, jinja2, joblib, rich); every refusal is the `BadInput` the library itself
would raise later for the same value (the same function where one exists: `bundle.where`,
`util.spec`, `report.out`), so a message does not depend on which stage caught it.
Not checked here: what needs the bundle's contents or torch (the entry resolving, a device this
machine lacks, `--ranks` against the bundle's world size, `--steps` against its lookback): the
library checks those, still before it writes anything.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from nanbisect.bundle.where import check_bundle_dir
from nanbisect.errors import BadInput
from nanbisect.triage.backends import check_backend
from nanbisect.util.spec import NONE, check_device, check_ranks, split_entry


def _device(spec: str | None, none_ok: bool = False) -> None:
    if spec is not None and not (none_ok and spec == NONE):
        check_device(spec)


def _dirs(dirs: list[Path], what: str, fix: str) -> None:
    for d in dirs:
        if not d.exists():
            raise BadInput(f"{what}: '{d}' does not exist; {fix}")
        if not d.is_dir():
            raise BadInput(f"{what}: '{d}' is a file, not a directory; {fix}")


def run(a: SimpleNamespace) -> None:
    if a.bundle is not None and a.ckpt is not None and a.bundle != a.ckpt:
        raise BadInput(f"run: two bundles given ('{a.bundle}' and --ckpt '{a.ckpt}'); pass one")
    path = a.bundle if a.bundle is not None else a.ckpt
    if path is None:
        raise BadInput("run: no bundle given; pass it as `nanbisect run BUNDLE` (or --ckpt "
                       "BUNDLE)")
    check_bundle_dir(path)
    _device(a.target)
    _device(a.reference, none_ok=True)
    if a.entry is not None:
        split_entry(a.entry)
    if a.inject is not None:
        target, sep, func = a.inject.rpartition(":")
        if not sep or not target or not func.isidentifier():
            raise BadInput(f"--inject '{a.inject}' is not of the form FILE.py:FUNC; name a "
                           "function that returns a context manager")
    if a.ranks is not None:
        check_ranks(a.ranks)
    if a.out is not None:       # the default, BUNDLE/nanbisect-report, is checked by `run`
        from nanbisect.report.out import check_out    # (hashlib, json: only when needed)

        check_out(a.out, path)


def inspect(a: SimpleNamespace) -> None:
    check_bundle_dir(a.bundle, manifest=False)   # a folder of bundles is listed


def triage(a: SimpleNamespace) -> None:
    _dirs(a.dirs, "triage", "pass directories holding bundles")
    if a.out.exists() and not a.out.is_dir():
        raise BadInput(f"triage: --out '{a.out}' is a file; pass a directory for triage.json, "
                       "triage.md and the cache")
    if a.known is not None and not a.known.is_file():   # the words of triage.load_known's
        why = "Is a directory" if a.known.is_dir() else "No such file or directory"
        raise BadInput(f"--known '{a.known}': {why}; pass a triage.json or a text file")
    check_backend(a.backend, a.scheduler, a.address)
    _device(a.target)


def clean(a: SimpleNamespace) -> None:
    for d in a.dirs:
        if not d.is_dir():
            raise BadInput(f"clean: '{d}' is not a directory; pass directories that hold "
                           "bundles")


def selftest(a: SimpleNamespace) -> None:
    _device(a.device)


def pack(a: SimpleNamespace) -> None:
    """pack and unpack check their own paths before importing torch (`nanbisect.bundle.pack`
    imports it only to describe the environment)."""


unpack = pack
