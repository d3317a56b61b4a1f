"""megatron-core under the Guard on CPU ranks (`nanbisect.integrations.megatron`): its shims, and
its GPT (examples/megatron_gpt.py) tensor parallel and in megatron's data-parallel wrapper on 2
real gloo ranks; its pipeline schedule runs in tests/multirank/test_pipelined.py."""
from __future__ import annotations

import pytest
import torch

from nanbisect.integrations.megatron import on_cpu


def test_inside_on_cpu_what_megatron_puts_on_cuda_lands_on_the_cpu_and_outside_nothing_changed():
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    with on_cpu():
        # as megatron-core 0.16's schedules and p2p communicator make them
        made = [torch.zeros([], dtype=torch.int, device="cuda"),
                torch.empty((3, 2), device=torch.cuda.current_device()),
                torch.ones(2, device=torch.device("cuda", 0)), torch.full((1,), 2.0, device=0)]
        torch.cuda.synchronize()
        with on_cpu():           # nested: the outer one still holds after the inner ends
            pass
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert {t.device.type for t in made} == {"cpu"}
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    with pytest.raises(ValueError), on_cpu():
        raise ValueError("the step failed")
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")
    with on_cpu(torch.nn.Linear(2, 2)):     # given a model on the CPU: the same shims
        assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"


# -- megatron-core's GPT on 2 gloo ranks (examples/megatron_gpt.py) ------------------------------
ENV = {"NANBISECT_RANK_TIMEOUT": "60"}


def _gpt_bundle(tmp_path, kind: str):
    from helpers.bundles import one_bundle
    from helpers.paths import ROOT

    return one_bundle(ROOT / "examples" / "megatron_gpt.py", [kind, str(tmp_path / "out")], 2,
                      env=ENV)


def _replay(bundle, out, *more) -> dict:
    from helpers.bundles import culprit_report

    return culprit_report(bundle, out, *more, env=ENV)


@pytest.mark.slow
def test_tensor_parallel_gpt_names_rank_1s_mlp_shard_and_alone_too(tmp_path):
    """TP=2: rank 1's corrupted MLP shard takes sqrt of a negative number; rank 0 receives it
    through linear_fc2's all-reduce. ``--ranks 1`` alone (megatron's gloo side groups made on
    the fake process group) names the same op."""
    bundle = _gpt_bundle(tmp_path, "tp")
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (report["phase"], c["rank"], c["module"], c["op"]) == (
        "forward", 1, "decoder.layers.0.mlp", "aten.sqrt.default"), c
    got = {r["rank"]: r for r in report["ranks"]}[0]
    assert (got["how"], got["via"]["op"], got["via"]["module"], got["from_ranks"]) == (
        "received", "c10d.allreduce_.default", "decoder.layers.0.mlp.linear_fc2", [1]), got
    alone = _replay(bundle, tmp_path / "r1", "--ranks", "1")["culprit"]
    assert (alone["rank"], alone["module"], alone["op"]) == (1, c["module"], c["op"]), alone


@pytest.mark.slow
def test_megatrons_data_parallel_wrapper_reads_main_grad_and_its_reduction(tmp_path):
    """DP=2 in megatron's DistributedDataParallel (gradients in its buffers, reduced by
    finish_grad_sync): rank 0 received rank 1's NaN through that reduction, in backward; alone
    it says so from the capture's record."""
    bundle = _gpt_bundle(tmp_path, "dp")
    report = _replay(bundle, tmp_path / "r")
    c = report["culprit"]
    assert (c["rank"], c["phase"], c["module"], c["op"]) == (
        1, "forward", "module.decoder.layers.0.mlp", "aten.sqrt.default"), c
    got = {r["rank"]: r for r in report["ranks"]}[0]
    assert (got["how"], got["via"]["phase"], got["from_ranks"]) == (
        "received", "backward", [1]), got
    alone = _replay(bundle, tmp_path / "r0", "--ranks", "0")
    assert (alone["culprit"]["rank"], alone["culprit"]["op"]) == (1, None), alone["culprit"]
