"""Every run ends with a report: a stage after the verdict that raises is listed in the report's
``errors`` (report.json, report.md, report.html, the terminal summary), the rest is written and
the exit code stays the verdict's; an internal error before any verdict is exit 4, one line on
stderr naming the log file that holds the traceback. In-process, on a shipped fixture bundle.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

import nanbisect.chain
import nanbisect.finish
import nanbisect.history
import nanbisect.pipeline.analysis
import nanbisect.pipeline.analysis as step_stage
import nanbisect.report.page
import nanbisect.report.write
from helpers import invoke, tree_digest
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.records import (Culprit, HistoryEntry, Losses, ReproResult, RunFacts,
                               TimelineRow)
from nanbisect.report.model import Report
from nanbisect.report.prose import terminal
from nanbisect.report.write import write_report

BUNDLE = "forward_nan_behind_mask"      # culprit aten.sqrt.default in blocks.1.mlp.act


def _boom(stage: str):
    def raises(*args, **kwargs):
        raise RuntimeError(f"{stage} boom")
    return raises


def _read(out: Path) -> tuple[dict, str, str]:
    data = json.loads((out / "report.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    return data, (out / "report.md").read_text(), (out / "report.html").read_text()


def test_every_stage_after_the_verdict_raises_and_the_report_is_written(
        fixture_bundle, tmp_path, monkeypatch):
    bundle = fixture_bundle(BUNDLE)
    record_ops = nanbisect.chain.record_ops

    def with_surfaced_site(*args, **kwargs):   # so that the surfaced repro is attempted too
        f = record_ops(*args, **kwargs)
        return replace(f, surfaced_site=f.site)

    monkeypatch.setattr(nanbisect.chain, "record_ops", with_surfaced_site)
    stages = {"repro": (nanbisect.finish, "write_repro"),
              "op-check": (nanbisect.finish, "safe_check"),
              "context": (step_stage, "backtrace"),
              "remedies": (nanbisect.chain, "try_remedies"),
              "surfaced-repro": (step_stage, "_surfaced_repro"),
              "classification": (nanbisect.chain, "classify_culprit"),
              "history": (nanbisect.history, "findings"),
              "plots": (nanbisect.report.page, "history_svg")}
    for stage, (module, name) in stages.items():
        monkeypatch.setattr(module, name, _boom(stage))
    out = tmp_path / "report"
    r = run_bundle(bundle, RunOptions(reference="cpu"), out)

    # the verdict is the one an undisturbed run gives, and so is its exit code
    assert (r.verdict, r.culprit.op, r.culprit.module, r.culprit.module_call) == \
        ("culprit", "aten.sqrt.default", "blocks.1.mlp.act", 2)
    assert r.exit_code == 1 and r.classification == "unknown"
    assert [e.stage for e in r.errors] == list(stages)
    data, md, page = _read(out)
    assert [(e["stage"], e["message"].split(" at ")[0]) for e in data["errors"]] == \
        [(s, f"RuntimeError: {s} boom") for s in stages]
    assert data["verdict"] == "culprit" and data["culprit"]["op"] == "aten.sqrt.default"
    # what the failed stages would have added is missing; the rest is there
    assert data["repro"] is None and data["op_check"] is None and data["remedies"] == []
    assert data["backtrace"] == [] and data["history_findings"] == []
    assert data["context"] and data["timings"]
    assert not (out / "repro").exists()
    assert "## Errors" in md and all(f"- {s}: `RuntimeError: {s} boom" in md for s in stages)
    assert '<ul class="errors">' in page
    assert all(f"<b>{s}</b>: <code>RuntimeError: {s} boom" in page for s in stages)
    assert "this plot could not be drawn" in page
    assert "  error in remedies: RuntimeError: remedies boom" in terminal(r, out)


def test_module_repro_that_raises_keeps_the_repro(fixture_bundle, tmp_path, monkeypatch):
    """The op's repro did not reproduce, so its module call is caught for a repro of its own:
    that raises; the op's repro and its result stay."""
    bundle = fixture_bundle(BUNDLE)
    monkeypatch.setattr(step_stage, "_repro_starter",
                        lambda run: lambda script, caught: lambda: ReproResult(False, 0, "no"))
    monkeypatch.setattr(step_stage, "_module_fallback", _boom("module-repro"))
    r = run_bundle(bundle, RunOptions(reference="none", remedies=0), tmp_path / "r")
    assert r.verdict == "culprit" and r.exit_code == 1
    assert [(e.stage, e.message.split(" at ")[0]) for e in r.errors] == \
        [("module-repro", "RuntimeError: module-repro boom")]
    data, _, _ = _read(tmp_path / "r")
    assert data["repro"] == "repro/repro.py" and data["repro_result"]["reproduced"] is False
    assert data["module_repro"] is None and data["errors"][0]["stage"] == "module-repro"
    assert (tmp_path / "r" / "repro" / "repro.py").is_file()
    assert any(n.endswith("with the module's state: it could not be made (see errors)")
               for n in r.notes)


