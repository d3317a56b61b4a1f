"""One op run on the reference's kernel (`OnReference`): the ``kernel`` remedy of a culprit that
is wrong on the target given the same inputs (classification ``device``).

The op at one site (op, phase, occurrence, as `nanbisect.locate` names it) gets copies of its
inputs on the reference device (in the reference's dtype when the reference is upcast,
``cpu:float64``), runs there (its kernel, or its registered reference implementation when the
reference has no kernel for it: a device-only fused op), and its results come back to the
target's device in the dtypes the op gives at the original ones; an argument it writes gets the
result. Everything else stays on the target. A step that is finite then says the device's kernel
is what fails, and that the step passes with that one kernel replaced.
"""
from __future__ import annotations

import torch

from nanbisect.records import OpSite
from nanbisect.reference import kernels as registry
from nanbisect.reference.opcheck import RANDOM_OR_UNINITIALISED, resolve
from nanbisect.remedies.upcast import AtSite, widened
from nanbisect.util import torch_internals as ti


def movable(op: str) -> str | None:
    """None when op ``op`` (``ns.name.overload``) can run on another device and come back; else
    why not: a view of its inputs would come back a copy (writes through it lost), a random op
    would draw from the other device's generator.

    >>> movable("aten.mm.default"), movable("aten.t.default")
    (None, 'it returns a view of its inputs, which would come back a copy')
    """
    try:
        func = resolve(op)
    except (AttributeError, ValueError, RuntimeError):
        return "it cannot be found by its name"
    if any(r.alias_info is not None for r in ti.schema_returns(func)):
        return "it returns a view of its inputs, which would come back a copy"
    if op.split(".")[1] in RANDOM_OR_UNINITIALISED:
        return "it is a random op: elsewhere it would draw from another generator"
    return None


class OnReference(AtSite):
    """Run the op at ``site`` on ``device`` (in ``dtype``, when given); set ``.phase`` as the
    step moves on.

    >>> mode = OnReference(OpSite("aten.exp.default", "forward", 1), torch.device("cpu"),
    ...                    torch.float64)
    >>> x = torch.tensor([100.0])
    >>> with mode:
    ...     a, b = x.exp(), (x - 11).exp()    # the second on the CPU in float64, back in float32
    >>> mode.hit, b.dtype, bool(torch.isinf(a)), bool(torch.isinf(b))
    (True, torch.float32, True, True)
    """

    def __init__(self, site: OpSite, device: torch.device, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__(site)
        self.device, self.dtype = device, dtype

    def run(self, call: ti.OpCall):
        def kernel(*args, **kwargs):     # no kernel on the reference: its registered one
            return registry.kernel_or_registered(call.func, call.name, args, kwargs)[0]
        return widened(call.func, call.args, call.kwargs, self.dtype, self.device, kernel)
