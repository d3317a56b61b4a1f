"""The rule of birth (issue 38): the culprit is the first op whose output holds a value of the
failing kind that none of its inputs held, in whatever phase; an op that makes an infinity on
purpose (a ``-inf`` mask, ``log(0)``) is the start of the chain (``inf_origin``), never the
culprit of a NaN. Tiny models from tests/tasks/birth.py, captured and replayed in process."""
from __future__ import annotations

import json

import birth
import nanbisect
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.report.page import to_html
from nanbisect.report.prose import terminal, to_markdown

TASKS = TEST_TASKS / "birth.py"


def line_of(text: str) -> int:
    return next(i for i, t in enumerate(TASKS.read_text().splitlines(), 1) if text in t)


def replay(tmp_path, func: str, batch, **opts):
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(birth, func)(), batch, bundle, entry=f"{TASKS}:{func}")
    out = tmp_path / "report"
    report = run_bundle(bundle, RunOptions(run_repro=opts.pop("run_repro", False), **opts), out)
    return report, json.loads((out / "report.json").read_text())


def test_a_fully_masked_bag_is_born_in_logsumexp_backward_not_in_the_mask(tmp_path):
    r, data = replay(tmp_path, "logsumexp_bag", birth.bag_batch(), run_repro=True)
    c = r.culprit
    assert (r.verdict, r.phase, r.kind) == ("culprit", "backward", "nan")
    assert (c.phase, c.module, c.op, c.surfaced) == ("backward", "pool", "aten.sub.Tensor", None)
    assert c.source.endswith(f"birth.py:{line_of('BUG: an all-masked bag')}")
    assert (c.node.name, c.node.forward_op) == ("LogsumexpBackward0", "aten.logsumexp.default")
    assert c.node.forward_source.endswith(f"birth.py:{line_of('BUG: an all-masked bag')}")
    assert data["culprit"]["node"] == {"name": "LogsumexpBackward0",
                                       "forward_op": "aten.logsumexp.default",
                                       "forward_source": c.source}
    o = r.inf_origin
    assert (o.op, o.phase, o.module) == ("aten.masked_fill.Scalar", "forward", "pool")
    assert data["culprit"]["op"] == "aten.sub.Tensor"
    assert c.likely_cause == data["culprit"]["likely_cause"] == (
        "a softmax (or logsumexp) over a row that is entirely -inf (every position masked): "
        "exp(-inf - -inf) is NaN")
    # said where people read it: the summary, report.md, report.html
    term, md, page = terminal(r, tmp_path / "report"), to_markdown(r), to_html(r)
    assert f"  node: LogsumexpBackward0 (created by aten.logsumexp.default at {c.source})" in \
        term.splitlines()
    assert "  likely cause: a softmax (or logsumexp) over a row that is entirely -inf" in term
    assert "| node | `LogsumexpBackward0` (created by `aten.logsumexp.default` at" in md
    assert "**Likely cause:** a softmax (or logsumexp)" in md
    assert "<th>autograd node</th><td><code>LogsumexpBackward0</code>" in page
    assert "<th>likely cause</th><td>a softmax (or logsumexp)" in page
    assert data["inf_origin"]["op"] == "aten.masked_fill.Scalar"
    assert r.repro_result.reproduced and "produces nan from nan-free inputs" in \
        r.repro_result.output


def test_a_nan_that_nan_to_num_removed_in_forward_is_not_the_one_backward_made(tmp_path):
    r, data = replay(tmp_path, "entropy_nan_to_num", birth.entropy_batch())
    c = r.culprit
    assert (r.verdict, r.phase) == ("culprit", "backward")
    assert (c.phase, c.module, c.op, c.surfaced) == (
        "backward", "entropy", "aten.mul.Tensor", None)
    assert c.source.endswith(f"birth.py:{line_of('BUG: 0 * -inf, cleaned')}")
    assert (c.node.name, c.node.forward_op) == ("MulBackward0", "aten.mul.Tensor")
    o = r.inf_origin
    assert (o.op, o.phase, o.module) == ("aten.masked_fill.Scalar", "forward", "entropy")
    assert c.likely_cause.startswith("0 * inf: ") and "aten.masked_fill.Scalar made" in \
        c.likely_cause


def test_a_float16_attention_overflow_is_born_in_the_softmax_from_the_matmuls_inf(tmp_path):
    r, data = replay(tmp_path, "half_attention", birth.attention_batch())
    c = r.culprit
    assert (r.verdict, r.phase) == ("culprit", "forward")
    assert (c.phase, c.module, c.op, c.input_dtypes[0]) == (
        "forward", "attn", "aten._softmax.default", "float16")
    o = r.inf_origin
    assert (o.phase, o.module) == ("forward", "attn") and o.op in (
        "aten.bmm.default", "aten.mm.default", "aten.matmul.default")
    assert c.likely_cause.startswith(f"a float16 overflow in {o.op}: a value above 65504")


def test_a_cross_entropy_with_every_label_ignored_is_0_over_0(tmp_path):
    r, data = replay(tmp_path, "all_ignored_ce", birth.ignored_batch())
    c = r.culprit
    assert (r.verdict, c.phase, c.module, c.op) == (
        "culprit", "forward", "", "aten.nll_loss_forward.default")
    assert c.likely_cause.startswith("0/0: a division of 0 by 0, as a mean over an empty")
    assert r.inf_origin is None


def test_a_micro_batch_of_padding_divides_0_by_its_0_tokens(tmp_path):
    r, data = replay(tmp_path, "token_mean_accumulated", birth.token_batches())
    c = r.culprit
    assert (r.verdict, c.phase, c.op, c.micro_batch) == (
        "culprit", "forward", "aten.div.Tensor", 1)
    assert c.source.endswith(f"birth.py:{line_of('BUG: a micro-batch of padding')}")
    assert c.likely_cause.startswith("0/0: ")


def test_the_node_is_named_when_the_narrow_catch_fails(tmp_path, monkeypatch):
    """A step that does not replay the same way twice leaves no caught inputs (no repro): the
    culprit still names its autograd node, as the op recording saw it, and the forward op
    that made it when forward was recorded too."""
    from nanbisect.chain import Chain

    monkeypatch.setattr(Chain, "catch", lambda self, *args: (None, None))
    r, data = replay(tmp_path, "logsumexp_bag", birth.bag_batch())
    c = r.culprit
    assert (c.phase, c.op, r.repro) == ("backward", "aten.sub.Tensor", None)
    assert (c.node.name, c.node.forward_op, c.node.forward_source) == (
        "LogsumexpBackward0", "aten.logsumexp.default", None)
    assert data["culprit"]["node"]["name"] == "LogsumexpBackward0"
