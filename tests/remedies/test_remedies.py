"""Remedies (issue 27): once the culprit is found, the step is replayed with targeted changes and
each entry says what the replay gave; ``culprit.samples`` traces the batch rows through the ops.
Tiny models from tests/tasks/remedies.py (and the shipped ``optimizer_adam_eps0``), captured and
replayed in process."""
from __future__ import annotations

import json

import torch

import nanbisect
import remedies as tasks
from helpers import TEST_TASKS, invoke, one_line_exit_2
from nanbisect.locate.rows import RowTracer
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.records import OpSite, Remedy
from nanbisect.remedies.batch import identify
from nanbisect.report.page import to_html
from nanbisect.report.prose import terminal, to_markdown
from nanbisect.nightly.summary import NightState, remedy_kinds, to_markdown as triage_markdown

TASKS = TEST_TASKS / "remedies.py"


def capture(tmp_path, func: str, batch) -> object:
    bundle = tmp_path / "bundle"
    nanbisect.capture(getattr(tasks, func)(), batch, bundle, entry=f"{TASKS}:{func}")
    return bundle


def run(bundle, out, remedies: int = 4):
    """``run_bundle`` with the product's default budget of 4 (conftest.py sets the suite's to 1)
    and no repro run; (report, what it told its progress callback)."""
    passes = []
    report = run_bundle(bundle, RunOptions(run_repro=False, remedies=remedies), out,
                        progress=lambda key, text: passes.append((key, text)))
    return report, passes


def by_kind(report) -> dict[str, list[Remedy]]:
    out: dict[str, list[Remedy]] = {}
    for r in report.remedies:
        out.setdefault(r.kind, []).append(r)
    return out


def test_a_corrupt_row_is_traced_and_the_step_without_it_is_finite(tmp_path):
    """Row 5 of the inputs is far out: only its values reach the sqrt of a negative. The rows
    trace through fc (addmm), mul, rsub to the sqrt: samples == [5]; the step without row 5 is
    finite. The sqrt of a negative is a domain error: computed in float64, as an op or as its
    whole module call, it still fails. Shown first in report.md, the terminal and the page."""
    bundle = capture(tmp_path, "sqrt_rows", tasks.batch(bad=5))
    r, passes = run(bundle, tmp_path / "r")
    c = r.culprit
    assert (c.op, c.module, c.phase, c.samples) == ("aten.sqrt.default", "act", "forward", [5])
    bug = next(i for i, t in enumerate(TASKS.read_text().splitlines(), 1) if "BUG: NaN" in t)
    assert c.source.endswith(f"remedies.py:{bug}")    # the tracer rides along unseen
    k = by_kind(r)
    assert [(p.outcome, p.detail["scope"], p.detail["dtype"]) for p in k["precision"]] == [
        ("still-failing", "op", "float64"), ("still-failing", "module", "float64")]
    (s,) = k["samples"]
    assert (s.outcome, s.change, s.detail["rows"], s.detail["found_by"]) == (
        "finite", "without batch rows [5]", [5], "trace")
    assert s.loss is not None and s.loss > 0
    (row,) = s.detail["identify"]
    assert row["row"] == 5 and row["fields"] == {"id": "sample-0-5"}
    assert len(row["sha256"]) == 16 and int(row["sha256"], 16) >= 0
    # the digest is of the row's values: the same as the captured batch's row 5, not row 4's
    digest = lambda r: identify(tasks.batch(bad=5), [r], 16)[0]["sha256"]  # noqa: E731
    assert row["sha256"] == digest(5) != digest(4)
    assert sum(1 for key, _ in passes if key == "remedies") == 3       # one replay each
    assert "remedies" in r.timings and r.timings["remedies"] > 0
    js = json.loads((tmp_path / "r" / "report.json").read_text())
    assert js["culprit"]["samples"] == [5]
    assert [(m["kind"], m["outcome"]) for m in js["remedies"]] == [
        ("precision", "still-failing"), ("precision", "still-failing"), ("samples", "finite")]
    md = to_markdown(r).splitlines()
    first = md.index(next(line for line in md if line.startswith("**Verified:**")))
    assert first == 4 and "the step is finite without batch rows [5] (row 5: id " \
        "'sample-0-5', sha256 " in md[first]     # right after the headline
    assert "| precision | when aten.sqrt.default in act (call 0) runs in float64 | " \
        "still-failing |" in "\n".join(md)
    term = terminal(r, tmp_path / "r").splitlines()
    assert term[1].startswith("  verified: the step is finite without batch rows [5]")
    assert term[2] == ("  tried: the step still fails when aten.sqrt.default in act (call 0) "
                       "runs in float64")
    page = to_html(r)
    card = page[page.index('<table class="culprit-card">'):page.index("</table>")]
    assert "the step is finite without batch rows [5]" in card and "verified" in card


