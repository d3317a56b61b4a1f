"""`nanbisect run --steps K`: replay the last K steps a bundle recorded (`Guard(lookback=...)`) on
the target and on the reference, and find the first step where they part.

Guarantees: both sides start the window from the same state (the bundle's snapshot, or, when the
window starts later than the snapshot, the state the target reached from it) and then each follows
its own trajectory: each step gets its recorded batch, RNG and optimizer hyper-parameters, and the
reference's random ops draw what the target's drew (`RandomTape`). A step *parts* when, after it,
some parameter differs beyond the target dtype's tolerance (`compare.compare_step`), or one side
failed (a non-finite value) and the other did not; ``max_rel_diff`` is the largest, over
parameters, of max|target - reference| / max|reference|. Before the failing step, the target's
state is compared with the bundle's recorded pre-state: on the capture device this is bit for bit
when the Task describes the loop (``reached_recorded``), otherwise the replay does not compute the
recorded steps and says so. The target's pre-state of the first step that parts is kept, so that
step can be bisected alone (`step_bundle`) exactly as a single step is.
Cost: 2 replays of each window step (target, reference) plus one host copy of the target's state
per step (the pre-state of a step that may part).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from nanbisect import devices
from nanbisect.bundle.format import Bundle
from nanbisect.bundle.lookback import BundleView, Window
from nanbisect.bundle.manifest import Manifest
from nanbisect.bundle.state import encode_model, encode_optimizer, local
from nanbisect.errors import BadInput
from nanbisect.records import StepRow, StepsWindow, json_number
from nanbisect.reference.compare import compare_step
from nanbisect.reference.differential import RandomReplay, RandomTape, ReferenceKernels
from nanbisect.reference.side import model_dtype
from nanbisect.replay.replayer import Replayer, stacked
from nanbisect.util.tensors import cast_floating, parts


@dataclass
class WindowResult:
    rows: list[StepRow]
    first_divergent_step: int | None
    advanced: int                         # steps replayed on the target alone before the window
    reached: dict | None                  # the target's pre-state of the failing step vs recorded
    step_view: BundleView | None          # the first step that parts, from the target's pre-state
    notes: list[str] = field(default_factory=list)

    def record(self, failing_prestate_max_rel_diff: float | None) -> StepsWindow:
        """report.json's ``steps``."""
        return StepsWindow(list(self.rows), self.first_divergent_step, self.advanced,
                           self.reached, failing_prestate_max_rel_diff)


def _params(rep: Replayer) -> dict[str, torch.Tensor]:
    return {n: cast_floating(local(p).detach().to(devices.HOST, copy=True), torch.float64)
            for n, p in rep.task.model.named_parameters()}


def _rel(t: dict[str, torch.Tensor], r: dict[str, torch.Tensor]) -> float | None:
    worst = None
    for name, a in t.items():
        b = r.get(name)
        if b is None or a.shape != b.shape or not a.numel():
            continue
        d = (a - b).abs().max().item()
        scale = b.abs().max().item()
        v = d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))
        if v != v:
            v = float("inf")
        worst = v if worst is None else max(worst, v)
    return worst


def _parted(t: dict[str, torch.Tensor], r: dict[str, torch.Tensor], dtype: torch.dtype
            ) -> str | None:
    for name, a in t.items():
        b = r.get(name)
        if b is not None and not compare_step(a, b, dtype).ok:
            return f"param:{name}"
    return None


def _encode_state(rep: Replayer) -> dict[str, torch.Tensor | dict]:
    """The target's state as a bundle stores it (host copies): model, optimizer, scaler."""
    ts: dict = {}
    meta = encode_model(rep.task.model, ts)
    model = Manifest.of(rep.bundle).model
    meta.update({k: model[k] for k in ("training", "frozen") if k in model})
    opt = encode_optimizer(rep.task.optimizer, ts) if rep.task.optimizer is not None else None
    scaler = rep.task.grad_scaler
    sc = None
    if scaler is not None and scaler.is_enabled():
        sc = {k: (float(v) if isinstance(v, float) else v)
              for k, v in scaler.state_dict().items()}
    return {"tensors": ts, "model": meta, "optimizer": opt, "grad_scaler": sc}


