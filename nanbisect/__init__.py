"""nanbisect: find the first operation that breaks a PyTorch training step.

The public names load on first use (PEP 562), so ``nanbisect --help`` and ``--version`` never
import torch.

>>> import nanbisect
>>> nanbisect.Task.__name__, nanbisect.__version__ == __import__("nanbisect").__version__
('Task', True)

``nanbisect.run`` and ``nanbisect.triage`` are the Python API (`nanbisect.api`), functions
whatever was imported first: nightly triage's package is `nanbisect.nightly`, so no module is
ever bound to either name.

>>> import nanbisect.nightly.summary as summary, nanbisect.pipeline.run
>>> nanbisect.run.__module__, nanbisect.triage.__module__, summary.__name__
('nanbisect.api', 'nanbisect.api', 'nanbisect.nightly.summary')
"""
# NB: nothing but importlib, which `python -m` loaded to get here: this runs before
# `nanbisect.__main__` takes the working directory off sys.path
import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {"Task": "nanbisect.task", "schedule_step": "nanbisect.task", "capture": "nanbisect.guard", "Guard": "nanbisect.guard",
         "StepWatch": "nanbisect.guard", "Spike": "nanbisect.guard",
         "NonFiniteStep": "nanbisect.errors", "BadInput": "nanbisect.errors",
         "reference_impl": "nanbisect.reference.kernels",
         "run": "nanbisect.api", "triage": "nanbisect.api"}
# subpackages reached as attributes before anything imported them
_PACKAGES = {"api": "nanbisect.api"}

__all__ = ["Task", "schedule_step", "capture", "Guard", "StepWatch", "Spike", "NonFiniteStep", "BadInput",
           "reference_impl", "run", "triage", "__version__"]


def __getattr__(name: str) -> object:
    if name in _PACKAGES:   # the module itself, as an import of it binds the name
        value = importlib.import_module(_PACKAGES[name])
        globals()[name] = value
        return value
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value     # later lookups do not come back here
        return value
    raise AttributeError(f"module 'nanbisect' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_PACKAGES))
