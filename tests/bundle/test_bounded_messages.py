"""Every message that quotes a bundle is bounded (issue 39, item 5): a list of ranks is shown as
ranges and a count, the first `MAX_RANGES` ranges and how many more; a quoted string is cut
short; no line of `inspect`, of `run`'s stderr, of report.md or of triage's summary grows with
what the manifest holds.

The hostile bundle is real: a two-rank bundle made partial (`test_hostile.partial`), then given a
world of 2**20 with ranks 1..1,048,575 missing (an 8.3 MB ``missing_ranks``), 1,000 reasons of
4,096 characters each with newlines and ESC in them, and process groups of 2**20 and 2**19
ranks (the second every other rank: 524,288 ranges). Before this, `inspect` printed it as an
8.3 MB line and `run` as an 8.3 MB stderr line.

The bound every test checks: `LINE` (1,000) characters a line. ``inspect --json`` stays the
summary whole (machine-readable: the full ``missing_ranks``), bounded by the manifest's own caps
(64 MiB, 4M JSON values).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import cli
from nanbisect.util.text import MAX_RANGES, clip, ranges, ranks_arg, ranks_text, runs
from helpers.hostile import edit, partial

LINE = 1000                      # the longest line any message below may have
MAX_NOTE = 2000                  # a note of report.md (report.prose.MAX_NOTE)
MAX_ERROR = 1000                 # triage's error row (triage.summary.MAX_ERROR)
WORLD = 1 << 20                  # MAX_WORLD_SIZE
MISSING = WORLD - 1              # ranks 1..1,048,575: 8.3 MB of JSON
HOSTILE_REASON = "\x1b[2J\n" + "r" * 4090    # 4,096 characters (schema.MAX_REASON)
FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def longest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> Path:
    """The hostile partial bundle (module docstring); ~4 s to build."""
    d = partial(tmp_path_factory.mktemp("bounded") / "b")
    reasons = {str(r): HOSTILE_REASON for r in range(1, 1001)}
    edit(d, lambda m: m.update(world_size=WORLD, partial={
        "missing_ranks": list(range(1, WORLD)), "reasons": reasons},
        process_groups={"world": list(range(WORLD)), "evens": list(range(0, WORLD, 2)),
                        "g" * 5000: [0]}))
    assert (d / "manifest.json").stat().st_size > 20 << 20
    return d


# --------------------------------------------------------------------------------------------
# the terminal: inspect and run


@pytest.mark.slow
def test_inspect_shows_a_million_missing_ranks_as_one_range_and_a_count(huge):
    res = cli("inspect", huge)
    assert res.code == 0, res.stderr[-2000:]
    assert longest(res.stdout) < LINE and len(res.stdout) < 20 * LINE, longest(res.stdout)
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("partial   ")]
    assert line.startswith("partial   ranks 1-1048575 (1,048,575 ranks) could not write their "
                           "parts (rank 1: '\\x1b[2J\\nrrr"), line
    assert "; rank 2: '\\x1b[2J\\nrrr" in line and "; 998 more reasons)" in line
    assert line.endswith("; replay the others with --ranks")
    assert "\x1b" not in res.stdout                   # no terminal escape gets through
    (groups,) = [x for x in res.stdout.splitlines() if x.startswith("groups    ")]
    assert groups.startswith("groups    world: [0-1048575]; evens: [0, 2, 4, 6, ... and "
                             "524,284 more ranges]; gggg"), groups


def test_inspect_json_keeps_the_whole_list(huge):
    """Machine-readable and complete: the JSON is the manifest's field as it is."""
    res = cli("inspect", "--json", huge)
    assert res.code == 0, res.stderr[-2000:]
    info = json.loads(res.stdout)
    assert info["partial"]["missing_ranks"] == list(range(1, WORLD))
    assert len(res.stdout) < 4 * (huge / "manifest.json").stat().st_size


