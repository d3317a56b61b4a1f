"""`culprit.likely_cause` (issue 38): each sentence from the evidence that backs it, and silence
where the evidence is not there. In process, on made-up culprits and caught inputs (the runs
that produce them end to end are in tests/locate/test_birth.py)."""
from __future__ import annotations

import torch

from nanbisect.locate.cause import likely_cause
from nanbisect.records import Caught, Culprit, Node, OpFinding, OpRef, OpSite

INF, NAN = float("inf"), float("nan")


def culprit(op, phase="forward", dtypes=("float32",), node=None) -> Culprit:
    return Culprit(phase, "m", 0, list(dtypes), [[2]], None, op=op, op_index=3,
                   node=Node(node) if node else None)


def caught(op, *args) -> Caught:
    return Caught(op, list(args), {}, [], {}, None)


def finding(op, origin: str | None = None) -> OpFinding:
    return OpFinding(OpSite(op, "forward", 0), 3, "m", 0, ["float32"], [[2]],
                     inf_origin=OpRef(origin, 1, "forward", "m", 0) if origin else None)


def test_adam_eps_of_int_zero_is_named():
    p = torch.nn.Parameter(torch.zeros(2))
    for eps in (0, 0.0, 1e-45):
        opt = torch.optim.Adam([p], eps=eps)
        c = culprit("aten.addcdiv_.default", "optimizer")
        assert likely_cause(c, None, None, opt).startswith(f"Adam's eps ({float(eps):g}) is too "
                                                           "small for float32")
    ok = torch.optim.Adam([p], eps=1e-8)
    assert likely_cause(culprit("aten.addcdiv_.default", "optimizer"), None, None, ok) is None


def test_backward_at_zero_needs_its_node_a_zero_and_no_inf_coming_in():
    c = culprit("aten.div.Tensor", "backward", node="SqrtBackward0")
    zero = torch.tensor([0.0, 1.0])
    assert likely_cause(c, caught(c.op, torch.ones(2), zero), None).startswith(
        "the backward of sqrt at 0: its derivative is infinite there")
    assert likely_cause(c, caught(c.op, torch.ones(2), torch.ones(2)), None) is None   # no 0
    # an inf that came in explains it, not the derivative at 0
    assert likely_cause(c, caught(c.op, torch.ones(2), zero),
                        finding(c.op, "aten.masked_fill.Scalar")) is None
    # abs's slope is finite at 0: never named
    a = culprit("aten.mul.Tensor", "backward", node="AbsBackward0")
    assert likely_cause(a, caught(a.op, torch.ones(2), zero), None) is None


def test_log_of_a_negative_is_nan_and_log_of_its_edge_is_minus_inf():
    c = culprit("aten.log.default")
    assert likely_cause(c, caught(c.op, torch.tensor([-1.0, 2.0])), None) == \
        "log of a number below 0: NaN"
    assert likely_cause(c, caught(c.op, torch.tensor([0.0, 2.0])), None) == "log of 0: -inf"
    p = culprit("aten.log1p.default")
    assert likely_cause(p, caught(p.op, torch.tensor([0.0, 2.0])), None) is None   # log1p(0) = 0
    assert likely_cause(p, caught(p.op, torch.tensor([-1.0])), None) == "log of -1: -inf"


def test_division_of_zero_by_zero_and_its_words_by_phase():
    c = culprit("aten.div.Tensor")
    z = torch.zeros(2)
    assert likely_cause(c, caught(c.op, z, z), None).startswith("0/0: a division of 0 by 0, as "
                                                                "a mean over an empty selection")
    o = culprit("aten.div.Tensor", "optimizer")
    assert likely_cause(o, caught(o.op, z, z), None) == "0/0: the update divides 0 by 0"
    assert likely_cause(c, caught(c.op, z, torch.ones(2)), None) is None     # 0/1
    m = culprit("aten.mul.Tensor")
    assert likely_cause(m, caught(m.op, z, z), None) is None                 # 0 * 0


def test_a_float16_overflow_needs_an_origin_that_can_overflow():
    c = culprit("aten.sub.Tensor", dtypes=("float16", "float16"))
    x = torch.tensor([INF, 1.0], dtype=torch.float16)
    assert likely_cause(c, caught(c.op, x, x), finding(c.op, "aten.exp.default")).startswith(
        "a float16 overflow in aten.exp.default: a value above 65504")
    for origin in ("aten.div.Tensor", "aten.masked_fill.Scalar", "aten.where.self"):
        assert likely_cause(c, caught(c.op, x, x), finding(c.op, origin)) is None, origin
    f32 = culprit("aten.sub.Tensor")
    assert likely_cause(f32, caught(f32.op, x.float(), x.float()),
                        finding(f32.op, "aten.exp.default")) is None


def test_a_softmax_row_must_be_entirely_minus_inf():
    c = culprit("aten._softmax.default")
    row = torch.tensor([[-INF, -INF], [0.0, -INF]])
    assert likely_cause(c, caught(c.op, row, -1, False), None).startswith(
        "a softmax (or logsumexp) over a row that is entirely -inf")
    partly = torch.tensor([[0.0, -INF], [0.0, -INF]])
    assert likely_cause(c, caught(c.op, partly, -1, False),
                        finding(c.op, "aten.masked_fill.Scalar")) is None


def test_silent_without_evidence():
    assert likely_cause(culprit("aten.sqrt.default"), caught("aten.sqrt.default",
                                                             torch.tensor([-1.0])), None) is None
    assert likely_cause(culprit("aten.sqrt.default"), None, None) is None
    assert likely_cause(culprit("aten.mm.default"), caught("aten.mm.default",
                                                           torch.tensor([[NAN]]),
                                                           torch.ones(1, 1)), None) is None
