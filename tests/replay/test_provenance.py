"""OpRecorder + provenance on hand-written op sequences: values, views, in-place, traps."""
from __future__ import annotations

import pytest
import torch

from nanbisect.replay.recorder import OpRecorder
from nanbisect.locate.provenance import culprit_root, inf_origin


def record(fn):
    """Run ``fn`` under a forward-phase recorder; return (table, its result marked 'out')."""
    rec = OpRecorder(None, phases={"forward"})
    with rec:
        out = fn()
        rec.mark("out", out)
    table, marks = rec.read()
    return table, marks


def root_op(fn, kind="nan"):
    table, marks = record(fn)
    r = culprit_root(table, [marks["out"]], kind)
    return (r.op.op if r else None), table, r


def test_first_nan_producer_on_the_path():
    x = torch.tensor([-1.0, 4.0])
    op, _, _ = root_op(lambda: (torch.sqrt(x) * 2).sum())
    assert op == "aten.sqrt.default"


def test_masked_fill_removes_nan_so_div_is_not_blamed():
    """norm-backward style: 0/0 then masked_fill_ away; a later log of a negative is the root."""
    z = torch.tensor([0.0, 1.0])

    def f():
        q = z / z                          # NaN at 0: benign
        q.masked_fill_(z == 0, 0.0)        # ...and masked in place
        return torch.log(q - 2.0).sum()    # the real NaN
    op, _, _ = root_op(f)
    assert op == "aten.log.default"


def test_nan_that_never_reaches_the_output_is_ignored():
    x = torch.tensor([-1.0, 1.0])

    def f():
        dead = torch.sqrt(x)               # NaN, but unused
        del dead
        return torch.sqrt(x - 5.0).sum()
    op, table, r = root_op(f)
    assert op == "aten.sqrt.default"
    assert r.op.pos > 0                    # the second sqrt, not the first


def test_views_are_the_same_value():
    x = torch.tensor([[-1.0, 2.0]])

    def f():
        s = torch.sqrt(x)                  # root
        return s.view(-1).t().sum()
    op, _, _ = root_op(f)
    assert op == "aten.sqrt.default"


def test_in_place_on_a_view_reaches_the_base():
    base = torch.ones(4)

    def f():
        b = base.clone()
        b[:2].mul_(float("nan"))           # NaN written through a view (scalar NaN: a root)
        return b.sum()
    op, _, _ = root_op(f)
    assert op == "aten.mul_.Tensor" or op == "aten.mul_.Scalar"


def test_minus_inf_mask_is_legitimate_and_inf_origin_found():
    scores = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[False, True, True]])

    def f():
        s = scores.masked_fill(mask, float("-inf"))   # legitimate -inf
        p = torch.softmax(s, -1)                       # finite
        big = torch.exp(p * 1000.0)                    # overflow: +inf
        return (big - big).sum()                       # inf - inf = NaN
    op, table, r = root_op(f)
    assert op == "aten.sub.Tensor"
    o = inf_origin(table, r)
    assert o is not None and o.op.op == "aten.exp.default"


def test_foreach_lists_pair_elementwise():
    a = [torch.ones(2), torch.ones(3)]
    b = [torch.ones(2), torch.tensor([1.0, 0.0, 1.0])]

    def f():
        torch._foreach_div_(a, [torch.zeros(2), torch.zeros(3)])   # inf everywhere: no NaN
        torch._foreach_mul_(a, b)                                  # inf * 0 = NaN in a[1] only
        return a[1]
    table, marks = record(f)
    r = culprit_root(table, [marks["out"]], "nan")
    assert r.op.op == "aten._foreach_mul_.List"
    assert r.op.outputs[r.output].elem == 1
    assert table.ops[r.op.pos].outputs[0].flags.nan is False     # a[0] stayed NaN-free