def _recorded_gap(rep: Replayer, bundle: Bundle) -> dict:
    """How far the target's state is from the bundle's recorded pre-state of the failing step."""
    rec = bundle.all_tensors()
    worst, exact, compared = 0.0, True, 0
    aliases = Manifest.of(bundle).aliases
    for name, p in rep.task.model.named_parameters():
        saved = rec.get(f"model/{aliases.get(name, name)}")
        if saved is None or saved.shape != local(p).shape:
            continue
        a = local(p).detach().to(devices.HOST)
        compared += 1
        if a.dtype != saved.dtype or not torch.equal(a, saved):
            exact = False
            a, saved = parts(a).double(), parts(saved).double()    # complex: part by part
            d = (a - saved).abs().max().item()
            s = saved.abs().max().item()
            worst = max(worst, d / s if s > 0 else float("inf"))
    return {"bit_exact": exact and compared > 0, "max_rel_diff": json_number(worst),
            "parameters": compared}


def _loss(outcome) -> float | str | None:
    return json_number(outcome.loss)


def replay_window(bundle: Bundle, window: Window, k: int, target: tuple, reference: tuple,
                  wrap: Callable[[], ContextManager], entry: str | None,
                  history: dict[int, float] | None = None,
                  progress: Callable[[str], None] = lambda text: None, *,
                  run_top_level: bool = False) -> WindowResult:
    """Replay the last ``k`` of ``window``'s steps on ``target`` and ``reference`` ((device,
    dtype) pairs); see the module's guarantees. ``run_top_level``: `Replayer`'s."""
    n = len(window.steps)
    if not 1 <= k <= n:
        raise BadInput(f"--steps {k}: bundle '{bundle.path}' recorded {n} step(s) "
                       f"(steps {window.steps[0]['step']}..{window.steps[-1]['step']}); pass "
                       f"--steps between 1 and {n}")
    views = _views(bundle, window)
    t_rep = Replayer(views[0], target[0], target[1], entry=entry, run_top_level=run_top_level)
    r_rep = Replayer(views[0], reference[0], reference[1], entry=t_rep.entry,
                     run_top_level=t_rep.run_top_level)
    t_dtype = model_dtype(t_rep)
    first = n - k
    notes: list[str] = []
    _advance(bundle, window, views, k, t_rep, r_rep, wrap, progress)
    rows: list[StepRow] = []
    divergent, pre_state, step_state, reached = None, None, None, None
    for i in range(first, n):
        step = window.steps[i]["step"]
        keep = i > 0
        progress(f"step {step} ({i - first + 1}/{k}) on the target and the reference")
        if divergent is None:
            pre_state = _encode_state(t_rep) if keep else None
        if i == n - 1 and keep:
            reached = _recorded_gap(t_rep, bundle)
        tape = RandomTape()
        t_rep.next_step(views[i])
        t_out = t_rep.run(wrap=lambda: stacked(wrap(), tape), keep_state=keep)
        r_rep.next_step(views[i])
        r_out = r_rep.run(wrap=lambda: stacked(ReferenceKernels(), RandomReplay(tape)),
                          keep_state=keep)
        t_params, r_params = _params(t_rep), _params(r_rep)
        failed_t, failed_r = t_out.phase is not None, r_out.phase is not None
        why = None
        if failed_t != failed_r:
            why = f"{'target' if failed_t else 'reference'} failed ({t_out.phase or r_out.phase})"
        elif not failed_t:
            why = _parted(t_params, r_params, t_dtype)
        rows.append(StepRow(step, _loss(t_out), _loss(r_out),
                            json_number((history or {}).get(step)),
                            json_number(_rel(t_params, r_params)), why is not None, why))
        if why is not None and divergent is None:
            divergent, step_state = step, pre_state
        if failed_t or failed_r:
            if i < n - 1:
                notes.append(f"the {'target' if failed_t else 'reference'} failed at step "
                             f"{step}; the window's later steps were not replayed")
            break
    view = None
    if divergent is not None and divergent != window.steps[-1]["step"]:
        view = _divergent_view(bundle, window, views, divergent, step_state)
    reached = _reached(window, rows, reached, notes)
    return WindowResult(rows, divergent, first, reached, view, notes)


def _views(bundle: Bundle, window: Window) -> list[BundleView]:
    """Each window step's bundle: the snapshot's state with the first step's inputs, then each
    later step's inputs."""
    first = window.state_view(bundle)
    return [first] + [first.with_step(window, i) for i in range(1, len(window.steps))]


