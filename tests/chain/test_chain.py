"""The one pass chain (`nanbisect.chain`): the single-process pipeline, a rank in lockstep and a
rank alone reach the passes only through it (read from every module's AST:
`helpers.chainrule`, each rule with a counter-test on a planted violation), and how collectives
are served decides which passes run. In-process, on a shipped fixture bundle."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from helpers import chainrule

from nanbisect.bundle.format import read_bundle
from nanbisect.chain import Chain, Serving
from nanbisect.locate.catch import AheadCatch
from nanbisect.records import Culprit, OpCheck
from nanbisect.replay.probe import ModuleProbe, probing
from nanbisect.replay.replayer import Replayer


def test_no_module_but_the_chain_wires_a_pass():
    """Every module of the package, read as an AST: a pass is imported and called only by the
    chain and by the passes' own modules (`helpers.chainrule.passes_outside`)."""
    found = chainrule.passes_outside()
    assert not found, "\n".join(map(str, found))


def test_every_chain_says_how_its_collectives_are_served():
    """Every ``Chain(...)`` of the package passes a `Serving` member; and the three paths that
    build one say each its own (one process, lockstep, served)."""
    found = chainrule.chains_without_serving()
    assert not found, "\n".join(map(str, found))
    assert chainrule.servings() == {"nanbisect/pipeline/analysis.py": {"NONE"},
                                    "nanbisect/multirank/worker.py": {"LOCKSTEP"},
                                    "nanbisect/multirank/alone.py": {"SERVED"}}


def _package(root, files: dict[str, str]):
    """A temporary package ``root/nanbisect`` holding ``files`` (path -> source)."""
    pkg = root / "nanbisect"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in [path.parent, *path.parent.parents]:
            if parent == root:
                break
            (parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return pkg


def test_a_pass_wired_outside_the_chain_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "pipeline/direct.py": """
            from nanbisect.locate.ops import record_ops as rec
            from nanbisect.replay.probe import ModuleProbe
            from nanbisect import proc
            from nanbisect.locate import catch

            def run(rep, site, wrap, child):
                proc.finish(child, 1.0)                  # no pass: proc's finish
                catch.catch_inputs(rep, site, wrap)      # a pass through its module
                return rep.input_faults(rep.restore())   # the input-fault check by hand
            """,
        # the passes' own modules and the chain may
        "chain.py": "from nanbisect.locate.ops import record_ops\n",
        "finish.py": "from nanbisect.reference.opcheck import safe_check\n",
        "compiler/child.py": "from nanbisect.locate.catch import catch_module_call\n",
    })
    found = chainrule.passes_outside(pkg)
    assert {f.path for f in found} == {"nanbisect/pipeline/direct.py"}, [str(f) for f in found]
    assert sorted(f.line for f in found) == [2, 3, 9, 10], [str(f) for f in found]


def test_a_chain_without_a_serving_member_is_found(tmp_path):
    pkg = _package(tmp_path, {
        "multirank/loose.py": """
            import nanbisect.chain as ch
            from nanbisect.chain import Chain, Serving

            def chains(rep, how):
                Chain(rep, Serving.LOCKSTEP)            # said
                Chain(rep, serving=Serving.SERVED)      # said, by keyword
                Chain(rep, how)                         # a variable
                ch.Chain(rep, "none")                   # a string, through the module
                Chain(rep, Serving.SOMETIMES)           # no such member
                return Chain(rep)                       # nothing
            """,
    })
    found = chainrule.chains_without_serving(pkg)
    assert sorted(f.line for f in found) == [8, 9, 10, 11], [str(f) for f in found]


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


def test_pass_1_the_inputs_and_the_reference_side_are_the_chains(fixture_bundle):
    """Pass 1 (the module probe, the random tape), the input-fault check and the reference side
    run through the chain, and one evidence classifies what every path found."""
    bundle = read_bundle(fixture_bundle("healthy"))
    steps = []
    chain = Chain(Replayer(bundle, torch.device("cpu")), Serving.NONE,
                  progress=lambda key, text: steps.append((key, text)))
    assert chain.bad_inputs() == []
    first, table = chain.first_pass("cpu", reference=True)
    assert first.phase is None and table.in_order("forward")
    side = chain.reference_side(lambda: Replayer(bundle, torch.device("cpu"), torch.float64),
                                "cpu:float64")
    assert chain.reference(side, first).phase is None and side.divergence() is None
    assert side.dtype == torch.float64 and side.probe.read().in_order("forward")
    assert [k for k, _ in steps] == ["module-pass", "reference"]
    assert steps[0][1] == "pass 1/3: replaying the step on cpu with module statistics"
    check = OpCheck("aten.exp.default", 7, "ok")
    assert chain.classify(side, check)[0] == "numerics"     # wider dtype, same result
    assert chain.classify(None, check)[0] == "unknown"
    # a rank alone's reference was served the capture's collectives: its step proves nothing,
    # the op check does
    served = Chain(chain.rep, Serving.SERVED)
    assert served.classify(side, OpCheck("aten.exp.default", 7, "mismatch"))[0] == "device"