def test_a_float16_overflow_is_finite_when_its_module_runs_in_float32(tmp_path):
    """exp overflows float16 and inf / inf is NaN. Precision follows the chain: exp, where the
    inf was born, wider first (its result, cast back to float16, is inf again: still failing);
    the culprit (the div) already gets that inf, so computing it alone wider cannot help
    (skipped, saying so); the module call in float32 keeps exp's value and the step is
    finite."""
    bundle = capture(tmp_path, "half_overflow", tasks.batch(bad=3, scale=30.0,
                                                             dtype=torch.float16))
    r, _ = run(bundle, tmp_path / "r")
    assert (r.culprit.op, r.inf_origin.op) == ("aten.div.Tensor", "aten.exp.default")
    origin, op, module = by_kind(r)["precision"]
    assert (origin.outcome, origin.detail["scope"]) == ("still-failing", "inf_origin")
    assert origin.change == ("when aten.exp.default in act (call 0), where the inf was born, "
                             "runs in float32")
    assert op.outcome == "skipped" and "already carry inf (born in aten.exp.default (tried " \
        "above))" in op.detail["reason"]
    assert (module.outcome, module.detail["dtype"], module.detail["module"]) == (
        "finite", "float32", "act")
    assert module.sentence() == "the step is finite when module act (call 0) runs in float32"
    assert module.loss is not None
    assert r.culprit.samples == [3]


def test_a_module_that_casts_to_float16_itself_is_finite_with_its_casts_kept_wide(tmp_path):
    """The float32 model's act casts to float16 itself (``h.half()``) before exp: the module
    in float32 is finite only when its own cast is kept wide (`upcast.KeepWide`)."""
    bundle = capture(tmp_path, "half_cast_overflow", tasks.batch(bad=3, scale=30.0))
    r, _ = run(bundle, tmp_path / "r")
    assert (r.culprit.op, r.culprit.input_dtypes, r.inf_origin.op) == (
        "aten.div.Tensor", ["float16", "float16"], "aten.exp.default")
    assert [(m.outcome, m.detail.get("scope")) for m in by_kind(r)["precision"]] == [
        ("still-failing", "inf_origin"), ("skipped", "op"), ("finite", "module")]
    assert r.remedies[0].kind == "precision"


def test_an_adam_eps0_culprit_is_finite_with_eps_raised(fixture_bundle, tmp_path):
    """Adam with eps=0 divides 0 by 0 for embedding rows no token used: raising eps makes the
    step finite, clipping the gradients does not, nor does the update in float64 (0/0 at any
    precision). The update mixes every row's gradient: samples cannot be traced, and removing
    half of the batch does not help either (the budget of 4 ends the bisection there)."""
    r, _ = run(fixture_bundle("optimizer_adam_eps0"), tmp_path / "r")
    assert (r.culprit.phase, r.culprit.op) == ("optimizer", "aten.addcdiv_.default")
    assert r.culprit.samples is None
    assert [(m.kind, m.outcome) for m in r.remedies] == [
        ("optimizer", "finite"), ("optimizer", "still-failing"), ("precision", "still-failing"),
        ("samples", "still-failing")]
    eps = r.remedies[0]
    assert eps.change == "with the optimizer's eps raised from 0 to 1e-08"
    assert eps.detail["eps"] == 1e-08 and eps.loss is not None
    s = r.remedies[3].detail
    assert s["found_by"] == "bisection" and s["complete"] is False and s["rows"] is None
    assert "mixes the batch's rows" in s["why_not_traced"]


