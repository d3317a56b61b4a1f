"""nanbisect.records.codec: the rank file's one codec, derived from RankResult's typed fields:
what a worker writes, its launcher reads back equal, non-finite numbers included."""
from __future__ import annotations

import json

from nanbisect.records import (BadValue, Bucket, ContextRow, Crossing, Culprit, OpCheck, OpRef,
                               Plan, RankReference, RankResult, RankRoot, Remedy, StageError,
                               Stats)
from nanbisect.records.codec import decode, encode
from nanbisect.records.ranks import RankSummary
from nanbisect.util.recordjson import dumps


def _full() -> RankResult:
    inf = float("inf")
    crossing = Crossing(3, "c10d.allreduce_.default", "backward", "fc", 0, [0, 1], "float32",
                        "sum", 1, 0, 0, 0, params=["fc.weight"], bucket=0)
    return RankResult(
        rank=1, plan=Plan("backward", 1, True),
        summary=RankSummary(1, "backward", "nan", "nan",
                            [Bucket(0, ["fc.weight"], 1, 0, 2, 0)],
                            [BadValue("batch", "x", 1, 0, 4)], [crossing]),
        root=RankRoot("aten.mul.Tensor", 7, "fc", 0, ["float32"], [[2, 3]], False),
        module_stats={"fc": Stats(1, 0, 0, inf, 2.5), "head": None},
        culprit=Culprit("backward", "fc", 0, ["float32"], [[2, 3]], None, "aten.mul.Tensor", 7,
                        rank=1),
        context=[ContextRow(7, "aten.mul.Tensor", "fc", 0, "backward", True, False, None, True)],
        inf_origin=OpRef("aten.exp.default", 5, "forward", "fc", 0),
        repro="/tmp/r", reference=RankReference(None, 0.5, "grad:fc.weight", "inf"),
        op_check=OpCheck("aten.mul.Tensor", 7, "mismatch", "kernel", detail="differs"),
        classification="kernel", classification_notes=["a note"], received_from=[0],
        recorded_input_bad=True, served_inputs_differ=[2],
        remedies=[Remedy("upcast", "when fc runs in float64", "finite", 0.5, {"dtype": "float64"})],
        errors=[StageError("repro", "it broke")])


def test_a_rank_file_reads_back_equal():
    r = _full()
    text = dumps(r.to_json())
    assert "Infinity" not in text and "NaN" not in text        # strict JSON
    back = RankResult.from_json(json.loads(text))
    assert back == r
    assert back.module_stats["fc"].absmax == float("inf")       # a number again, not "inf"
    assert back.summary.loss == "nan"      # a field typed float | str keeps its word


def test_a_field_the_writer_left_out_takes_its_default_and_an_unknown_key_is_ignored():
    back = decode(RankResult, {"rank": 2, "error": "boom", "later": 1})
    assert back == RankResult(2, error="boom")
    assert encode(RankResult(2))["remedies"] == []