@pytest.mark.slow
def test_run_refuses_it_in_one_bounded_line(huge):
    res = cli("run", "--ckpt", huge)
    assert res.code == 2, res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert len(line) < LINE, len(line)
    assert "is partial: ranks 1-1048575 (1,048,575 ranks) could not write their parts when it " \
           "was captured (rank 1: '\\x1b[2J\\nrrr" in line, line
    assert line.endswith("...'); replay the ranks it holds alone with --ranks 0"), line
    res = cli("run", "--ckpt", huge, "--ranks", "0,5,6,7,9")
    (line,) = res.stderr.strip().splitlines()
    assert res.code == 2 and len(line) < LINE, line
    assert "--ranks names ranks 5-7, 9 (4 ranks), which could not write their parts" in line, line
    assert line.endswith("pass only ranks it holds (--ranks 0)"), line


# --------------------------------------------------------------------------------------------
# report.md, the terminal summary of a run, and triage


def hostile_replicas() -> dict:
    name = "model:" + "w" * 100_000 + "\n# injected heading"
    return {"groups": [list(range(WORLD))], "shared_bytes": 1, "shared_tensors": 1,
            "out_of_sync_count": 50, "uncompared": list(range(0, WORLD, 3)),
            "out_of_sync": [{"tensor": name, "ranks": [[0]] + [[r] for r in range(1, 1000)],
                             "missing": list(range(1000, WORLD, 2)),
                             "max_abs_diff": "x" * 100_000} for _ in range(50)]}


def test_report_notes_quoting_replicas_are_bounded(tmp_path):
    from nanbisect.bundle.describe import replicas_text
    from nanbisect.records import Losses, RunFacts
    from nanbisect.report.model import Report
    from nanbisect.report.prose import terminal, to_markdown

    rep = hostile_replicas()
    text = replicas_text(rep)
    assert len(text) < LINE and "\n" not in text, len(text)
    assert text.startswith("data-parallel group(s) [0-1048575]; 1 bytes"), text[:200]
    assert text.endswith("; ranks 0, 3, 6, 9, 12, 15, 18, 21, ... and 349,518 more ranges "
                         "(349,526 ranks) not compared tensor by tensor"), text[-200:]
    assert "; 50 tensor(s) out of sync: model:wwww" in text and ") and 48 more; " in text
    assert "(ranks 0 vs 1 vs 2 vs ... (1,000 groups), missing on ranks 1000, 1002, ... and " \
           "523,786 more ranges (523,788 ranks), max |diff| xxxx" in text
    facts = RunFacts("b", "t.py:" + "e" * 10_000, "cpu", "none", None, Losses(1.5, 1.5))
    r = Report("clean", None, None, None, None, facts).with_replicas(rep)
    (note,) = r.notes
    assert note.startswith("replicas out of sync on ranks 1-1000, 1002, 1004, 1006, 1008, 1010, "
                           "1012, 1014, ... and 523,780 more ranges (524,787 ranks) (vs 0): ")
    assert len(note) < MAX_NOTE and "\n" not in note and note.endswith(") and 47 more"), note
    md = to_markdown(r)
    assert longest(md) < MAX_NOTE and "injected" not in md, longest(md)
    assert "- entry: `t.py:eeee" in md and "(9,705 more characters)`" in md
    assert longest(terminal(r, tmp_path)) < MAX_NOTE


@pytest.mark.slow
def test_triage_error_row_of_the_hostile_bundle_is_bounded(huge, tmp_path):
    """A real triage over a night holding the bundle: its row is `run`'s one bounded line, in
    triage.md and triage.json alike."""
    night = tmp_path / "night"
    night.mkdir()
    shutil.copytree(huge, night / "huge")
    res = cli("triage", night, "--out", tmp_path / "t", "--jobs", "1", "--timeout", "300",
              env={"TMPDIR": str(tmp_path)})
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    data = json.loads((tmp_path / "t" / "triage.json").read_text())
    (row,) = data["errors"]
    assert "ranks 1-1048575 (1,048,575 ranks) could not write their parts" in row["error"]
    assert len(row["error"]) < LINE, len(row["error"])
    md = (tmp_path / "t" / "triage.md").read_text()
    assert longest(md) < LINE + 200 and "(1,048,575 ranks)" in md, longest(md)


