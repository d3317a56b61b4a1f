"""Remedies: once the culprit is known, replay the step with a few targeted changes and say what
each did (`try_remedies`). Every entry is a replay's outcome (``finite``, ``still-failing``,
``error``) or says why it was not replayed (``skipped``); never an untried suggestion.

What is tried, in this order (an optimizer culprit's optimizer changes first):

- ``optimizer`` (optimizer culprits): the step with the optimizer's eps raised (to 1e-8, or
  100x), then with the gradients clipped to norm 1 (a tenth of the Task's ``clip_grad_norm``);
- ``precision``: the culprit op computed one dtype wider (float16/bfloat16 -> float32,
  float32 -> float64: `upcast.UpcastOp`); when that is not enough, or cannot help (its inputs
  already carry inf), its module call (`upcast.upcast_module`; the smallest module holding both
  the culprit and the op where its inf was born). "Finite" there tells a range problem of the
  dtype from a domain error (a sqrt of a negative is NaN at any precision);
- ``samples``: the step without the batch rows the bad value depends on: those traced through
  the ops (`RowTrace`, ``culprit.samples``), else those found by bisecting the batch (remove
  half of the candidate rows; finite: keep that half; else try the other half; stop at one row
  or when neither half alone is to blame); each row identified (`batch.identify`);
- ``state`` (bundles with a lookback): the same pre-step state with the batch of the step
  before: finite means the batch did it, still failing that the state was already poised.

A budget bounds the extra replays of the step (default 4, `DEFAULT_BUDGET`; a bisection counts
each of its replays); what it leaves out is listed as skipped. Every replay starts from the
pre-step state like any other; the changes are undone before this returns.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager

import torch

from nanbisect.bundle.lookback import Window
from nanbisect.bundle.state import decode
from nanbisect.errors import BadInput
from nanbisect.records import Culprit, OpFinding, Remedy, RowTrace, StepOutcome, module_label
from nanbisect.remedies.batch import drop_rows, identify, row_count
from nanbisect.remedies.upcast import UpcastOp, upcast_module, wider
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.util.env import env_number

__all__ = ["DEFAULT_BUDGET", "budget", "try_remedies", "not_tried"]

DEFAULT_BUDGET = 4
BUDGET_ENV = "NANBISECT_REMEDY_BUDGET"


def budget(requested: int | None = None) -> int:
    """The run's budget of extra replays: ``requested`` (``--remedy-budget``, 0 with
    ``--no-remedies``), else ``NANBISECT_REMEDY_BUDGET`` (a nightly triage's children read it),
    else `DEFAULT_BUDGET`; `BadInput` for a value that is not a count.

    >>> budget(), budget(0)
    (4, 0)
    """
    if requested is not None:
        n = requested
    else:
        n = env_number(BUDGET_ENV, DEFAULT_BUDGET, int, positive=False,
                       what="a number of extra replays (0 or more)",
                       fix="set it to e.g. 4, or 0 to turn remedies off")
    if n < 0:
        raise BadInput(f"a remedy budget of {n} replays; give 0 or more (0: no remedies)")
    return n
Progress = Callable[[str, str], None]


class _Trials:
    """Replays of the step, one change each, counted against the budget."""

    def __init__(self, rep: Replayer, wrap: Callable[[], ContextManager], budget: int,
                 judge: str, progress: Progress) -> None:
        self.rep, self.wrap, self.budget, self.judge = rep, wrap, budget, judge
        self.progress = progress
        self.used = 0

    @property
    def left(self) -> int:
        return self.budget - self.used

    def spent(self, kind: str, change: str) -> Remedy:
        return Remedy(kind, change, "skipped", detail={
            "reason": f"the budget of {self.budget} extra replay(s) of the step was spent "
                      "(raise it with --remedy-budget)"})

    def replay(self, change: str, *, edit: Callable[[Any], Any] | None = None,
               modes: Callable[[], list] = list, on_optimizer: Callable[[], None] | None = None,
               clip: float | None = None, around: Callable[[], ContextManager] = nullcontext
               ) -> tuple[str, float | None, dict]:
        """(outcome, loss, detail) of the step replayed with one change."""
        self.used += 1
        self.progress("remedies", f"remedy replay {self.used}/{self.budget}: the step {change}")
        rep, task = self.rep, self.rep.task
        saved_clip = task.clip_grad_norm
        if edit is not None:
            rep.batch_edits.append(edit)
        ms = modes()

        def phase(name: str) -> ContextManager:
            for m in ms:
                if hasattr(m, "phase"):
                    m.phase = name
            if name == "optimizer" and on_optimizer is not None:
                on_optimizer()
            return nullcontext()
        try:
            if clip is not None:
                task.clip_grad_norm = clip
            with around():
                out: StepOutcome = rep.run(phase=phase, wrap=lambda: stacked(self.wrap(), *ms),
                                           stop_after=self.judge)
        except Exception as e:  # noqa: BLE001 - a change the user's code cannot take: an outcome
            return "error", None, {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        finally:
            task.clip_grad_norm = saved_clip
            if edit is not None:
                rep.batch_edits.remove(edit)
        if out.phase is None:
            return "finite", out.loss, {}
        return "still-failing", out.loss, {"phase": out.phase}


def rows_text(rows: list[int]) -> str:
    """Batch rows as a change names them: runs of consecutive rows as ranges.

    >>> rows_text([5]), rows_text([0, 1, 2, 3, 9])
    ('batch rows [5]', 'batch rows [0-3, 9]')
    """
    runs: list[list[int]] = []
    for r in rows:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    text = ", ".join(parts)
    if len(text) > 80:
        text = text[:80].rsplit(", ", 1)[0] + f", ... ({len(rows)} rows)"
    return f"batch rows [{text}]"


def _at(c: Culprit) -> str:
    """Where the culprit op runs, in words."""
    if c.phase == "optimizer":
        return "in the optimizer step" + (f" (parameter {c.parameter})" if c.parameter else "")
    call = f" (call {c.module_call})" if c.module_call is not None else ""
    back = "backward of " if c.phase == "backward" else ""
    return f"in {back}{module_label(c.module)}{call}"


def _common(a: str, b: str) -> str:
    """The innermost module holding both dotted names ("" the model)."""
    pa, pb, out = a.split(".") if a else [], b.split(".") if b else [], []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _precision(trials: _Trials, c: Culprit, f: OpFinding | None) -> list[Remedy]:
    out: list[Remedy] = []
    dtypes = wider(f.input_dtypes if f is not None else c.input_dtypes)
    if dtypes is None:
        if f is not None:
            out.append(Remedy("precision", f"when {c.op} {_at(c)} runs wider", "skipped", detail={
                "reason": "its inputs are already float64 (or not floating)"}))
        return out
    narrow, wide = dtypes
    wide_name = str(wide).removeprefix("torch.")
    origin = f.inf_origin if f is not None else None
    if f is not None:
        change = f"when {c.op} {_at(c)} runs in {wide_name}"
        if origin is not None:
            out.append(Remedy("precision", change, "skipped", detail={
                "dtype": wide_name, "scope": "op",
                "reason": f"its inputs already carry inf (born in {origin.op}): computing it "
                          "wider cannot help"}))
        elif trials.left <= 0:
            return [trials.spent("precision", change)]
        else:
            outcome, loss, detail = trials.replay(
                change, modes=lambda: [UpcastOp(f.site, wide)])
            out.append(Remedy("precision", change, outcome, loss,
                              {"dtype": wide_name, "scope": "op", **detail}))
            if outcome == "finite":
                return out
    if c.phase not in ("forward", "backward") or c.module_call is None:
        return out
    name, call = c.module, c.module_call
    if origin is not None and (origin.module, origin.module_call) != (c.module, c.module_call):
        name, call = _common(origin.module or "", c.module), None
    what = ("the model's forward" if not name else f"module {module_label(name)}"
            + (f" (call {call})" if call is not None else " (every call)"))
    change = f"when {what} runs in {wide_name}"
    if trials.left <= 0:
        return out + [trials.spent("precision", change)]

    @contextmanager
    def widened_module():
        with upcast_module(trials.rep.task.model, name, call, wide):
            yield

    outcome, loss, detail = trials.replay(change, around=widened_module)
    return out + [Remedy("precision", change, outcome, loss,
                         {"dtype": wide_name, "scope": "module", "module": name,
                          "module_call": call, **detail})]


def _batch(rep: Replayer) -> Any:
    return decode(rep.bundle.manifest["batch"], rep.tensors, "cpu")


def _samples(trials: _Trials, trace: RowTrace | None) -> Remedy:
    rep = trials.rep
    if rep.task.accumulate > 1:
        return Remedy("samples", "without the rows the bad value depends on", "skipped", detail={
            "reason": f"the step's batch is {rep.task.accumulate} micro-batches; rows are "
                      "removed from one-batch steps only"})
    batch = _batch(rep)
    rows = row_count(batch)
    if rows is None or rows < 2:
        return Remedy("samples", "without the rows the bad value depends on", "skipped", detail={
            "reason": "the batch has no tensor with two or more rows"})
    if trace is not None and trace.samples is not None:
        drop = trace.samples
        change = f"without {rows_text(drop)}"
        ids = identify(batch, drop, rows)
        if len(drop) >= rows:
            return Remedy("samples", change, "skipped", detail={
                "rows": drop, "found_by": "trace", "identify": ids,
                "reason": "every row of the batch holds the bad value: none would be left"})
        if trials.left <= 0:
            return trials.spent("samples", change)
        outcome, loss, detail = trials.replay(change, edit=lambda b: drop_rows(b, drop, rows))
        return Remedy("samples", change, outcome, loss,
                      {"rows": drop, "found_by": "trace", "identify": ids, **detail})
    why = trace.why if trace is not None else "no op was isolated to trace them from"
    if trace is not None and trace.why and "no batch row" in trace.why:
        return Remedy("samples", "without the rows the bad value depends on", "skipped",
                      detail={"reason": trace.why})
    return _bisect(trials, batch, rows, why)


def _bisect(trials: _Trials, batch: Any, rows: int, why: str) -> Remedy:
    """Rows found by replaying the step without halves of the candidates."""
    cand, found, loss, tried, stop = list(range(rows)), None, None, [], None
    while len(cand) > 1 and stop is None:
        halves = (cand[:len(cand) // 2], cand[len(cand) // 2:])
        for half in halves:
            if trials.left <= 0:
                stop = "budget"
                break
            outcome, l, detail = trials.replay(f"without {rows_text(half)}",
                                               edit=lambda b, h=half: drop_rows(b, h, rows))
            tried.append({"without": half, "outcome": outcome, **detail})
            if outcome == "error":
                stop = "error"
                break
            if outcome == "finite":
                cand, found, loss = half, half, l
                break
        else:
            stop = "neither half"
    detail = {"found_by": "bisection", "why_not_traced": why, "tried": tried,
              "complete": stop != "budget" and stop != "error"}
    if found is not None:
        if stop == "budget" and len(found) > 1:
            detail["note"] = "the budget ended the bisection before it reached one row"
        return Remedy("samples", f"without {rows_text(found)}", "finite", loss,
                      {"rows": found, "identify": identify(batch, found, rows), **detail})
    change = "without batch rows found by bisecting the batch"
    if not tried:
        return trials.spent("samples", change)
    if stop == "error":
        return Remedy("samples", change, "error", None, {"rows": None, **detail,
                                                           "error": tried[-1].get("error")})
    detail["note"] = ("no half of the batch alone makes the step finite: the rows act "
                      "together, or the failure does not come from the batch"
                      if stop == "neither half" else
                      "the budget ended the bisection before any removal made it finite")
    return Remedy("samples", change, "still-failing", None, {"rows": None, **detail})


def _state(trials: _Trials, window: Window) -> Remedy | None:
    if len(window.steps) < 2:
        return None
    prev = window.steps[-2]
    change = f"with the batch of step {prev['step']} in place of its own (the same state)"
    if trials.left <= 0:
        return trials.spent("state", change)
    rep = trials.rep
    tensors = {k: v for k, v in window.step_tensors(len(window.steps) - 2).items()}

    def other(batch: Any) -> Any:
        b = decode(prev["batch"], tensors, rep.device)
        if rep.dtype is not None:
            b = torch.utils._pytree.tree_map(
                lambda t: t.to(rep.dtype) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t, b)
        return b

    outcome, loss, detail = trials.replay(change, edit=other)
    meaning = {"finite": "the batch did it",
               "still-failing": "the state was already poised"}.get(outcome)
    return Remedy("state", change, outcome, loss, {"step": prev["step"], **detail,
                                                   **({"meaning": meaning} if meaning else {})})


def _optimizer(trials: _Trials) -> list[Remedy]:
    rep, out = trials.rep, []
    groups = rep.task.optimizer.param_groups if rep.task.optimizer is not None else []
    eps = [g["eps"] for g in groups if isinstance(g.get("eps"), (int, float))]
    if eps:
        new = max(1e-8, 100 * max(eps))
        change = f"with the optimizer's eps raised from {max(eps):g} to {new:g}"
        if trials.left <= 0:
            out.append(trials.spent("optimizer", change))
        else:
            def raise_eps():
                for g in rep.task.optimizer.param_groups:
                    if isinstance(g.get("eps"), (int, float)):
                        g["eps"] = max(g["eps"], new)
            outcome, loss, detail = trials.replay(change, on_optimizer=raise_eps)
            out.append(Remedy("optimizer", change, outcome, loss, {"eps": new, **detail}))
    norm = 1.0 if rep.task.clip_grad_norm is None else rep.task.clip_grad_norm / 10
    change = f"with the gradients clipped to norm {norm:g} before the update"
    if trials.left <= 0:
        return out + [trials.spent("optimizer", change)]
    outcome, loss, detail = trials.replay(change, clip=norm)
    return out + [Remedy("optimizer", change, outcome, loss, {"clip_grad_norm": norm, **detail})]


def try_remedies(rep: Replayer, culprit: Culprit, finding: OpFinding | None, *,
                 budget: int = DEFAULT_BUDGET, trace: RowTrace | None = None,
                 window: Window | None = None, wrap: Callable[[], ContextManager] = nullcontext,
                 judge: str = "optimizer", progress: Progress = lambda key, text: None
                 ) -> list[Remedy]:
    """Replay the step with each remedy that applies to ``culprit`` (at most ``budget`` extra
    replays, each under ``wrap``, each run to the end of phase ``judge``: the whole step by
    default); what came of each, in the order tried.

    >>> from nanbisect.bundle.format import read_bundle
    >>> from nanbisect.locate.ops import record_ops
    >>> from nanbisect.locate.producers import make_culprit
    >>> rep = Replayer(read_bundle("fixtures/bundles/optimizer_adam_eps0"), torch.device("cpu"))
    >>> f = record_ops(rep, "optimizer", "nan")
    >>> c = make_culprit(rep.task.model, "optimizer", finding=f)
    >>> [(r.kind, r.outcome) for r in try_remedies(rep, c, f, budget=2)][:2]
    [('optimizer', 'finite'), ('optimizer', 'still-failing')]
    """
    trials = _Trials(rep, wrap, budget, judge, progress)
    out: list[Remedy] = []
    if culprit.phase == "optimizer":
        out += _optimizer(trials)
    out += _precision(trials, culprit, finding)
    out.append(_samples(trials, trace))
    if window is not None:
        state = _state(trials, window)
        out += [state] if state is not None else []
    return out


def not_tried(culprit: Culprit, reason: str, window: bool = False) -> list[Remedy]:
    """The remedies that would apply to ``culprit``, each skipped for ``reason`` (a rank
    replayed in lockstep cannot replay the step again alone)."""
    kinds = (["optimizer"] if culprit.phase == "optimizer" else []) + ["precision", "samples"] \
        + (["state"] if window else [])
    change = {"optimizer": "with the optimizer's eps raised or its gradients clipped",
              "precision": "with the culprit op or its module call computed wider",
              "samples": "without the rows the bad value depends on",
              "state": "with the batch of the step before (the same state)"}
    return [Remedy(k, change[k], "skipped", detail={"reason": reason}) for k in kinds]
