"""Triage signatures that survive another batch (issue 38, item 8): one bug on one source line is
one signature whichever aten op (or overload) the first NaN shows up in; two lines are two; a
``--known`` list or last night's summary in the older form still matches. In process, on made-up
report.json dicts (the fields `nanbisect.nightly.signatures` reads)."""
from __future__ import annotations

import json

from nanbisect.nightly.cache import CACHE_SCHEMA, Cache
from nanbisect.nightly.signatures import legacy_signature, signature
from nanbisect.nightly.summary import EXIT_KNOWN, EXIT_NEW, NightState

NODE = {"name": "DivBackward0", "forward_op": "aten.div.Tensor",
        "forward_source": "train/contrastive.py:41"}


def report(op: str, *, source: str | None = "/home/a/train/contrastive.py:41",
           node: dict | None = NODE, dtypes=("float32", "float32"), module: str = "",
           phase: str = "backward") -> dict:
    culprit = {"phase": phase, "module": module, "module_call": 0, "op": op, "op_index": 812,
               "rank": 0, "input_dtypes": list(dtypes), "input_shapes": [[8, 8]] * len(dtypes),
               "source": source}
    if node is not None:
        culprit["node"] = node
    return {"schema": "nanbisect.report/1", "verdict": "culprit", "classification": "numerics",
            "culprit": culprit}


def test_one_line_is_one_signature_whichever_op_the_batch_ends_in():
    """The contrastive loss's line: one batch's first NaN is in aten.div.Tensor, another's in
    aten.mul.Tensor (inputs of other dtypes per argument), both in DivBackward0's formula,
    captured from two checkouts: one signature, naming the node and the line."""
    div = report("aten.div.Tensor")
    mul = report("aten.mul.Tensor", source="/ci/job7/train/contrastive.py:41",
                 dtypes=("float32",))
    assert signature(div) == signature(mul) == \
        "DivBackward0 @ contrastive.py:41 · <root> · backward · float32 · numerics"
    assert legacy_signature(div) != legacy_signature(mul)   # what used to split them


def test_without_a_node_the_op_packet_and_line_sign_it():
    """A report without ``culprit.node`` (null or absent): the op without its overload and the
    line; another overload of the same op is the same bug, another op on another line is not."""
    tensor = report("aten.div.Tensor", node=None)
    scalar = report("aten.div.Scalar", node=None, source="contrastive.py:41")
    nulled = {**tensor, "culprit": {**tensor["culprit"], "node": None}}
    assert signature(tensor) == signature(scalar) == signature(nulled) == \
        "aten.div @ contrastive.py:41 · <root> · backward · float32 · numerics"
    assert signature(report("aten.div.Tensor", node=None, source=None)) == \
        "aten.div · <root> · backward · float32 · numerics"


def test_two_lines_are_two_signatures():
    other_line = {**NODE, "forward_source": "train/contrastive.py:57"}
    assert signature(report("aten.div.Tensor")) != signature(report("aten.div.Tensor",
                                                                     node=other_line))
    assert signature(report("aten.div.Tensor", node=None)) != signature(
        report("aten.div.Tensor", node=None, source="/home/a/train/contrastive.py:57"))
    # and the same line in another phase or module is still another failure
    assert signature(report("aten.div.Tensor", phase="forward", node=None)) != signature(
        report("aten.div.Tensor", node=None))
    assert signature(report("aten.div.Tensor", module="layers.3.attn")) == signature(
        report("aten.div.Tensor", module="layers.11.attn")) != signature(
        report("aten.div.Tensor", module="layers.3.mlp"))


def night(known: set, previous: set | None, *reports: dict) -> dict:
    st = NightState([], known, None, {}, "loky", 60.0, previous=previous)
    for i, rep in enumerate(reports):
        st.add({"bundle": f"/night/b{i}", "report": rep}, cached=False)
    return st.data()


