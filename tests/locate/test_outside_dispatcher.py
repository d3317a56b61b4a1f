"""Work the op recorder cannot see: a kernel that writes into a tensor's memory without passing
through the dispatcher (tests/tasks/outside_dispatcher.py: NumPy on the buffer, as a pybind,
ctypes or Triton kernel would). The report names the module call and says the value went bad
there outside the dispatcher; the next aten op, handed the NaN, is never the culprit."""
from __future__ import annotations

import nanbisect
import outside_dispatcher
from helpers import TEST_TASKS
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.pipeline.analysis import OUTSIDE_DISPATCHER
from nanbisect.report.prose import headline, terminal


def test_a_kernel_outside_the_dispatcher_is_said_and_the_next_op_is_not_blamed(tmp_path):
    bundle = tmp_path / "bundle"
    nanbisect.capture(outside_dispatcher.task(), outside_dispatcher.batch(), bundle,
                      entry=f"{TEST_TASKS / 'outside_dispatcher.py'}:task")
    r = run_bundle(bundle, RunOptions(remedies=0), tmp_path / "report")
    c = r.culprit
    assert (r.verdict, c.phase, c.module, c.module_call) == ("culprit", "forward", "fused", 0)
    assert c.op is None and c.source is None
    assert OUTSIDE_DISPATCHER in c.likely_cause and "module 'fused' (call 0)" in c.likely_cause
    assert "aten.add.Tensor (op #" in c.likely_cause and "was handed it" in c.likely_cause
    assert "aten.add" not in headline(r)
    assert OUTSIDE_DISPATCHER in terminal(r, tmp_path / "report")
    # what reproduces it: the module call, with the kernel inside
    assert r.module_repro is not None and r.module_repro.result.reproduced
