"""nanbisect: find the first operation that breaks a PyTorch training step.

>>> import nanbisect
>>> guard = nanbisect.Guard(task, entry="train.py:make_task", out="bundles")
"""
__version__ = "0.1.0"

from nanbisect.guard import Guard, StepWatch, capture  # noqa: E402
from nanbisect.errors import BadInput, NonFiniteStep  # noqa: E402
from nanbisect.reference.kernels import reference_impl  # noqa: E402
from nanbisect.task import Task  # noqa: E402

__all__ = ["Task", "capture", "Guard", "StepWatch", "NonFiniteStep", "BadInput", "reference_impl",
           "__version__"]
