"""nanbisect: find the first operation that breaks a PyTorch training step.

The public names load on first use (PEP 562), so ``nanbisect --help`` and ``--version`` never
import torch.

>>> import nanbisect
>>> nanbisect.Task.__name__, nanbisect.__version__ == __import__("nanbisect").__version__
('Task', True)

``nanbisect.run`` and ``nanbisect.triage`` are the Python API's functions (`nanbisect.api`),
whatever was imported before: the subpackage ``nanbisect.triage`` is imported as usual (``from
nanbisect.triage import ...``), but importing it never replaces the function on the package.

>>> import nanbisect.triage.summary, nanbisect.pipeline.run
>>> nanbisect.run.__module__, nanbisect.triage.__module__, callable(nanbisect.triage)
('nanbisect.api', 'nanbisect.api', True)
"""
# NB: nothing but importlib, which `python -m` loaded to get here: this runs before
# `nanbisect.__main__` takes the working directory off sys.path (sys is built in)
import importlib
import sys

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {"Task": "nanbisect.task", "capture": "nanbisect.guard", "Guard": "nanbisect.guard",
         "StepWatch": "nanbisect.guard", "Spike": "nanbisect.guard",
         "NonFiniteStep": "nanbisect.errors", "BadInput": "nanbisect.errors",
         "reference_impl": "nanbisect.reference.kernels",
         "run": "nanbisect.api", "triage": "nanbisect.api"}

__all__ = ["Task", "capture", "Guard", "StepWatch", "Spike", "NonFiniteStep", "BadInput",
           "reference_impl", "run", "triage", "__version__"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value     # later lookups do not come back here
        return value
    raise AttributeError(f"module 'nanbisect' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(type(importlib)):
    """This package's module type: the import system binds a subpackage to its parent by
    ``setattr`` (``nanbisect.triage`` once ``nanbisect.triage.find`` is imported); a subpackage
    named as a public function of `_LAZY` is not bound, so the name stays the function."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and getattr(value, "__name__", None) == f"{__name__}.{name}" \
                and isinstance(value, type(importlib)):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
