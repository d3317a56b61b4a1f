"""A collective (or a comm hook's op) as the place a value is born, with real ranks (gloo, CPU)
and no reference device: torch's fp16 compress hook overflowing in its cast on one rank, a hook
whose float16 sum overflows, a row-parallel float16 forward all-reduce that overflows before a
layer norm, one rank's NaN carried to another by a forward all-to-all, FSDP2's float16
reduce-scatter overflowing (and its cast). The tasks: tests/tasks/mr_birth.py. The decisions
from records alone: test_paths.py."""
from __future__ import annotations

import pytest

from helpers import TEST_TASKS, run_json
from helpers.bundles import captured

# slow (multi-rank captures and replays): started first under -n 3 (tests/conftest.py)
pytestmark = pytest.mark.slow

BIRTH = TEST_TASKS / "mr_birth.py"
AR = "c10d.allreduce_.default"


def replayed(func: str, ranks: int, tmp_path) -> dict:
    """``func``'s bundle captured on ``ranks`` ranks, replayed on every rank (no reference)."""
    bundle = captured(BIRTH, func, tmp_path / "g", ranks)
    rep = run_json(bundle)
    assert rep["verdict"] == "culprit" and rep["reference"] in (None, "none")
    return rep


def how(rep: dict) -> dict[int, tuple]:
    return {r["rank"]: (r["how"], (r["via"] or {}).get("op"), r["from_ranks"])
            for r in rep["ranks"]}


@pytest.mark.parametrize("ranks", [2, 4])
def test_torchs_fp16_compress_hook_overflowing_in_its_cast_names_that_rank(ranks, tmp_path):
    rep = replayed("hook_cast", ranks, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], rep["classification"], rep["kind"]) == ("grad-reduce", "communication",
                                                                  "inf")
    # rank 1's cast to float16 made the inf, from finite gradients; not the bucket's first
    # parameter (fc1.weight): head.bias, whose slice went bad
    assert (c["rank"], c["op"], c["parameter"]) == (1, "aten._to_copy.default",
                                                    "module.head.bias")
    assert "ddp_comm_hooks/default_hooks.py:" in c["source"]      # the hook's cast, torch's
    paths = how(rep)
    assert paths[1][:2] == ("computed", "aten._to_copy.default")
    for r in range(ranks):
        if r != 1:   # every other rank received it through the hook's all-reduce, from rank 1
            assert paths[r] == ("received", AR, [1])
    said = " ".join(rep["notes"])
    assert "float16 result overflowed" in said and "74000" in said
    # one phrase for every rank that received it the same way, whatever the world size
    assert (("rank 0" if ranks == 2 else "ranks 0, 2-3 (3 ranks)") + " received it through "
            "c10d.allreduce_.default in DDP bucket 0's comm hook, in grad-reduce, from rank 1"
            ) in said


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_hook_whose_float16_sum_overflows_is_the_collective(ranks, tmp_path):
    rep = replayed("hook_sum", ranks, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], rep["classification"]) == ("grad-reduce", "communication")
    assert (c["op"], c["parameter"], c["input_dtypes"]) == (AR, "module.head.bias", ["float16"])
    assert how(rep) == {r: ("born-in-collective", AR, []) for r in range(ranks)}
    assert all(r["via"]["dtype"] == "float16" and r["via"]["reduce"] == "sum"
               for r in rep["ranks"])
    said = " ".join(rep["notes"])
    assert "the float16 sum overflowed (over 65504)" in said
    assert all(f"rank {r} 40000" in said for r in range(ranks))   # what each rank fed it


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_row_parallel_float16_all_reduce_overflowing_before_a_layer_norm(ranks, tmp_path):
    rep = replayed("tp_fp16", ranks, tmp_path)
    c = rep["culprit"]
    # not rank 0's layer norm (which made the NaN of the inf): the all-reduce made the inf
    assert (rep["phase"], rep["classification"], rep["kind"]) == ("forward", "communication",
                                                                  "inf")
    assert (c["op"], c["module"], c["module_call"]) == (AR, "mlp.fc2", 0)
    assert rep["inf_origin"]["op"] == AR
    for r in rep["ranks"]:
        assert (r["how"], r["via"]["op"], r["via"]["module"]) == ("born-in-collective", AR,
                                                                  "mlp.fc2")
        assert r["root"]["op"] == AR and r["root"]["input_dtypes"] == ["float16"]
    assert "the float16 sum overflowed (over 65504)" in " ".join(rep["notes"])


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_ranks_nan_carried_by_a_forward_all_to_all(ranks, tmp_path):
    rep = replayed("moe_a2a", ranks, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], c["rank"], c["op"], c["module"]) == ("forward", 1, "aten.div.Tensor",
                                                               "moe")
    paths = how(rep)
    assert paths[1] == ("computed", None, [])
    assert all(paths[r] == ("received", "c10d.alltoall_base_.default", [1])
               for r in range(ranks) if r != 1)
    r0 = rep["ranks"][0]
    assert (r0["via"]["phase"], r0["via"]["module"]) == ("forward", "moe")
    assert r0["root"]["op"] == "c10d.alltoall_base_.default"       # rank 0 has its root too
    said = " ".join(rep["notes"])
    assert (("rank 0" if ranks == 2 else "ranks 0, 2-3 (3 ranks)") + " received it through "
            "c10d.alltoall_base_.default in moe call 0, in forward, from rank 1") in said
    assert "gradient reduction" not in said


def test_fsdp2_float16_reduce_scatter_overflow_names_the_parameter_and_unit(tmp_path):
    rep = replayed("fsdp_fp16_reduce", 4, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], rep["classification"]) == ("grad-reduce", "communication")
    assert (c["op"], c["module"], c["parameter"]) == ("c10d._reduce_scatter_base_.default",
                                                      "layers.1", "layers.1.fc2.bias")
    via = rep["ranks"][0]["via"]
    assert (via["unit"], via["dtype"], via["reduce"], via["params"]) == (
        "layers.1", "float16", "sum", ["layers.1.fc2.bias"])
    assert "(FSDP unit layers.1)" in " ".join(rep["notes"])


def test_fsdp2_cast_into_the_float16_reduce_buffer_overflowing_on_one_rank(tmp_path):
    rep = replayed("fsdp_fp16_cast", 2, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], rep["classification"]) == ("grad-reduce", "communication")
    assert (c["rank"], c["op"], c["module"], c["parameter"]) == (
        1, "fsdp.chunk_cat.default", "layers.1", "layers.1.fc2.bias")
    assert how(rep) == {0: ("received", "c10d._reduce_scatter_base_.default", [1]),
                        1: ("computed", "fsdp.chunk_cat.default", [])}


def test_subgroups_that_issue_different_numbers_of_collectives_still_line_up(tmp_path):
    # ranks 0-1 all-reduce a statistic over their pair first: the world's all-reduce that hands
    # rank 2's NaN to everyone is their 2nd collective and ranks 2-3's 1st
    rep = replayed("subgroup_sqrt", 4, tmp_path)
    c = rep["culprit"]
    assert (rep["phase"], c["rank"], c["op"]) == ("forward", 2, "aten.sqrt.default")
    assert how(rep) == {0: ("received", AR, [2]), 1: ("received", AR, [2]),
                        2: ("computed", None, []), 3: ("received", AR, [2])}
