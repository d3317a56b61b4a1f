"""The one pass chain (`nanbisect.chain`): the single-process pipeline, a rank in lockstep and a
rank alone reach the passes only through it, and how collectives are served decides which
passes run. In-process, on a shipped fixture bundle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from nanbisect.bundle.format import read_bundle
from nanbisect.chain import Chain, Serving
from nanbisect.locate.catch import AheadCatch
from nanbisect.records import Culprit
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer

PKG = Path(__file__).resolve().parents[2] / "nanbisect"
CALLERS = {"pipeline/culprit.py": "NONE", "multirank/worker.py": "LOCKSTEP",
           "multirank/alone.py": "SERVED"}
# the passes: a caller that imports one of these wires a pass itself, and the other paths
# would not get it
PASSES = {"record_ops", "catch_inputs", "catch_module_call", "AheadCatch", "RowTracer",
          "finish", "try_remedies", "not_tried", "isolate_window", "diverging_call",
          "forward_producer", "backward_producer", "first_bad_parameter"}


def _imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("nanbisect") for a in node.names}


@pytest.mark.parametrize("caller", sorted(CALLERS) + ["multirank/sides.py"])
def test_no_caller_wires_a_pass_itself(caller):
    wired = _imported(PKG / caller) & PASSES
    assert not wired, f"{caller} imports {sorted(wired)}: call them through nanbisect.chain"


@pytest.mark.parametrize("caller,serving", sorted(CALLERS.items()))
def test_each_path_says_how_its_collectives_are_served(caller, serving):
    assert f"Serving.{serving}" in (PKG / caller).read_text()


@pytest.fixture(scope="module")
def forward_nan(request):
    """The fixture's forward NaN (sqrt of a negative behind a mask) after its first pass."""
    bundle = read_bundle(Path(__file__).resolve().parents[2] / "fixtures" / "bundles"
                         / "forward_nan_behind_mask")
    rep = Replayer(bundle, torch.device("cpu"))
    probe = ModuleProbe(rep.task.model)
    first = rep.run(phase=probing(probe))
    assert first.phase == "forward"
    return rep, first, probe.read()


def test_one_process_scopes_the_recording_and_catches_on_its_way(forward_nan):
    rep, first, table = forward_nan
    chain = Chain(rep, Serving.NONE)
    assert isinstance(chain.ahead("forward", "nan"), AheadCatch)
    steps = []
    chain.progress = lambda key, text: steps.append(key)
    loc = chain.locate(first, table)
    assert loc.finding.op == "aten.sqrt.default" and loc.caught is not None
    assert loc.finding.scope is not None       # recorded from the producing call on
    assert "input-catch" not in steps          # pass 3 rode along pass 2


@pytest.mark.parametrize("serving", [Serving.LOCKSTEP, Serving.SERVED])
def test_ranks_catch_in_a_pass_of_their_own(forward_nan, serving):
    rep, first, table = forward_nan
    chain = Chain(rep, serving)
    assert chain.ahead("forward", "nan") is None
    loc = chain.locate(first, table)
    assert loc.finding.op == "aten.sqrt.default" and loc.caught is not None
    # in lockstep every rank records the same ops: never scoped to its own producing call
    assert (loc.finding.scope is None) == (serving is Serving.LOCKSTEP)


def test_ranks_agree_between_recording_and_catching(forward_nan):
    rep, first, table = forward_nan
    asked = []

    def received(finding):
        asked.append(finding.op)
        return None

    loc = Chain(rep, Serving.SERVED).locate(first, table, received)
    assert asked == ["aten.sqrt.default"] and loc.through and loc.caught is None
    loc = Chain(rep, Serving.LOCKSTEP).locate(first, table, lambda f: (f.site, False))
    assert loc.caught is not None and loc.traced is None   # not this rank's culprit: no rows


def test_remedies_follow_how_collectives_are_served(forward_nan):
    rep = forward_nan[0]
    backward = Culprit("backward", "blocks.1", 0, ["float32"], [[2]], None, "aten.mul.Tensor",
                       3, rank=1)
    for serving, why in ((Serving.LOCKSTEP, "lockstep"), (Serving.SERVED, "only a forward")):
        remedies = Chain(rep, serving).remedies(backward, None, None, budget=2)
        assert remedies and all(r.outcome == "skipped" for r in remedies)
        assert all(why in r.detail["reason"] for r in remedies)
    assert Chain(rep, Serving.NONE).remedies(backward, None, None, budget=0) == []


def test_a_finite_rank_in_lockstep_follows_an_optimizer_failure_elsewhere(fixture_bundle):
    """In lockstep the phase is the culprit rank's: a rank whose own step stayed finite runs
    the same passes (nothing of its own to name) instead of failing before pass 2."""
    rep = Replayer(read_bundle(fixture_bundle("healthy")), torch.device("cpu"))
    probe = ModuleProbe(rep.task.model)
    first = rep.run(phase=probing(probe))
    assert first.phase is None and not first.bad
    loc = Chain(rep, Serving.LOCKSTEP).locate(first, probe.read(), lambda f: (None, False),
                                              failed=("optimizer", "nan"))
    assert (loc.phase, loc.parameter, loc.caught) == ("optimizer", None, None)


def test_a_rank_alone_does_not_judge_a_backward_failure_on_its_forward(tmp_path):
    """A failure born in forward that surfaced in backward: its culprit is in forward, but the
    step failed in backward, which a rank alone cannot judge (its collectives after forward are
    served with the capture's failure): no remedy may claim to fix it there."""
    import nanbisect
    import surfaced
    from helpers import TEST_TASKS

    nanbisect.capture(surfaced.where_sqrt(), surfaced.batch(), tmp_path / "b",
                      entry=f"{TEST_TASKS / 'surfaced.py'}:where_sqrt")
    rep = Replayer(read_bundle(tmp_path / "b"), torch.device("cpu"))
    probe = ModuleProbe(rep.task.model)
    first = rep.run(phase=probing(probe))
    chain = Chain(rep, Serving.SERVED)
    loc = chain.locate(first, probe.read())
    _, culprit = chain.finish(loc, tmp_path / "repro", "cpu")
    assert (loc.phase, culprit.phase) == ("backward", "forward")
    remedies = chain.remedies(culprit, loc.finding, loc.traced, 4, loc.phase)
    assert remedies and all(r.outcome == "skipped" for r in remedies)
