"""`nanbisect.util.dynamo.defer_dynamo`: torch's disable-dynamo wrappers call their function
directly while torch._dynamo is not imported, and are torch's own again after the block or from
the first import of torch._dynamo on."""
from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanbisect.util import dynamo


def test_wrappers_call_their_function_until_the_block_ends_or_dynamo_is_imported():
    code = dynamo._wrapper_code()
    assert code is not None, "this torch's _disable_dynamo wrapper changed: see util/dynamo.py"

    class Count(TorchDispatchMode):     # a class of its own: its wrapper has cached nothing
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    wrapper = vars(Count)["__torch_dispatch__"]
    fn = wrapper.__wrapped__
    assert wrapper.__code__ is code and fn in dynamo._wrapped_functions(code)
    with dynamo._deferred([fn]) as watch:
        assert vars(fn)["__dynamo_disable"] is fn       # the wrapper calls fn itself
        x = torch.ones(2)
        with Count():
            x.sqrt()
        assert Count.ops == 1
        assert watch in sys.meta_path
        assert watch.find_spec("torch._dynamo.config") is None and "__dynamo_disable" in vars(fn)
        assert watch.find_spec("torch._dynamo") is None    # the import of torch._dynamo starts
        assert "__dynamo_disable" not in vars(fn)           # torch's own from the next call
    assert watch not in sys.meta_path and "__dynamo_disable" not in vars(fn)
    with dynamo._deferred([fn]):
        pass
    assert "__dynamo_disable" not in vars(fn)               # and at the end of the block


def test_nothing_changes_once_dynamo_is_imported(monkeypatch):
    """(torch._dynamo stands in for itself here: importing it costs seconds)"""
    monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", sys))
    fn = torch.optim.Optimizer.zero_grad.__wrapped__
    cached = vars(fn).get("__dynamo_disable")
    before = list(sys.meta_path)
    with dynamo.defer_dynamo():
        assert sys.meta_path == before and vars(fn).get("__dynamo_disable") is cached