def test_a_bad_input_a_stage_raises_is_listed_not_the_runs_end(fixture_bundle, tmp_path,
                                                              monkeypatch):
    """The entry's code failing in a remedy's replay, or the likely cause failing, is the
    stage's error (`BadInput` included): the verdict stands, the report is written, exit 1."""
    from nanbisect.errors import BadInput

    def refuses(*args, **kwargs):
        raise BadInput("the entry's code fails on this bundle (remedy replay)")

    monkeypatch.setattr(nanbisect.chain, "try_remedies", refuses)
    monkeypatch.setattr(nanbisect.finish, "likely_cause", _boom("likely-cause"))
    r = run_bundle(fixture_bundle(BUNDLE), RunOptions(reference="none"), tmp_path / "r")
    assert (r.verdict, r.exit_code, r.culprit.op) == ("culprit", 1, "aten.sqrt.default")
    assert [(e.stage, e.message.split(" at ")[0]) for e in r.errors] == [
        ("likely-cause", "RuntimeError: likely-cause boom"),
        ("remedies", "BadInput: the entry's code fails on this bundle (remedy replay)")]
    data, _, _ = _read(tmp_path / "r")
    assert data["culprit"]["likely_cause"] is None and data["remedies"] == []


def _report() -> Report:
    return Report("culprit", "numerics", "forward", "nan",
                  Culprit("forward", "fc", 0, ["float32"], [[2]], None, "aten.log.default", 4),
                  RunFacts("b", "t.py:task", "cpu", "none", None, Losses("nan", "nan")),
                  timeline=[TimelineRow("fc", 0, 2, 0, 1.0)],
                  history=[HistoryEntry(1, loss=1.0), HistoryEntry(2, loss=float("nan"))])


@pytest.mark.parametrize("broken", ["markdown", "page", "json"])
def test_a_rendering_that_raises_is_listed_and_the_files_are_written(broken, tmp_path,
                                                                     monkeypatch):
    if broken == "markdown":
        monkeypatch.setattr(nanbisect.report.write, "to_markdown", _boom("markdown"))
    elif broken == "page":
        monkeypatch.setattr(nanbisect.report.write, "to_html", _boom("page"))
    else:
        monkeypatch.setattr(Report, "to_json", _boom("json"))
    written = write_report(_report(), tmp_path)
    assert [e.stage for e in written.errors] == [broken]
    data, md, page = _read(tmp_path)
    assert data["verdict"] == "culprit"
    assert data["errors"][0]["message"].startswith(f"RuntimeError: {broken} boom at ")
    assert f"{broken}: " in md and f"{broken} boom" in page and page.rstrip().endswith("</html>")


def test_an_internal_error_before_the_verdict_is_exit_4_in_one_line(fixture_bundle, tmp_path,
                                                                    monkeypatch):
    bundle = fixture_bundle(BUNDLE)
    before = tree_digest(bundle)
    monkeypatch.setattr(nanbisect.pipeline.analysis, "_decide", _boom("decide"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))     # where the log goes
    res = invoke("run", bundle, "--target", "cpu", "--out", tmp_path / "out")
    line = res.stderr.strip()
    assert res.code == 4, res.stdout + res.stderr
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith("nanbisect: internal error (exit 4, no verdict, no report): "
                           "RuntimeError: decide boom at test_stage_errors.py:")
    logs = list(tmp_path.glob("nanbisect-error-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    text = logs[0].read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: decide boom" in text
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    assert tree_digest(bundle) == before


def test_a_ranks_stage_errors_travel_in_its_rank_file():
    """A rank's stages after its verdict that failed (its repro, op check, remedies) are in its
    rank file and read back; the launcher lists them in the report's errors with the rank."""
    from nanbisect.records import RankResult, StageError
    from nanbisect.util.recordjson import dumps

    r = RankResult(rank=3, errors=[StageError("repro", "OSError: no room at repro.py:1")])
    back = RankResult.from_json(json.loads(dumps(r.to_json())))
    assert back.errors == r.errors and back.rank == 3
    assert RankResult.from_json(json.loads(dumps(RankResult(rank=0).to_json()))).errors == []