def test_with_a_lookback_the_batch_not_the_state_is_to_blame(tmp_path):
    """A Guard with lookback=2: three healthy steps, then the corrupt batch. The same pre-step
    state with the step before's batch is finite: the batch did it."""
    guard = nanbisect.Guard(tasks.sqrt_rows(), entry=f"{TASKS}:sqrt_rows", out=tmp_path / "g",
                            lookback=2)
    for seed in range(3):
        guard.step(tasks.batch(seed=seed))
    try:
        guard.step(tasks.batch(bad=5, seed=3))
        raise AssertionError("the corrupt batch must fail")
    except nanbisect.NonFiniteStep as e:
        bundle = e.bundle
    r, _ = run(bundle, tmp_path / "r")
    (state,) = by_kind(r)["state"]
    assert state.outcome == "finite" and state.detail["meaning"] == "the batch did it"
    assert state.detail["step"] == 2 and state.loss is not None
    assert state.change == "with the batch of step 2 in place of its own (the same state)"
    assert [m.kind for m in r.remedies] == ["precision", "precision", "samples", "state"]
    assert "the batch did it" in to_markdown(r)


def test_a_batch_wide_reduction_cannot_be_traced_and_bisection_finds_the_row(tmp_path):
    """The activation centres by the batch's mean: every row's value depends on every row, so
    samples is null (the reason names the reduction); bisecting the batch finds row 1: the
    step without it is finite, each bisection replay counted against the budget."""
    bundle = capture(tmp_path, "batch_mean", tasks.batch(bad=1, rows=8))
    r, passes = run(bundle, tmp_path / "r", remedies=6)
    assert r.culprit.samples is None
    (s,) = by_kind(r)["samples"]
    assert (s.outcome, s.change) == ("finite", "without batch rows [1]")
    d = s.detail
    assert d["rows"] == [1] and d["found_by"] == "bisection" and d["complete"] is True
    assert "aten.mean.dim" in d["why_not_traced"]
    assert [(t["without"], t["outcome"]) for t in d["tried"]] == [
        ([0, 1, 2, 3], "finite"), ([0, 1], "finite"), ([0], "still-failing"), ([1], "finite")]
    assert d["identify"][0]["fields"] == {"id": "sample-0-1"}
    assert sum(1 for key, _ in passes if key == "remedies") == 6
    assert any("remedy replay 6/6" in text for _, text in passes)


def test_the_budget_lists_what_it_left_out_and_no_remedies_turns_them_off(tmp_path,
                                                                           monkeypatch):
    bundle = capture(tmp_path, "sqrt_rows", tasks.batch(bad=5))
    r, passes = run(bundle, tmp_path / "r", remedies=1)
    assert [(m.kind, m.outcome) for m in r.remedies] == [
        ("precision", "still-failing"), ("precision", "skipped"), ("samples", "skipped")]
    assert all("--remedy-budget" in m.detail["reason"] for m in r.remedies[1:])
    assert r.culprit.samples == [5]        # traced in the catch pass: no replay of its own
    res = invoke("run", bundle, "--no-remedies", "--json", "--out", tmp_path / "off")
    js = json.loads(res.stdout)
    assert res.code == 1 and js["remedies"] == [] and "remedies" not in js["timings"]
    assert js["culprit"]["samples"] == [5]
    monkeypatch.setenv("NANBISECT_REMEDY_BUDGET", "four")
    one_line_exit_2(invoke("run", bundle, "--out", tmp_path / "bad"), "NANBISECT_REMEDY_BUDGET",
                    "'four'", "from 0 to 1000")
    assert not (tmp_path / "bad").exists()


