"""The command line's first stage: the arguments and paths a command was given, checked before
anything heavy is imported (torch takes a second or more; a wrong path must not wait for it).

Guarantees: imports only the standard library and nanbisect modules that do the same (no torch,
numpy, safetensors, jinja2, joblib, rich); every refusal is the `BadInput` the library itself
would raise later for the same value (the same function: `run` and `triage` are the Python
API's `nanbisect.api.check_run` and `check_triage`, which `nanbisect.run` and `nanbisect.triage`
call too; the others `bundle.where`, `util.spec`), so a message does not depend on which stage
caught it.
Not checked here: what needs the bundle's contents or torch (the entry resolving, a device this
machine lacks, `--ranks` against the bundle's world size, `--steps` against its lookback): the
library checks those, still before it writes anything.
"""
from __future__ import annotations

from types import SimpleNamespace

from nanbisect.api import check_run, check_triage
from nanbisect.bundle.where import check_bundle_dir
from nanbisect.errors import BadInput
from nanbisect.util.spec import NONE, check_device


def _device(spec: str | None, none_ok: bool = False) -> None:
    if spec is not None and not (none_ok and spec == NONE):
        check_device(spec)


def run(a: SimpleNamespace) -> None:
    if a.bundle is not None and a.ckpt is not None and a.bundle != a.ckpt:
        raise BadInput(f"run: two bundles given ('{a.bundle}' and --ckpt '{a.ckpt}'); pass one")
    path = a.bundle if a.bundle is not None else a.ckpt
    if path is None:
        raise BadInput("run: no bundle given (neither BUNDLE nor --ckpt); pass it as "
                       "`nanbisect run BUNDLE`")
    check_run(path, target=a.target, reference=a.reference, entry=a.entry, inject=a.inject,
              code=a.code, ranks=a.ranks, out=a.out)


def inspect(a: SimpleNamespace) -> None:
    check_bundle_dir(a.bundle, manifest=False)   # a folder of bundles is listed


def triage(a: SimpleNamespace) -> None:
    check_triage(a.dirs, out=a.out, known=a.known, target=a.target, backend=a.backend,
                 scheduler=a.scheduler, address=a.address)


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