def test_a_known_list_in_the_old_form_still_matches():
    """Last night's triage.json (or a --known file) holds the old form of the signature: the two
    bundles are one group tonight, known and seen before; the old form is not written out."""
    div, mul = report("aten.div.Tensor"), report("aten.mul.Tensor")
    old = {legacy_signature(div)}
    data = night(old, old, div, mul)
    (g,) = data["signatures"]
    assert (g["count"], g["known"], g["new_since_last"]) == (2, True, False)
    assert data["exit_code"] == EXIT_KNOWN
    assert all(set(b) >= {"signature"} and "older" not in b for b in data["bundles"])
    fresh = night(set(), set(), div, mul)
    (g,) = fresh["signatures"]
    assert (g["known"], g["new_since_last"], fresh["exit_code"]) == (False, True, EXIT_NEW)
    assert night(set(), None, div)["signatures"][0]["new_since_last"] is None  # first night


def test_reports_cached_before_the_new_signatures_are_misses(tmp_path):
    """A cached report from before backward culprits carried their node would sign the same bug
    another way than a fresh replay: the cache's schema moved on and such an entry is a miss."""
    key = "0" * 64
    (tmp_path / f"{key}.json").write_text(json.dumps(
        {"schema": "nanbisect.triage-cache/1", "key": key, "report": report("aten.div.Tensor")}))
    cache = Cache(tmp_path)
    assert cache.get(key) is None
    cache.put(key, report("aten.div.Tensor"))
    assert json.loads((tmp_path / f"{key}.json").read_text())["schema"] == CACHE_SCHEMA
    assert cache.get(key)["culprit"]["op"] == "aten.div.Tensor"


def test_a_report_triage_cannot_read_is_that_bundles_error_not_the_nights():
    """Triage reads each report.json as a `Report`; one it cannot (a word the contract does
    not have) is that bundle's error row, and the night goes on."""
    st = NightState([], set(), None, {}, "loky", 60.0)
    st.add({"bundle": "/b0", "report": {**report("aten.div.Tensor"),
                                        "classification": "gremlins"}}, cached=False)
    st.add({"bundle": "/b1", "report": report("aten.div.Tensor")}, cached=False)
    assert "/b0" in st.errors and "report.json cannot be read" in st.errors["/b0"]["error"]
    assert st.results["/b1"]["verdict"] == "culprit"
    assert st.results["/b1"]["signature"] == signature(report("aten.div.Tensor"))


LINE_SHIFT_TASK = '''
import torch
import nanbisect


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.sqrt(h).sum(-1)      # BUG: sqrt of negatives


def task():
    torch.manual_seed(0)
    model = Net()
    return nanbisect.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lambda m, b: m(b).mean())
'''


def test_an_edit_above_the_line_keeps_the_signature(tmp_path):
    """Night 1 replays the bug; before night 2 someone adds an import and a comment above the
    line: the line moves, the signature (the function, ``shifted.Net.forward``) does not, and
    night 1's signature or its line form in a --known list still matches night 2's bundle."""
    import torch

    import nanbisect
    from nanbisect.nightly.signatures import line_signature
    from nanbisect.pipeline import RunOptions, run_bundle

    def night_of(source: str, name: str) -> dict:
        d = tmp_path / name
        d.mkdir()
        (d / "shifted.py").write_text(source)
        import importlib.util
        spec = importlib.util.spec_from_file_location("shifted", d / "shifted.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        nanbisect.capture(mod.task(), torch.randn(3, 4, generator=torch.Generator()
                                                  .manual_seed(0)), d / "bundle",
                          entry=f"{d / 'shifted.py'}:task")
        run_bundle(d / "bundle", RunOptions(run_repro=False, remedies=0), d / "report")
        return json.loads((d / "report" / "report.json").read_text())

    first = night_of(LINE_SHIFT_TASK, "night1")
    edited = LINE_SHIFT_TASK.replace("import torch\n", "import math  # noqa: F401\nimport torch\n"
                                     "# numerically careful maths below\n", 1)
    second = night_of(edited, "night2")
    assert first["culprit"]["source"] != second["culprit"]["source"]       # the line moved
    assert first["culprit"]["function"] == second["culprit"]["function"] == "shifted.Net.forward"
    assert signature(first) == signature(second) and "@ shifted.Net.forward" in signature(first)
    assert line_signature(first) != line_signature(second)
    for known in ({signature(first)}, {line_signature(second)}, {legacy_signature(second)}):
        (g,) = night(known, None, second)["signatures"]
        assert g["known"], known