def test_a_change_the_model_cannot_take_is_an_error_entry_not_a_failed_run(tmp_path):
    """The model reshapes its input to exactly 16 rows: the step without row 5 raises in the
    user's code; that remedy is an error naming it, the run and the other remedies go on."""
    bundle = capture(tmp_path, "fixed_rows", tasks.batch(bad=5))
    r, _ = run(bundle, tmp_path / "r")
    (s,) = by_kind(r)["samples"]
    assert (s.outcome, s.detail["rows"]) == ("error", [5])
    assert s.detail["error"].startswith("RuntimeError: shape '[16, 8]' is invalid")
    assert r.verdict == "culprit" and (tmp_path / "r" / "report.json").is_file()
    assert "could not be replayed: RuntimeError" in s.sentence()


def traced(fn, batch, site: OpSite, kind: str = "nan"):
    """The row trace of ``fn(batch)`` to ``site``, without a replay."""
    tracer = RowTracer(site, kind)
    tracer.start(batch)
    with tracer:
        fn(batch)
    return tracer.result()


def test_rows_survive_reshapes_matmuls_and_norms_and_are_lost_in_reductions():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5)                 # (B, T, C)
    x[2, 1, 0] = 1e6
    w = torch.randn(5, 5)
    sqrt = OpSite("aten.sqrt.default", "forward", 0)

    def through(b):                           # view (B*T, C) -> mm -> view (B, T, C) -> norm
        h = (b.reshape(-1, 5) @ w).reshape(4, 3, 5)
        h = torch.nn.functional.layer_norm(h, (5,)) + h.softmax(-1) + h.mean(1, keepdim=True)
        return torch.sqrt(1e3 - h.abs().transpose(1, 2))     # NaN where |h| > 1e3: row 2
    assert traced(through, x, sqrt).samples == [2]

    mixed = traced(lambda b: torch.sqrt(b - b.mean(0)), x, sqrt)
    assert mixed.samples is None and "aten.mean.dim" in mixed.why
    # the rows' dim moves with a transpose or a permute, and is found again after a reshape
    moved = traced(lambda b: torch.sqrt(1e3 - b.transpose(0, 1).abs()), x, sqrt)
    assert moved.samples == [2]
    heads = traced(lambda b: torch.sqrt(1e3 - b.reshape(4, 3, 5, 1).permute(3, 2, 0, 1)
                                        .unbind(0)[0].transpose(0, 1).reshape(4, 15).abs()), x, sqrt)
    assert heads.samples == [2]
    # a reshape that spreads each row over two dims mixes them
    spread = traced(lambda b: torch.sqrt(1e3 - b.reshape(3, 4, 5).abs()), x, sqrt)
    assert spread.samples is None and "aten.view.default" in spread.why
    alone = traced(lambda b: torch.sqrt(-torch.ones(3)) + b.sum(), x, sqrt)
    assert alone.samples is None and "no batch row" in alone.why


def test_a_tracer_that_breaks_gives_null_and_the_step_goes_on(monkeypatch):
    """A rule that raises inside the tracer: samples null with the reason, the step's own result
    unchanged (the catch pass it rides on must not fail)."""
    def broken(*a, **k):
        raise RuntimeError("no rule")
    monkeypatch.setattr(RowTracer, "_outputs", broken)
    x = torch.ones(4, 3)
    x[1] = -1.0
    out = []
    res = traced(lambda b: out.append((b * 2).sqrt()), x, OpSite("aten.sqrt.default",
                                                                  "forward", 0))
    assert res.samples is None and "the row trace failed at aten.mul.Tensor" in res.why
    assert out[0].isnan().sum().item() == 3


