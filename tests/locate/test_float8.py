"""Narrow dtypes wherever a tensor is read (float8: no aminmax, amax, isinf or norm kernel on the
CPU), and an internal failure never blamed on the user's code."""
from __future__ import annotations

import pytest
import torch

import float8_lora
import nanbisect
from helpers import TEST_TASKS
from nanbisect.errors import BadInput
from nanbisect.pipeline import RunOptions, run_bundle

FP8 = [d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2"))
       if d is not None]


def _capture(tmp_path):
    bundle = tmp_path / "bundle"
    nanbisect.capture(float8_lora.task(), float8_lora.batch(), bundle,
                      entry=f"{TEST_TASKS / 'float8_lora.py'}:task")
    return bundle


def test_a_float8_quantisation_is_bisected_to_its_division(tmp_path):
    """The LoRA layer's row-wise float8 scale is 0 (``lora_B`` starts at zero): 0/0 in the
    quantisation, read through float8 values by every pass (the recorder, the probe, the
    catch, the rows)."""
    r = run_bundle(_capture(tmp_path), RunOptions(run_repro=False, remedies=0),
                   tmp_path / "report")
    c = r.culprit
    assert (r.verdict, c.phase, c.module, c.op) == ("culprit", "forward", "lora",
                                                     "aten.div.Tensor")
    line = next(i for i, t in enumerate((TEST_TASKS / "float8_lora.py").read_text()
                                        .splitlines(), 1) if "BUG" in t)
    assert c.source.endswith(f"float8_lora.py:{line}") and "0/0" in c.likely_cause
    assert r.errors == []


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_statistics_read_float8_values(dtype):
    from nanbisect.replay.probe import tensor_stats
    from nanbisect.replay.recorder import OpRecorder
    from nanbisect.replay.replayer import _scan
    from nanbisect.util.tensors import finite_absmax, nonfinite

    t = torch.tensor([1.5, -2.0, float("nan"), 0.0]).to(dtype)
    assert nonfinite(t)[0] == 1
    assert float(finite_absmax(t)) == 2.0
    assert tensor_stats(t).tolist()[:4] == [1.0, 0.0, 0.0, 2.0]
    assert [b.nan for b in _scan("grad", [("w", t)], fused=True)] == [1]
    rec = OpRecorder(None, {"forward"})
    with rec:
        (t.float() * 2).to(dtype)
    table, _ = rec.read()
    assert table.ops[-1].outputs[0].flags.nan


def test_an_internal_failure_is_not_blamed_on_the_entry(tmp_path, monkeypatch):
    """A failure inside nanbisect's own work (here: the recorder's statistics) propagates as
    itself (the CLI's internal error, exit 4), not as "the entry's code fails on this bundle";
    the user's own failure still is that one line."""
    import nanbisect.replay.recorder as recorder

    bundle = _capture(tmp_path)
    # a bug of the recorder's own: the helper it reads values with is gone (TypeError there)
    monkeypatch.setattr(recorder, "parts", None)
    with pytest.raises(TypeError, match="not callable"):
        run_bundle(bundle, RunOptions(run_repro=False, remedies=0), tmp_path / "r1")
    monkeypatch.undo()

    entry = tmp_path / "fails.py"
    entry.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TEST_TASKS)!r})\n"
        "import float8_lora\n\n\n"
        "def task():\n"
        "    t = float8_lora.task()\n\n"
        "    def loss(m, b):\n"
        "        raise ValueError('the user loss is broken')\n"
        "    t.loss_fn = loss\n"
        "    return t\n")
    with pytest.raises(BadInput, match="the user loss is broken.*fails.py:10.*fix it"):
        run_bundle(bundle, RunOptions(run_repro=False, remedies=0, entry=f"{entry}:task"),
                   tmp_path / "r2")