def test_flags_are_read_back_once_and_counts_ops():
    x = torch.randn(3)
    table, _ = record(lambda: (x.exp() + 1).sum())
    assert [o.op for o in table.ops] == ["aten.exp.default", "aten.add.Tensor", "aten.sum.default"]
    assert [o.index for o in table.ops] == [0, 1, 2] and table.total_ops == 3


def test_copy_into_a_slice_keeps_the_rest_of_the_buffer_as_input():
    """copy_ into part of a buffer whose other part holds NaN from sqrt: sqrt is the root."""
    x = torch.tensor([-1.0, 4.0])

    def f():
        buf = torch.zeros(2, 2)
        buf[0].copy_(torch.sqrt(x))        # row 0: NaN from sqrt
        buf[1].copy_(torch.ones(2))        # row 1 overwritten: the NaN in row 0 stays
        return buf.sum()
    op, _, _ = root_op(f)
    assert op == "aten.sqrt.default"


def test_whole_overwrite_does_not_read_its_destination():
    """copy_ over all of a buffer that held NaN (from full): the NaN that reaches the output is
    the log's; the buffer's old NaN was overwritten, never read."""
    y = torch.tensor([-1.0, 2.0])

    def f():
        buf = torch.full((2,), float("nan"))
        buf.copy_(torch.log(y))            # the whole storage
        return buf.sum()
    op, _, _ = root_op(f)
    assert op == "aten.log.default"


def unseen_nan_at_a_freed_address(free) -> torch.Tensor:
    """A NaN buffer made outside the recorded ops (C++ scratch, a collective's internals) at the
    address of a recorded value ``free()`` made and freed; retried until the allocator reuses
    that address (skips the test if it never does)."""
    from torch.utils._python_dispatch import _disable_current_modes

    for _ in range(200):
        addr = free()
        with _disable_current_modes():                           # unseen by the recorder
            unseen = torch.full((4096,), float("nan"))
        if unseen.untyped_storage().data_ptr() == addr:
            return unseen
    pytest.skip("the allocator never reused the address")


def test_memory_allocated_unseen_at_a_dead_values_address_is_not_that_value():
    """A buffer made outside the recorded ops can land at the address of a recorded value that
    has died; it must not inherit that value's history."""
    def free():
        dead = torch.sqrt(torch.full((4096,), -1.0))             # NaN, recorded
        return dead.untyped_storage().data_ptr()                  # and dead on return

    rec = OpRecorder(None, phases={"forward"})
    with rec:
        unseen = unseen_nan_at_a_freed_address(free)
        out = (unseen * 2).sum()
        rec.mark("out", out)
    table, marks = rec.read()
    mul = [o for o in table.ops if o.op == "aten.mul.Tensor"][-1]
    assert mul.inputs[0].producer is None          # an outside value, not the dead sqrt output
    r = culprit_root(table, [marks["out"]], "nan")
    assert r is None or r.op.op != "aten.sqrt.default"


def test_memory_reused_at_the_address_of_a_storage_freed_by_resize_is_not_that_value():
    """FSDP2 frees an unsharded parameter's memory with ``untyped_storage().resize_(0)``: the
    storage lives on, its address is free. A buffer made outside the recorded ops there (gloo's
    reduce-scatter scratch, copied into the output when the caller waits) is not that value."""
    kept = []

    def free():
        param = torch.full((4096,), 2.0) * 1.0                       # clean, recorded
        addr = param.untyped_storage().data_ptr()
        param.untyped_storage().resize_(0)                           # freed, storage alive
        kept.append(param)
        return addr

    rec = OpRecorder(None, phases={"forward"})
    with rec:
        unseen = unseen_nan_at_a_freed_address(free)
        out = torch.empty(4096)
        out.copy_(unseen)
        rec.mark("out", out)
    table, marks = rec.read()
    copy = [o for o in table.ops if o.op == "aten.copy_.default"][-1]
    assert copy.inputs[0].producer is None         # an outside value, not the freed parameter
    assert copy.inputs[0].flags.nan
    assert culprit_root(table, [marks["out"]], "nan") is None   # the NaN came from outside