def test_remedies_undo_their_changes(fixture_bundle):
    """After the remedies the replayer replays the captured step again: eps, clipping and the
    batch as the bundle has them."""
    from nanbisect.bundle.format import read_bundle
    from nanbisect.locate.ops import record_ops
    from nanbisect.locate.producers import make_culprit
    from nanbisect.remedies import try_remedies
    from nanbisect.replay.replayer import Replayer

    rep = Replayer(read_bundle(fixture_bundle("optimizer_adam_eps0")), torch.device("cpu"))
    before = rep.run()
    f = record_ops(rep, "optimizer", "nan")
    done = try_remedies(rep, make_culprit(rep.task.model, "optimizer", finding=f), f, budget=4)
    assert done[0].outcome == "finite"
    after = rep.run()
    assert (after.phase, after.loss) == (before.phase, before.loss) == ("optimizer", before.loss)
    assert rep.batch_edits == [] and rep.task.clip_grad_norm is None
    assert rep.task.optimizer.param_groups[0]["eps"] == 0.0


def test_triage_names_the_remedy_per_signature():
    reps = [{"verdict": "culprit", "classification": "numerics",
             "culprit": {"op": "aten.sqrt.default", "module": "act", "phase": "forward",
                         "input_dtypes": ["float32"]},
             "remedies": [{"kind": "precision", "outcome": "still-failing"},
                          {"kind": kind, "outcome": "finite"}]} for kind in ("samples", "state")]
    assert remedy_kinds(reps[0]) == ["samples"]
    st = NightState([], set(), None, {}, "loky", 60.0)
    for i, rep in enumerate(reps):
        st.add({"bundle": f"/b{i}", "report": rep}, cached=False)
    data = st.data()
    (g,) = data["signatures"]
    assert g["remedies"] == ["samples", "state"] and data["bundles"][0]["remedies"] == ["samples"]
    assert "| made finite by |" in triage_markdown(data) and "| samples, state |" in \
        triage_markdown(data)



def test_a_remedy_that_fails_is_recorded_whole_and_rendered_on_one_line(tmp_path):
    """The float64 module remedy under activation checkpointing: the recomputation in backward
    refuses it (CheckpointError, a message of several lines). report.json keeps the error
    whole (type, first line, the whole message, where); report.md's table stays a table,
    report.html and the terminal say it on one line, cut at a word, never mid-word."""
    import checkpointed

    bundle = tmp_path / "bundle"
    nanbisect.capture(checkpointed.task(), checkpointed.batch(), bundle,
                      entry=f"{TEST_TASKS / 'checkpointed.py'}:task")
    r, _ = run(bundle, tmp_path / "r")
    failed = next(m for m in r.remedies if m.outcome == "error")
    d = failed.detail
    assert d["error_type"] == "CheckpointError" and d["error_where"]
    assert "\n" in d["error_message"] and "tensor at position 0" in d["error_message"]
    assert d["error"].startswith("CheckpointError: ") and "\n" not in d["error"]
    assert d["error"] == "CheckpointError: " + d["error_message"].splitlines()[0].strip()
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert any(m["detail"].get("error_message") == d["error_message"]
               for m in saved["remedies"])
    md = to_markdown(r)
    table = md[md.index("## Remedies"):].split("\n\n")[1].splitlines()
    assert len(table) == 2 + len(r.remedies)
    assert all(t.startswith("|") and t.endswith("|") for t in table)
    assert all(t.replace("\\|", "").count("|") == 6 for t in table)
    page = to_html(r, tmp_path / "r")
    assert d["error"].replace("'", "&#39;") in page or d["error"] in page
    line = next(t for t in terminal(r, tmp_path / "r").splitlines()
                if "could not be replayed" in t)
    assert "\\n" not in line and line.endswith(d["error"])
