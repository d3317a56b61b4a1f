"""DeepSpeed under the Guard (`nanbisect.integrations.deepspeed`): examples/deepspeed_zero.py's
engine on 2 real gloo ranks (DeepSpeed's CPU accelerator): ZeRO stage 1 in fp32 through
`Guard.step`, stage 2 in bf16 through the loop's own ``engine.backward``/``engine.step`` inside
`Guard.watch` (tests/tasks/ds_restore.py). By hand (CHANGELOG): stage 2 in fp32 and stage 1 in
bf16 (DeepSpeed's bf16 optimizer), each way."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers import TEST_TASKS
from helpers.bundles import culprit_report, run_ranks
from nanbisect.bundle.format import read_manifest
from nanbisect.errors import BadInput

ENV = {"NANBISECT_RANK_TIMEOUT": "60", "DS_ACCELERATOR": "cpu"}


def _said(stdout: str) -> dict[int, dict[str, str]]:
    out: dict[int, dict[str, str]] = {}
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4 and parts[0] == "RANK":
            out.setdefault(int(parts[1]), {})[parts[2]] = parts[3]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind,loop", [("zero1", "step"), ("zero2_bf16", "watch")])
def test_zero_bundles_the_whole_step_restores_it_exactly_and_names_rank_1s_sqrt(
        tmp_path, kind, loop):
    """The failing step is bundled whole on both ranks (ZeRO's partitions and Adam's moments in
    torch's format, nothing left out); restored into a fresh engine, every tensor equals the
    job's own (which moved since the engine was built); the replay names rank 1's forward sqrt
    and rank 0 received it through ZeRO's gradient reduction."""
    pytest.importorskip("deepspeed")
    p = run_ranks(TEST_TASKS / "ds_restore.py",
                  [kind, str(tmp_path / "out"), *(["watch"] if loop == "watch" else [])], 2,
                  env=ENV, timeout=240)
    got = _said(p.stdout)
    assert set(got) == {0, 1}, p.stdout + p.stderr[-3000:]
    bundle = got[0]["BUNDLE"]
    assert got[1]["BUNDLE"] == bundle and bundle.endswith("step000002"), got
    for r in (0, 1):
        assert "DIFF" not in got[r] and int(got[r]["EXACT"]) >= 9, got[r]
        assert int(got[r]["MOVED"]) >= 8, got[r]     # weights, partitions, moments
        part = read_manifest(f"{bundle}/rank{r}")
        assert "partial" not in part, part.get("partial")
        assert part["optimizer"]["class"] == \
            "nanbisect.integrations.deepspeed.EngineOptimizer"
        assert '"master"' in json.dumps(part["optimizer"]["state"])     # the partitions
    report = culprit_report(bundle, tmp_path / "r", env=ENV)
    c = report["culprit"]
    assert (report["phase"], c["rank"], c["phase"], c["op"]) == (
        "forward", 1, "forward", "aten.sqrt.default"), c
    row = {r["rank"]: r for r in report["ranks"]}[0]
    assert (row["how"], row["phase"], row["via"]["phase"], row["from_ranks"]) == (
        "received", "backward", "backward", [1]), row
    assert row["via"]["op"].startswith("c10d."), row["via"]
    assert "rank 0 received it through" in " ".join(report["notes"]), report["notes"]


def test_zero_stage_3_is_refused_in_one_line_naming_what_to_do():
    from nanbisect.integrations.deepspeed import deepspeed_task

    engine = SimpleNamespace(zero_optimization_stage=lambda: 3)
    with pytest.raises(BadInput, match="ZeRO stage 3 is not supported.*stage 1 or 2"):
        deepspeed_task(engine, lambda e, b: None)
