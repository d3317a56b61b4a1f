"""`Guard(lookback=K)`: the state of a step up to 2K steps back plus every later step's batch, RNG
and optimizer hyper-parameters, so a bundle can replay the steps that led to its failure
(`nanbisect run --steps K`, `nanbisect.replay.window`).

Guarantees: two snapshots of the pre-step state (parameters, buffers, optimizer state, the
GradScaler's scale and growth tracker), refreshed every K steps, the older kept, so at any failure
the bundle holds at least K steps ending with the failing one (fewer only when training has not
run K steps yet). Copies are device-to-device (``kept_on="device"``, no host synchronisation) or
into host memory (``"cpu"``, pinned and asynchronous from an accelerator); a refresh costs one
copy of the state, amortised over K steps. Memory: 2 x (parameters + buffers + optimizer state)
plus up to 2K batches, where ``kept_on`` says. Each step's batch is copied (a loop that refills
one buffer keeps its values), its RNG state kept, and its parameter groups' hyper-parameters
(learning rate, betas, weight decay: what a scheduler changes between steps) recorded.
Not guaranteed: what the loop changes between steps outside the Task and the optimizer's groups
(an EMA of the weights, a freeze, a train/eval switch): a replay from the snapshot then does
not reach the recorded pre-state of the failing step, which `run --steps` reports.
Not supported yet: under torch.distributed (refused at construction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanbisect import devices
from nanbisect.bundle.check import MAX_LOOKBACK_STEPS, lookback_steps
from nanbisect.bundle.format import Bundle
from nanbisect.bundle.state import (RngState, Tensors, encode, encode_model, encode_optimizer,
                                    hyper_parameters, local)
from nanbisect.errors import BadInput
from nanbisect.util import torch_internals as ti

ROLE = "lookback"
SCHEMA = 1
KEPT_ON = ("device", "cpu")


def _keeper(kept_on: str):
    """The copy function of a kept tensor: on its device, or in (pinned) host memory."""
    if kept_on == "device":
        return lambda t: local(t).detach().clone()

    def host(t: torch.Tensor) -> torch.Tensor:
        t = local(t).detach()
        dt = devices.entry(t.device)
        if dt.host_reads_free:
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device=devices.HOST,
                          pin_memory=dt.pinned_host_memory)
        return out.copy_(t, non_blocking=True)   # complete by the step's host synchronisation
    return host


def _prefixed(prefix: str, tensors: Tensors) -> Tensors:
    return {f"{prefix}{k}": v for k, v in tensors.items()}


@dataclass
class Snap:
    """A snapshot of a step's pre-state as `encode_model`/`encode_optimizer` describe it (its
    tensors here, or where the keeper put them: `nanbisect.guard.keep`)."""

    step: int
    model: dict
    optimizer: dict | None
    scaler: dict | None
    modes: dict
    tensors: Tensors | None = None
    seconds: float = 0.0          # what taking it cost


@dataclass
class _Step:
    step: int
    rng: RngState
    groups: Any       # encoded hyper-parameters
    batch: Any        # encoded batch
    tensors: Tensors


class Lookback:
    """The Guard's side: `begin` before each step, `end` after it, `encode` into a bundle."""

    def __init__(self, k: int, kept_on: str = "device") -> None:
        if type(k) is not int or k < 1:
            raise BadInput(f"Guard(lookback={k!r}): give a number of steps >= 1")
        if kept_on not in KEPT_ON:
            raise BadInput(f"Guard(lookback_on={kept_on!r}): give 'device' or 'cpu'")
        self.k, self.kept_on = k, kept_on
        self._copy = _keeper(kept_on)
        self._snaps: list[Snap] = []     # oldest first, at most two
        self._steps: list[_Step] = []
        self._groups: Any = None
        self._gtensors: Tensors = {}

    def begin(self, step: int, model: torch.nn.Module, opt, scaler) -> None:
        if not self._snaps or step - self._snaps[-1].step >= self.k:
            self._snaps = [*self._snaps[-1:], self._take(step, model, opt, scaler)]
            first = self._snaps[0].step
            self._steps = [s for s in self._steps if s.step >= first]
        self._gtensors = {}
        self._groups = encode(hyper_parameters(opt), "groups", self._gtensors, self._copy)

    def end(self, step: int, rng: RngState, batch: Any) -> None:
        # a step that failed was rolled back: a loop that goes on runs that step index again
        self._steps = [s for s in self._steps if s.step < step]
        ts = dict(self._gtensors)
        meta = encode(batch, "batch", ts, self._copy)
        self._steps.append(_Step(step, rng, self._groups, meta, ts))

    def _take(self, step: int, model, opt, scaler) -> Snap:
        ts: Tensors = {}
        meta = encode_model(model, ts, self._copy)
        opt_meta = encode_optimizer(opt, ts, self._copy) if opt is not None else None
        sc = None
        if scaler is not None and scaler.is_enabled():
            scale, tracker = ti.scaler_tensors(scaler)
            sc = ti.scaler_settings(scaler)
            if scale is not None:
                ts["scaler/scale"], ts["scaler/tracker"] = scale.clone(), tracker.clone()
        modes = {"training": {n: m.training for n, m in model.named_modules()},
                 "frozen": [n for n, p in model.named_parameters() if not p.requires_grad]}
        return Snap(step, meta, opt_meta, sc, modes, ts)

    @property
    def steps(self) -> int:
        """How many steps a bundle written now could replay."""
        return len(self._steps)

    def encode(self, tensors: Tensors) -> dict | None:
        """The manifest's ``lookback`` (the oldest snapshot and every step since, the failing one
        last); its tensors go into ``tensors`` (host copies)."""
        if not self._snaps or not self._steps:
            return None
        snap = self._snaps[0]
        file = lambda t: t.detach().to(devices.HOST).contiguous()  # noqa: E731
        for k, v in snap.tensors.items():
            if not k.startswith("scaler/"):
                tensors[f"snap/{k}"] = file(v)
        scaler = None
        if snap.scaler is not None:
            scale = snap.tensors.get("scaler/scale")
            tracker = snap.tensors.get("scaler/tracker")
            scaler = {"scale": float(scale) if scale is not None else snap.scaler["init_scale"],
                      "growth_factor": snap.scaler["growth_factor"],
                      "backoff_factor": snap.scaler["backoff_factor"],
                      "growth_interval": snap.scaler["growth_interval"],
                      "_growth_tracker": int(tracker) if tracker is not None else 0}
        steps = []
        for i, s in enumerate(self._steps):
            for k, v in s.tensors.items():
                tensors[f"s{i}/{k}"] = file(v)
            rng_t: Tensors = {}
            rng = s.rng.encode(rng_t)
            tensors.update(_prefixed(f"s{i}/", rng_t))
            steps.append({"step": s.step, "rng": rng, "groups": s.groups, "batch": s.batch})
        return {"schema": SCHEMA, "k": self.k, "kept_on": self.kept_on, "start_step": snap.step,
                "model": {**snap.model, **snap.modes}, "optimizer": snap.optimizer,
                "grad_scaler": scaler, "steps": steps}


