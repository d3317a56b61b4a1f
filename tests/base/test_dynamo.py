"""`nanbisect.util.dynamo.defer_dynamo`: torch's disable-dynamo wrappers call their function
directly while torch._dynamo is not imported, and are torch's own again after the block or from
the first import of torch._dynamo on."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import FIXTURES, ROOT
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


def _wrapper_calls(code, run) -> list:
    """The functions under a ``torch._disable_dynamo`` wrapper that ``run()`` called through
    the wrapper (each wrapper call's ``fn``), in order."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(frame.f_locals["fn"])
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_the_remedies_meta_computation_meets_only_deferred_wrappers():
    """The upcast remedy asks a meta kernel for an op's dtypes (`remedies.upcast.widened`):
    torch's Python references run under type-promotion wrappers that are `_disable_dynamo`
    ones, reached only through closures (the reference's outer ``functools.wraps(prim)``
    points ``__wrapped__`` past them). Every wrapper met is deferred: none would import
    torch._dynamo."""
    from nanbisect.remedies.upcast import widened

    code = dynamo._wrapper_code()
    x = torch.tensor([4.0, -1.0], dtype=torch.float16)
    ops = [(torch.ops.aten.sqrt.default, (x,)), (torch.ops.aten.exp.default, (x,)),
           (torch.ops.aten.log.default, (x,)), (torch.ops.aten.div.Tensor, (x, x)),
           (torch.ops.aten.rsqrt.default, (x,))]
    assert any(True for _ in dynamo._under(torch._refs.sqrt, code, set()))   # via a closure
    # this process imported torch._dynamo: the wrappers that ran cached torch's own function;
    # take those out for the test, as in a process that never imported it
    saved = {fn: vars(fn).pop("__dynamo_disable") for fn in set(dynamo._under_wrappers(code))
             if "__dynamo_disable" in vars(fn)}
    try:
        fns = dynamo._wrapped_functions(code)
        with dynamo._deferred(fns):
            calls = _wrapper_calls(code, lambda: [widened(op, args, {}, torch.float32)
                                                  for op, args in ops])
            assert calls, "no _disable_dynamo wrapper met: the test no longer tests anything"
            assert all(vars(fn).get("__dynamo_disable") is fn for fn in calls), [
                fn.__qualname__ for fn in calls if vars(fn).get("__dynamo_disable") is not fn]
        assert all("__dynamo_disable" not in vars(fn) for fn in fns)    # undone at the end
    finally:
        for fn, disabled in saved.items():
            setattr(fn, "__dynamo_disable", disabled)


@pytest.mark.slow
def test_a_run_with_remedies_never_imports_dynamo(tmp_path):
    """A fresh interpreter (the only one where torch._dynamo is not imported yet) replays the
    README's bundle with its remedies, which upcast the culprit op: torch._dynamo stays out
    (about 2 s of CPU that a user's `nanbisect run` no longer pays)."""
    bundle = tmp_path / "b"
    shutil.copytree(FIXTURES / "forward_nan_behind_mask", bundle)
    code = ("import sys\n"
            "from nanbisect.pipeline import RunOptions, run_bundle\n"
            f"r = run_bundle({str(bundle)!r}, RunOptions(run_repro=False),\n"
            f"               {str(tmp_path / 'o')!r})\n"
            "print(r.verdict, r.culprit.op, [x.kind for x in r.remedies][:1])\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["culprit aten.sqrt.default ['precision']", "no dynamo"], (
        p.stdout, p.stderr[-2000:])


def test_an_error_while_patching_switches_the_speed_up_off_and_leaves_nothing(monkeypatch):
    """The speed-up fails soft: a wrapped function that refuses the attribute (here a built-in,
    after one that takes it) undoes what was patched; a scan that raises is caught the same way;
    either way the block runs unpatched and the speed-up stays off for the process."""
    if "torch._dynamo" in sys.modules:
        pytest.skip("torch._dynamo already imported: defer_dynamo does nothing here")

    def plain():
        return 1

    monkeypatch.setattr(dynamo, "_off", [])
    monkeypatch.setattr(dynamo, "_wrapped_functions", lambda code: [plain, len])
    hooks = list(sys.meta_path)
    with dynamo.defer_dynamo():
        assert "__dynamo_disable" not in vars(plain) and sys.meta_path == hooks
    assert len(dynamo._off) == 1 and "AttributeError" in dynamo._off[0]
    # off for the rest of the process: nothing is scanned again
    monkeypatch.setattr(dynamo, "_wrapped_functions",
                        lambda code: (_ for _ in ()).throw(AssertionError("scanned")))
    with dynamo.defer_dynamo():
        pass
    monkeypatch.setattr(dynamo, "_off", [])

    def broken(code):
        raise RuntimeError("a torch whose wrappers moved")

    monkeypatch.setattr(dynamo, "_wrapped_functions", broken)
    with dynamo.defer_dynamo():
        pass
    assert dynamo._off == ["RuntimeError: a torch whose wrappers moved"]
