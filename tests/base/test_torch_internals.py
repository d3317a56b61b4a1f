"""nanbisect.util.torch_internals: the one room for torch's private APIs and its observer
dispatch mode."""
from __future__ import annotations

import sys

import torch

from nanbisect.util import torch_internals as ti

# The rule that keeps private torch names in this one room is read from the AST over every
# module: tests/project/test_rules.py (`helpers.rules.foreign_private`).


def test_the_version_check_says_what_needs_a_newer_torch_in_one_line():
    assert ti.check_torch_version() is None        # the installed torch is one checked on
    old = ti.check_torch_version(version="2.4.1")
    assert old is not None and "\n" not in old and "2.4.1" in old and "upgrade torch" in old
    assert ti.torch_version("2.13.0+cpu") == (2, 13) >= ti.FLOOR
    for feature in ti.FEATURES:
        assert ti.check_torch_version(feature) is None


def test_an_older_torch_is_said_where_it_is_used(monkeypatch, tmp_path):
    """The Guard warns in one line; replaying ranks alone (the fake process group) and the
    compiler bisection refuse in one line, before starting anything."""
    import pytest

    from nanbisect import Guard, Task
    from nanbisect.compiler.launch import bisect_compiled
    from nanbisect.errors import BadInput
    from nanbisect.multirank.launcher import launch_alone

    monkeypatch.setattr(torch, "__version__", "2.4.1")
    model = torch.nn.Linear(2, 1)
    task = Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                loss_fn=lambda m, b: m(b).sum())
    with pytest.warns(UserWarning, match=r"Guard: nanbisect is checked on torch .*2\.4\.1"):
        Guard(task, entry=f"{__file__}:_Log", out=tmp_path / "g")
    with pytest.raises(BadInput, match="2.4.1 is older.*without --ranks"):
        launch_alone(None, [0], "cpu", None, tmp_path / "p", 5.0)
    found = bisect_compiled(tmp_path, None, "cpu", eager="finite", compiled="nan",
                            phase="forward", backend="inductor")
    assert "could not start" in found.detail and "2.4.1" in found.detail
    assert not (tmp_path / "p").exists()


class _Log(ti.ObserverMode):
    """Every hook call, in order."""

    def __init__(self, skip_before: str | None = None) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.skip_before = skip_before

    def wants(self, func) -> bool:
        self.log.append(("wants", str(func)))
        return super().wants(func)

    def before(self, call):
        self.log.append(("before", call.name))
        return call.name != self.skip_before

    def after(self, call, out):
        self.log.append(("after", call.name))


def test_the_observer_calls_its_hooks_in_order_and_skips_metadata_ops():
    x = torch.ones(2, 3)
    with _Log() as m:
        x.size()
        x.sqrt()
    sqrt = [e for e in m.log if e[1] == "aten.sqrt.default"]
    assert sqrt == [("wants", "aten.sqrt.default"), ("before", "aten.sqrt.default"),
                    ("after", "aten.sqrt.default")]
    assert all(kind == "wants" for kind, op in m.log if op in map(str, ti.METADATA_OPS))


def test_before_false_runs_the_op_plainly_without_after():
    with _Log(skip_before="aten.exp.default") as m:
        y = torch.zeros(2).exp()
    assert y.tolist() == [1.0, 1.0]
    assert ("after", "aten.exp.default") not in m.log


def test_run_replaces_what_the_op_computes():
    class Double(ti.ObserverMode):
        def run(self, call):
            out = call()
            return out * 2 if call.name == "aten.exp.default" else out

    with Double():
        y = torch.zeros(2).exp()
    assert y.tolist() == [2.0, 2.0]


def test_an_op_call_flattens_its_arguments_once(monkeypatch):
    calls = []
    real = ti.tree_leaves
    monkeypatch.setattr(ti, "tree_leaves", lambda t: calls.append(1) or real(t))
    call = ti.OpCall(torch.ops.aten.cat.default, ([torch.ones(1), torch.ones(2)],), {"dim": 0})
    assert call.leaves() is call.leaves()
    assert len(call.tensors()) == 2 and len(calls) == 1
    assert call().shape == (3,)


def test_a_hook_finds_the_frame_that_dispatched_the_op():
    class Where(ti.ObserverMode):
        frame = None

        def before(self, call):
            if call.name == "aten.neg.default":
                Where.frame = ti.dispatch_caller()
            return True

    def issuer():
        with Where():
            torch.ones(1).neg()
    issuer()
    names = []
    f = Where.frame
    while f is not None:
        names.append(f.f_code.co_name)
        f = f.f_back
    assert "issuer" in names and "before" not in names and "__torch_dispatch__" not in names


def test_ddp_origin_outside_ddp_is_none_and_without_frames_a_bucket():
    assert ti.ddp_origin(None) == "bucket"          # DDP's reducer on a device thread
    assert ti.ddp_origin(sys._getframe()) is None


def test_schema_helpers_and_the_autograd_node():
    assert ti.written_positions(torch.ops.aten.add_.Tensor, 2) == [0]
    assert ti.schema_name(torch.ops.aten.add_.Tensor) == "aten::add_"
    assert ti.current_autograd_node() is None
    seen = []
    x = torch.ones(2, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            node = ti.current_autograd_node()
            seen.append((ti.is_custom_function_node(node), ti.node_sequence_nr(node) >= 0))
            return g * 2
    Probe.apply(x).sum().backward()
    assert seen == [(True, True)]


def test_storage_refs_tell_one_storage_from_another():
    a, b = torch.ones(4), torch.ones(4)
    ref = ti.storage_ref(a.untyped_storage())
    assert not ref.expired()
    assert ti.same_storage(ref, a.untyped_storage())
    assert not ti.same_storage(ref, b.untyped_storage())


def test_the_compiler_helpers():
    assert ti.op_of("<OpOverload(op='aten.mul', overload='Tensor')>") == "aten.mul.Tensor"
    assert ti.compiled_original(torch.nn.Linear(1, 1)) is None


def test_pytree_round_trip():
    tree = {"a": [1, (2, 3)], "b": 4}
    leaves, spec = ti.tree_flatten(tree)
    assert leaves == ti.tree_leaves(tree) == [1, 2, 3, 4]
    assert ti.tree_unflatten(leaves, spec) == tree
    assert ti.tree_map(lambda v: v * 10, tree) == {"a": [10, (20, 30)], "b": 40}
