"""The command line's first stage: the arguments and paths a command was given, checked before
anything heavy is imported (torch takes a second or more; a wrong path must not wait for it).
Each command calls what it needs with its typed parameters: `environment` first (the
``NANBISECT_*`` numbers it reads), then its own check; ``run``'s options become the
`nanbisect.options.RunOptions` the run is made of (`nanbisect.api.run_options`, the same call
``nanbisect.run`` makes), parsed here once.

Guarantees: imports only the standard library and nanbisect modules that do the same (no torch,
numpy, safetensors, jinja2, joblib, rich); every refusal is the `BadInput` the library itself
raises for the same value (the same function: `nanbisect.api.run_options` and
`nanbisect.api.check_triage`, which `nanbisect.run` and `nanbisect.triage` call too; the others
`bundle.where`, `nanbisect.options`), so a message does not depend on which stage caught it.
Not checked here: what needs the bundle's contents or torch (the entry resolving, a device this
machine lacks, `--ranks` against the bundle's world size, `--steps` against its lookback): the
library checks those, still before it writes anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from nanbisect.bundle.where import check_bundle_dir
from nanbisect.errors import BadInput
from nanbisect.options import device_option
from nanbisect.util.numbers import check_environment
from nanbisect.util.spec import DeviceSpec


def environment(command: str, overridden: Iterable[str] = ()) -> None:
    """The ``NANBISECT_*`` numbers ``command`` reads, each parsed now (a variable whose flag is
    among ``overridden``, given on this command line, is not read, so not checked either)."""
    check_environment(command, set(overridden))


def one_bundle(bundle: Path | None, ckpt: Path | None) -> Path:
    """``run``'s bundle: BUNDLE or ``--ckpt`` (the same path when both are given)."""
    if bundle is not None and ckpt is not None and bundle != ckpt:
        raise BadInput(f"run: two bundles given ('{bundle}' and --ckpt '{ckpt}'); pass one")
    path = bundle if bundle is not None else ckpt
    if path is None:
        raise BadInput("run: no bundle given (neither BUNDLE nor --ckpt); pass it as "
                       "`nanbisect run BUNDLE`")
    return path


def inspect(bundle: Path) -> None:
    check_bundle_dir(bundle, manifest=False)   # a folder of bundles is listed


def clean(dirs: list[Path]) -> None:
    for d in dirs:
        if not d.is_dir():
            raise BadInput(f"clean: '{d}' is not a directory; pass directories that hold "
                           "bundles")


def selftest(device: str) -> DeviceSpec:
    """``selftest --device`` as a value (its form; whether this machine has it is asked when
    the self-test resolves it)."""
    return device_option(device)