def made_in(bundle: Bundle, window: Window, target: tuple, wrap: Callable[[], ContextManager],
            entry: str | None, progress: Callable[[str], None] = lambda text: None, *,
            run_top_level: bool = False) -> tuple[int, BundleView] | None:
    """The window's first step, before the failing one, that fails on ``target`` alone (a
    forward that makes a buffer non-finite counts), replayed from the snapshot: (that step, a
    one-step bundle of its pre-state); None when every earlier step stays finite, or the
    snapshot itself already holds the values. Where a failing step's non-finite pre-state was
    made (`nanbisect.pipeline.steps.trace_back`)."""
    n = len(window.steps)
    views = _views(bundle, window)
    rep = Replayer(views[0], target[0], target[1], entry=entry, run_top_level=run_top_level)
    for i in range(n - 1):
        step = window.steps[i]["step"]
        progress(f"step {step} ({i + 1}/{n - 1}) on the target")
        pre = _encode_state(rep) if i > 0 else None
        rep.next_step(views[i])
        out = rep.run(wrap=wrap, keep_state=i > 0)
        if out.phase == "input":
            return None
        if out.phase is not None:
            return step, _divergent_view(bundle, window, views, step, pre)
    return None


def _advance(bundle: Bundle, window: Window, views: list, k: int, t_rep: Replayer,
             r_rep: Replayer, wrap, progress) -> None:
    """The steps before the window's start, on the target alone; then the reference starts
    where the target is."""
    n, first = len(window.steps), len(window.steps) - k
    for i in range(first):
        progress(f"advancing to the window: step {window.steps[i]['step']} on the target")
        t_rep.next_step(views[i])
        out = t_rep.run(wrap=wrap, keep_state=i > 0)
        if out.phase is not None:
            raise BadInput(f"bundle '{bundle.path}': the target failed ({out.phase}) at step "
                           f"{window.steps[i]['step']}, before the window of --steps {k} "
                           f"starts; pass --steps {n - i} or more")
    if first == 0:
        return
    with torch.no_grad():
        r_rep.restore()
        r_rep.task.model.load_state_dict(t_rep.task.model.state_dict())
        if r_rep.task.optimizer is not None:
            # NB: a copy: load_state_dict keeps tensors already on the right device and
            # dtype as they are, and the two sides would update one Adam moment twice
            r_rep.task.optimizer.load_state_dict(
                copy.deepcopy(t_rep.task.optimizer.state_dict()))
        if r_rep.task.grad_scaler is not None and t_rep.task.grad_scaler is not None:
            r_rep.task.grad_scaler.load_state_dict(t_rep.task.grad_scaler.state_dict())


def _divergent_view(bundle: Bundle, window: Window, views: list, divergent: int,
                    step_state: dict | None) -> BundleView:
    """The first step that parts, as a one-step bundle from the target's pre-state of it."""
    i = [s["step"] for s in window.steps].index(divergent)
    if step_state is None:        # the window's first step: the snapshot itself
        view = views[i]
    else:
        m = {**views[i].manifest, "model": step_state["model"],
             "optimizer": step_state["optimizer"], "grad_scaler": step_state["grad_scaler"],
             "observed": None}
        inputs = window.step_tensors(i)
        view = BundleView(bundle.path, m, view={**step_state["tensors"], **inputs})
    return BundleView(view.path, {**view.manifest, "observed": None}, view=view.view)


def _reached(window: Window, rows: list[StepRow], reached: dict | None,
             notes: list[str]) -> dict | None:
    """Whether the target's replay reached the recorded pre-state of the failing step (and the
    notes when it did not, or when a step's loss is not the one the guarded run recorded)."""
    # on the capture device each replayed step gives the loss the guarded run recorded
    off = next((r for r in rows if r.original_loss is not None and r.target_loss is not None
                and r.target_loss != r.original_loss), None)
    if off is not None:
        notes.append(f"the target's replay of step {off.step} gives loss {off.target_loss}, not "
                     f"the {off.original_loss} the guarded run recorded")
    if reached is None and rows and rows[-1].step != window.steps[-1]["step"]:
        reached = {"bit_exact": False, "max_rel_diff": None, "parameters": 0,
                   "stopped_at": rows[-1].step}    # it never got to the failing step
    if reached is not None:
        reached["first_step_off_history"] = off.step if off is not None else None
        if not reached["bit_exact"]:
            gap = (f"max relative difference {reached['max_rel_diff']}"
                   if reached.get("max_rel_diff") is not None else
                   f"it stopped at step {reached.get('stopped_at')}")
            notes.append(f"the target's replay of the window does not reach the recorded "
                         f"pre-state of the failing step bit for bit ({gap}): on the capture "
                         "device that means the loop does something between steps that the Task "
                         "does not describe (an EMA, a freeze, a mode switch)")
    return reached
