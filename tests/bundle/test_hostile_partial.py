"""Partial multi-rank bundles (guard/parts.py): ranks that could not write their parts; a
hostile `partial` field is one line, exit 2."""
from __future__ import annotations

import shutil

import pytest

from helpers import invoke
from nanbisect import BadInput
from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.describe import summarize, summary_text
from helpers.hostile import (REASON, edit, multi, partial, reseal_part)


# --------------------------------------------------------------------------------------------
# partial multi-rank bundles (guard/parts.py): ranks that could not write their parts


HOSTILE_PARTIAL = {
    "partial-a-number": (5, "field 'partial' is an integer, not null, an object"),
    "partial-a-list-of-numbers": ([1, 2], "field 'partial' is a list, not null, an object"),
    "partial-missing-a-string": ({"missing_ranks": "1"}, "has missing_ranks a string, not a "
                                 "non-empty increasing list of ranks from 0 to 1"),
    "partial-missing-empty": ({"missing_ranks": []}, "has missing_ranks a list, not"),
    "partial-missing-bool": ({"missing_ranks": [True]}, "has missing_ranks a list, not"),
    "partial-missing-twice": ({"missing_ranks": [1, 1]}, "has missing_ranks a list, not"),
    "partial-missing-beyond-world": ({"missing_ranks": [1, 2]}, "ranks from 0 to 1"),
    "partial-missing-a-listed-rank": ({"missing_ranks": [0, 1]}, "lists 1 parts and 2 missing "
                                      "ranks, not each rank 0..1"),
    "partial-reasons-a-list": ({"missing_ranks": [1], "reasons": ["x"]}, "has reasons a list"),
    "partial-reason-not-text": ({"missing_ranks": [1], "reasons": {"1": 5}}, "has reasons an "
                                "object, not an object of missing rank -> text"),
    "partial-reason-for-a-present-rank": ({"missing_ranks": [1], "reasons": {"0": "x"}},
                                          "not an object of missing rank -> text"),
    "partial-reason-1MB": ({"missing_ranks": [1], "reasons": {"1": "x" * (1 << 20)}},
                           "(at most 4096 characters)"),
    "partial-absent-rank-unlisted": (..., "lists 1 parts, not one per rank 0..1 of its world "
                                     "size 2"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PARTIAL))
def test_hostile_partial_is_one_line_exit_2(tmp_path, case):
    value, phrase = HOSTILE_PARTIAL[case]
    path = partial(tmp_path / "b", value)
    with pytest.raises(BadInput) as ei:
        read_bundle(path)
    msg = str(ei.value)
    assert phrase in msg and "\n" not in msg and len(msg) < 1000, msg
    res = invoke("inspect", path)
    assert res.code == 2 and res.stderr.strip().splitlines() == [f"nanbisect: error: {msg}"]


def test_partial_bundle_inspects_and_run_refuses_it_unless_ranks_are_present(tmp_path):
    path = partial(tmp_path / "b")
    b = read_bundle(path)                           # verified: the part it holds
    assert b.missing_ranks == [1]
    assert REASON in summary_text(summarize(path))
    with pytest.raises(BadInput, match=r"is partial: rank 1 could not write its part .*No space "
                                       r"left on device.*replay the ranks it holds with --ranks 0"):
        b.part(1)
    res = invoke("run", "--ckpt", path)
    assert res.code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "is partial: rank 1 could not write its part when it was captured (rank 1: " \
           "'on host h: No space left on device" in res.stderr
    assert "replay the ranks it holds alone with --ranks 0" in res.stderr
    res = invoke("run", "--ckpt", path, "--ranks", "1")
    assert res.code == 2 and "pass only ranks it holds (--ranks 0)" in res.stderr
    res = invoke("run", "--ckpt", path, "--ranks", "0")   # past the check: this part has no tape
    assert res.code == 2 and "rank 0's part records no collectives" in res.stderr, res.stderr
    assert not (path / "nanbisect-report").exists()


def test_part_taking_tensors_from_a_missing_rank_is_refused(tmp_path):
    """The writer rewrites such a part whole; a manifest that says otherwise is refused."""
    path = multi(tmp_path / "b")
    shutil.rmtree(path / "rank0")
    edit(path / "rank1", lambda m: m.update(shared={"model.safetensors": {
        "rank": 0, "tensors": 1, "bytes": 4}}))
    reseal_part(path, 1)
    edit(path, lambda m: (m["ranks"].pop("0"), m.update(partial={"missing_ranks": [0]})))
    with pytest.raises(BadInput, match="takes tensors of model.safetensors from rank 0, whose "
                                       "part this partial bundle lacks"):
        read_bundle(path)