def test_triage_summary_caps_any_error_row(tmp_path):
    """Whatever a worker says (a message from a newer nanbisect, a library's text quoting the
    bundle), triage.md, triage.json and index.html get one bounded line."""
    from nanbisect.nightly.summary import NightState, to_markdown

    s = NightState([tmp_path], set(), tmp_path / "out", {}, "local", 60.0)
    s.add({"bundle": str(tmp_path / "b"), "error": "bad " + "\n\x1b[31m" * 100_000,
           "kind": "bad-input"}, False)
    (row,) = s.errors.values()
    assert len(row["error"]) < MAX_ERROR + 50 and row["error"].isprintable()
    data = {"signatures": [{"count": 1, "signature": "s" * 100_000, "remedies": [],
                            "first_seen": None, "example": "b", "known": False}],
            "errors": list(s.errors.values()), "bundles": [], "exit_code": 3}
    md = to_markdown(data)
    assert longest(md) < MAX_ERROR + 200, longest(md)


# --------------------------------------------------------------------------------------------
# the helpers


def expand(shown: str) -> set[int]:
    """The ranks ``ranges`` shows (untruncated)."""
    out: set[int] = set()
    for part in shown.split(", "):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


rank_lists = st.lists(st.integers(0, WORLD - 1), max_size=300) | st.builds(
    lambda starts: [r for s in starts for r in range(s, s + 5)],
    st.lists(st.integers(0, WORLD - 10), max_size=40))


@FAST
@given(rank_lists, st.integers(1, 12))
def test_ranges_expand_back_to_the_ranks_and_count_them(ranks, limit):
    shown, n_runs = ranges(ranks, limit), len(runs(ranks))
    text = ranks_text(ranks, limit)
    assert len(shown) <= limit * 16 + 40 and len(text) <= limit * 16 + 70
    if not ranks:
        assert shown == "-"
        return
    count = len(set(ranks))
    if count == 1:
        assert text == f"rank {ranks[0]}"
    else:
        assert text.endswith(f" ({count:,} ranks)") and text.startswith(f"ranks {shown} (")
    if n_runs <= limit:
        assert expand(shown) == set(ranks) and "more" not in shown
    else:
        head, more = shown.rsplit(", ... and ", 1)
        assert more == f"{n_runs - limit:,} more ranges"
        assert expand(head) == {r for a, b in runs(ranks)[:limit] for r in range(a, b + 1)}


@FAST
@given(rank_lists)
def test_runs_are_disjoint_sorted_and_cover_the_ranks(ranks):
    rs = runs(ranks)
    assert all(a <= b for a, b in rs) and all(b + 1 < c for (_, b), (c, _) in zip(rs, rs[1:]))
    assert sum(b - a + 1 for a, b in rs) == len(set(ranks))


@FAST
@given(st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=40))
def test_ranks_arg_is_a_ranks_flag_or_says_how_many(ranks):
    arg = ranks_arg(ranks)
    if len(set(ranks)) <= 16:
        assert sorted(map(int, arg.split(","))) == sorted(set(ranks))
    else:
        assert arg.startswith("R,... (any of ranks ") and f"({len(set(ranks))} ranks))" in arg


@FAST
@given(st.text(max_size=3000), st.integers(1, 600))
def test_clip_is_one_printable_line_of_at_most_limit_characters(text, limit):
    out = clip(text, limit)
    assert out.isprintable()
    if text.isprintable() and len(text) <= limit:
        assert out == text
        return
    m = re.fullmatch(r"(.*)\.\.\. \(([\d,]+) more characters\)", out, re.S)
    if m is None:                       # control characters shown escaped, within the limit
        assert len(out) <= limit and out.encode().decode("unicode_escape", "replace")
    else:
        assert len(m.group(1)) <= limit and 1 <= int(m.group(2).replace(",", "")) <= len(text)


def test_max_ranges_is_what_messages_show():
    assert ranges(range(0, 100, 2)).count(", ") == MAX_RANGES


def test_the_bounds_named_here_are_the_modules():
    from nanbisect.report import prose as text
    from nanbisect.nightly import summary
    assert (text.MAX_NOTE, summary.MAX_ERROR) == (MAX_NOTE, MAX_ERROR)
