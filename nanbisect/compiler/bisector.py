"""The bisection's own process: ``python -m nanbisect.compiler.bisector BUNDLE OUT.json --device D
[--entry E]`` (started by `nanbisect.compiler.launch`, forked from the fork server).

It rebuilds the bundle's step, hands torch's ``CompilerBisector.do_bisect`` a function that
replays the step compiled from the pre-step state (compiled afresh each time: the bisector
picks the backend and config of every compile) and says whether it stayed finite, then
attributes the op the bisector names (a decomposition's op) to the first module call that runs
it and fails compiled alone. It writes `CompilerFinding` JSON to OUT.json and prints one line per
stage (the bisector's own lines included) on stdout, which the parent shows as progress.

Why a process of its own: the bisector keeps its state in files and in class attributes, and
dynamo its caches in the process; none of it may reach a later ``torch.compile`` of the process
that asked (nor that process's time limit wait on a compile that never ends).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from nanbisect import devices
from nanbisect.bundle.format import read_bundle
from nanbisect.locate.catch import catch_module_call
from nanbisect.records import CallId, CompilerFinding
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.replay.tracker import ModuleTracker
from nanbisect.util import torch_internals as ti
from nanbisect.util.compiled import compile_model, point_debug_output
from nanbisect.util.recordjson import dumps
from nanbisect.util.tensors import nonfinite

MAX_CANDIDATES = 4        # module calls of the culprit op tried compiled alone


def op_of(debug_info: str | None) -> str | None:
    """The op a bisector debug info names (a decomposition's), as ``str()`` of the overload.

    >>> op_of("<OpOverload(op='aten._softmax', overload='default')>")
    'aten._softmax.default'
    >>> op_of("add_2") is None
    True
    """
    return ti.op_of(debug_info)


def bisect(rep: Replayer, phase: str | None) -> tuple[object, float]:
    """torch's bisection of the compiled step; (its `BisectionResult` or None, seconds). A
    failure of the forward is bisected on the forward alone, without autograd (a graph without
    its backward compiles in about half the time)."""
    CompilerBisector = ti.compiler_bisector()
    captured = (rep.compiled_spec or {}).get("backend") or "inductor"
    forward = phase == "forward" and rep.task.accumulate == 1

    def good() -> bool:
        backend = CompilerBisector.get_backend() or captured
        print(f"bisect: compiling with {backend} "
              f"{CompilerBisector.get_subsystem() or ''}".rstrip(), flush=True)
        rep.compile(backend)
        with torch.no_grad() if forward else contextlib.nullcontext():
            return rep.run(stop_after="forward" if forward else "optimizer").phase is None

    t0 = time.perf_counter()
    result = CompilerBisector.do_bisect(good)
    return result, time.perf_counter() - t0


class _OpCalls(ti.ObserverMode):
    """The module calls (innermost) in which ``op`` runs, in order."""

    def __init__(self, op: str, tracker: ModuleTracker) -> None:
        super().__init__()
        self.op, self.tracker, self.calls = op, tracker, []

    def wants(self, func) -> bool:
        return True

    def before(self, call: ti.OpCall) -> bool:
        if call.name == self.op and self.tracker.stack:
            mcall = self.tracker.stack[-1][0]
            if mcall not in self.calls:
                self.calls.append(mcall)
        return False


def _bad(tree) -> int:
    return sum(sum(nonfinite(t.detach())[:2]) for t in ti.tree_leaves(tree)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


def attribute(rep: Replayer, op: str, backend: str) -> CallId | None:
    """The first module call running ``op`` in the eager step whose forward, compiled alone
    with ``backend`` from its caught inputs, makes NaN/inf from finite inputs (else the first
    call running it; None when no module call runs it)."""
    rep.eager()
    tracker = ModuleTracker(rep.task.model)
    mode = _OpCalls(op, tracker)
    rep.run(wrap=lambda: stacked(tracker, mode), stop_after="forward")
    for call in mode.calls[:MAX_CANDIDATES]:
        mc = catch_module_call(rep, call)
        if mc is None or _bad([mc.args, mc.kwargs]):
            continue
        module = rep.task.model.get_submodule(call.module)
        ti.dynamo_reset()
        compiled = compile_model(module, rep.compiled_spec or {}, backend)
        with torch.no_grad():
            if _bad(compiled(*mc.args, **mc.kwargs)):
                return call
    return mode.calls[0] if mode.calls else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanbisect.compiler.bisector")
    ap.add_argument("bundle")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--entry", default=None)
    ap.add_argument("--cache-dir", default=None)     # the asking process's inductor cache
    ap.add_argument("--eager", default="finite")      # what the parent's replays gave
    ap.add_argument("--compiled", default="nan")
    ap.add_argument("--phase", default=None)
    ap.add_argument("--run-top-level", action="store_true")   # the entry's top level may run
    a = ap.parse_args(argv)
    if a.cache_dir:       # its kernels compiled already, not this process's TMPDIR's (empty)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.cache_dir
    if not os.environ.get("TORCH_COMPILE_DEBUG_DIR") and os.environ.get("TMPDIR"):
        # torch's compile debug output (torch_compile_debug/: traces, the minifier), which torch
        # puts in the directory it was imported in: in this process's TMPDIR, which the parent
        # removes
        point_debug_output(os.path.join(os.environ["TMPDIR"], "torch_compile_debug"))
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # small graphs, compiled one after another: a pool of compile workers costs more than
        # it saves
        ti.set_compile_threads(1)
    device, dtype = devices.parse(a.device)   # the argument list's text, decoded once
    print("bisect: building the task", flush=True)
    rep = Replayer(read_bundle(a.bundle), device, dtype, entry=a.entry,
                   run_top_level=a.run_top_level)
    base = dict(eager=a.eager, compiled=a.compiled, phase=a.phase,
                backend=(rep.compiled_spec or {}).get("backend") or "inductor")
    result, seconds = bisect(rep, a.phase)
    if result is None:
        finding = CompilerFinding(**base, seconds=seconds, finished=True, detail=(
            "every backend the bisector tries computed a finite step: the failure does not "
            "come back compiled on every run (a race, a non-deterministic kernel)"))
    else:
        config = ti.bisector_config_change(result.backend, result.subsystem)
        op = op_of(result.debug_info)
        call = None
        if op is not None:
            print(f"bisect: attributing {op} to a module call", flush=True)
            call = attribute(rep, op, result.backend)
        finding = CompilerFinding(
            **{**base, "backend": result.backend}, subsystem=result.subsystem,
            bisect_number=result.bisect_number if not config else None,
            config_change=config,
            detail=(result.debug_info if not config
                    else f"setting {config} makes the compiled step finite"),
            op=op, module=call.module if call else None,
            module_call=call.call if call else None, seconds=seconds, finished=True)
    tmp = Path(a.out + ".part")
    tmp.write_text(dumps(finding.to_json()))
    os.replace(tmp, a.out)
    print("bisect: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