# --------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True)
class Window:
    """A bundle's lookback, checked: ``steps`` oldest first, the failing step last."""

    start_step: int
    k: int
    steps: list[dict]
    manifest: dict       # the lookback section
    tensors: Tensors

    def state_view(self, bundle: Bundle) -> "BundleView":
        """The bundle as it was before the window's first step: its snapshot and first batch."""
        snap = {k[len("snap/"):]: v for k, v in self.tensors.items() if k.startswith("snap/")}
        m = dict(bundle.manifest)
        lb = self.manifest
        m.update(model=lb["model"], optimizer=lb.get("optimizer"),
                 grad_scaler=lb.get("grad_scaler"), step=self.start_step)
        return BundleView(bundle.path, m, view={**snap, **self.step_tensors(0)}) \
            .with_step(self, 0)

    def step_tensors(self, i: int) -> Tensors:
        p = f"s{i}/"
        return {k[len(p):]: v for k, v in self.tensors.items() if k.startswith(p)}


@dataclass(frozen=True)
class BundleView(Bundle):
    """A bundle whose manifest and tensors are given (a step of a window, a derived state)."""

    view: Tensors | None = None

    def all_tensors(self) -> Tensors:
        return dict(self.view or {})

    def state_tensors(self) -> Tensors:
        """Its tensors (held: a view's are already in memory)."""
        return self.all_tensors()

    def with_step(self, w: Window, i: int) -> "BundleView":
        """This view with step ``i``'s batch, RNG and hyper-parameters."""
        s = w.steps[i]
        m = {**self.manifest, "batch": s["batch"], "rng": s["rng"], "step": s["step"]}
        m["lookback_groups"] = s["groups"]
        base = {k: v for k, v in (self.view or {}).items()
                if not k.startswith(("batch/", "rng/", "groups/"))}
        return BundleView(self.path, m, view={**base, **w.step_tensors(i)})


MAX_STEPS = MAX_LOOKBACK_STEPS


def parse(bundle: Bundle, where: str) -> Window | None:
    """The bundle's lookback, checked as untrusted input (`nanbisect.bundle.check.lookback_steps`,
    what `read_bundle` checked against the headers, now with the tensors); None when it has
    none."""
    if bundle.manifest.get("lookback") is None:
        return None
    tensors = bundle.tensors(ROLE)
    steps = lookback_steps(bundle.manifest, tensors, where)
    lb = bundle.manifest["lookback"]
    return Window(steps[0]["step"], lb["k"], steps, lb, tensors)
