"""The time dimension of a guarded run: the last N steps' health, kept by `Guard`, stored in every
bundle it writes, and read back as evidence of what led up to the failing step.

Guarantees: per step, the loss, the global gradient norm, whether the GradScaler skipped the step
and the learning rate (the first parameter group's) are kept on the host from values the step's
one host synchronisation already reads (no extra sync); per parameter, its norm after the update
(the screen the Guard already computes is these norms) and its gradient's norm are kept in a ring
on the device and read only when a bundle is written. `findings` points out, with the numbers
that earn it, the step where the learning rate jumped, the first step where the loss or the
gradient norm jumped far above its recent history, and a pre-state that was already extreme (a
parameter far above its own earlier norm, an optimizer moment far above the gradients it
averages). The robust jump statistic (`jump_score`) is also what `Guard(spike=...)` uses.
Not guaranteed: without clipping the gradient norm of a sharded model (FSDP2) is this rank's
shards' only; per-parameter gradient norms are those the optimizer used (after clipping).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from nanbisect import devices
from nanbisect.errors import BadInput
from nanbisect.records import HistoryEntry
from nanbisect.util.tensors import floating, parts

ROLE = "history"
SCHEMA = 1
DEFAULT_N = 64
JUMP_Z = 6.0          # robust z-score above which a value "jumped" (loss, gradient norm)
JUMP_WINDOW = 16      # steps before a value that make its baseline
JUMP_MIN = 8          # fewest earlier steps that make a baseline at all
PARAM_RATIO = 10.0    # a parameter this many times its earliest norms is "extreme"
MOMENT_RATIO = 100.0  # an optimizer moment this many times the largest gradient it averaged
LR_RATIO = 2.0        # a learning-rate change by this factor after a flat stretch is a jump


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def jump_score(value: float, before: list[float]) -> tuple[float, float, float] | None:
    """(z, median, scale) of ``value`` against the finite values ``before`` it: how many robust
    standard deviations (1.4826 x the median absolute deviation, at least 1e-3 of the median) it
    lies above their median; None with fewer than `JUMP_MIN` of them.

    >>> z, med, _ = jump_score(9.0, [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.0])
    >>> round(med, 2), z > JUMP_Z
    (2.0, True)
    """
    xs = [x for x in before if math.isfinite(x)]
    if len(xs) < JUMP_MIN or not math.isfinite(value):
        return None
    med = _median(xs)
    scale = max(1.4826 * _median([abs(x - med) for x in xs]), 1e-3 * abs(med), 1e-12)
    return (value - med) / scale, med, scale


class HealthLog:
    """The Guard's side: the last ``n`` steps' health (`add`), and per-parameter norms in a ring
    on the device (`row`, `record_norms`: device ops only)."""

    def __init__(self, n: int, names: list[str]) -> None:
        self.n, self.names = n, names
        self.entries: deque[dict] = deque(maxlen=n)
        self._ring: torch.Tensor | None = None     # [n, 2, P]: parameter norm, gradient norm
        self._rows: tuple[torch.Tensor, ...] | None = None   # its rows
        self._steps: list[int | None] = [None] * n
        self._next = 0

    def record_norms(self, step: int, norms: torch.Tensor,
                     names: Callable[[], list[str]]) -> None:
        """Keep ``norms`` ([2, P]: each parameter's norm after the update, its gradient's) as
        ``step``'s row of the ring: one device copy."""
        self.row(step, norms.shape[1], norms.device, names).copy_(norms)

    def row(self, step: int, n: int, device: torch.device,
            names: Callable[[], list[str]]) -> torch.Tensor:
        """``step``'s row of the ring ([2, n], contiguous, on ``device``) for the caller to
        write the step's norms into (`nanbisect.guard.screen.step_norms`' ``out``): no copy."""
        if self._rows is None or self._ring.shape[2] != n or self._ring.device != device:
            # the first step, or the model gained parameters (lazy modules): a new ring
            self._ring = torch.zeros((self.n, 2, n), dtype=torch.float32, device=device)
            self._rows = self._ring.unbind(0)      # its rows' views, made once
            self._steps = [None] * self.n
            self.names = names()
        row = self._rows[self._next]
        self._steps[self._next] = step
        self._next = (self._next + 1) % self.n
        return row

    def add(self, entry: dict) -> None:
        # a step that failed was rolled back: a loop that goes on runs that step index again
        while self.entries and self.entries[-1]["step"] >= entry["step"]:
            self.entries.pop()
        self.entries.append(entry)

    def drop_from(self, step: int) -> None:
        """Forget the entries of ``step`` and later (a failure found a step late: its bundle
        ends with the step that failed)."""
        while self.entries and self.entries[-1]["step"] >= step:
            self.entries.pop()
        if self._ring is not None:   # the later steps' rows took the oldest entries' rows
            have = {s for s in self._steps if s is not None}
            while self.entries and self.entries[0]["step"] not in have:
                self.entries.popleft()

    def losses_before(self, last: int = JUMP_WINDOW) -> list[float]:
        """The finite losses of the last ``last`` steps before the newest entry that the scaler
        did not skip."""
        out = [e["loss"] for e in list(self.entries)[:-1] if isinstance(e.get("loss"), float)
               and not e.get("skipped") and math.isfinite(e["loss"])]
        return out[-last:]

    def encode(self, tensors: dict) -> dict:
        """The manifest's ``history`` (entries oldest first) and its norms under ``tensors``
        (rows for the entries' steps, oldest first). Reads the ring from the device: once, when a
        bundle is written."""
        steps = [e["step"] for e in self.entries]
        rows = []
        if self._ring is not None:
            order = [(self._next + i) % self.n for i in range(self.n)]
            at = {self._steps[i]: i for i in order if self._steps[i] is not None}
            rows = [at[s] for s in steps if s in at]
        if rows and len(rows) == len(steps):
            tensors["history/norms"] = self._ring[rows].detach().to(devices.HOST, copy=True)
        entries = [{k: _plain(v) for k, v in e.items()} for e in self.entries]
        return {"schema": SCHEMA, "entries": entries,
                "parameters": list(self.names) if "history/norms" in tensors else [],
                "norms": "history/norms" if "history/norms" in tensors else None}


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    return v


def _num(v) -> float | None:
    """A history number: a finite float, "nan"/"inf"/"-inf" as floats, else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return None


@dataclass(frozen=True)
class History:
    """A bundle's history, validated: entries oldest first, norms [steps, 2, parameters]."""

    entries: list[dict]
    parameters: list[str]
    norms: torch.Tensor | None

    def records(self) -> list[HistoryEntry]:
        """The entries as report.json's ``history`` holds them."""
        return [HistoryEntry(**e) for e in self.entries]


MAX_ENTRIES = 1 << 16


def parse(h: Any, tensors: dict, where: str) -> History | None:
    """A manifest's ``history`` section (``h``, as read: `nanbisect.bundle.manifest.Manifest`'s
    ``history``), checked as untrusted input (`BadInput` naming the fix); None when the bundle
    has none."""
    if h is None:
        return None
    fix = "the manifest's history was altered or damaged; re-capture the bundle"
    if not isinstance(h, dict) or h.get("schema") != SCHEMA or \
            not isinstance(h.get("entries"), list) or len(h["entries"]) > MAX_ENTRIES:
        raise BadInput(f"{where}: unreadable history (schema 1 with a list of entries "
                       f"expected); {fix}")
    entries = []
    for e in h["entries"]:
        if not isinstance(e, dict) or type(e.get("step")) is not int:
            raise BadInput(f"{where}: a history entry has no integer step; {fix}")
        out = {"step": e["step"]}
        for k in ("loss", "grad_norm", "lr"):
            if e.get(k) is not None:
                v = _num(e[k])
                if v is None:
                    raise BadInput(f"{where}: history entry of step {e['step']}: {k} is not a "
                                   f"number; {fix}")
                out[k] = v
        if e.get("skipped") is not None:
            if not isinstance(e["skipped"], bool):
                raise BadInput(f"{where}: history entry of step {e['step']}: skipped is not "
                               f"true/false; {fix}")
            out["skipped"] = e["skipped"]
        entries.append(out)
    steps = [e["step"] for e in entries]
    if steps != sorted(set(steps)):
        raise BadInput(f"{where}: the history's steps are not increasing; {fix}")
    names, norms = h.get("parameters") or [], None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInput(f"{where}: the history's parameter names are not strings; {fix}")
    if h.get("norms") is not None:
        t = tensors.get("history/norms")
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or \
                tuple(t.shape) != (len(entries), 2, len(names)) or not t.is_floating_point():
            raise BadInput(f"{where}: the history's norms do not match its entries and "
                           f"parameters; {fix}")
        norms = t.float()
    return History(entries, names, norms)


def _jumps(entries: list[dict], key: str, what: str) -> dict | None:
    """The first step whose ``key`` lies far above the steps before it."""
    seen: list[float] = []
    for e in entries:
        v = e.get(key)
        if v is None or e.get("skipped"):
            continue
        s = jump_score(v, seen[-JUMP_WINDOW:])
        if s is not None and s[0] >= JUMP_Z and v > 1.5 * s[1]:
            z, med, _ = s
            return {"kind": f"{key.replace('_', '-')}-jump", "step": e["step"], "value": v,
                    "baseline": med, "ratio": v / med if med else None, "z": round(z, 1),
                    "text": f"{what} jumped at step {e['step']}: {v:.4g} against a median of "
                            f"{med:.4g} over the {len(seen[-JUMP_WINDOW:])} steps before "
                            f"(robust z {z:.0f})"}
        if math.isfinite(v):
            seen.append(v)
    return None


def _lr_jumps(entries: list[dict]) -> list[dict]:
    out, prev, flat = [], None, True
    for e in entries:
        lr = e.get("lr")
        if lr is None or not math.isfinite(lr):
            prev = None
            continue
        if prev is not None and prev > 0:
            r = lr / prev
            if flat and r >= LR_RATIO:
                out.append({"kind": "lr-jump", "step": e["step"], "value": lr, "baseline": prev,
                            "ratio": r, "text": f"the learning rate jumped x{r:.3g} at step "
                                                f"{e['step']} ({prev:.4g} -> {lr:.4g})"})
            flat = 1 / 1.1 <= r <= 1.1
        prev = lr
    return out[-5:]


def _moment_norm(name: str, t: torch.Tensor) -> float:
    """An optimizer state tensor's size on the gradients' scale: the L2 norm, or for a second
    moment (a name with "sq": an average of squared gradients) the root of its sum. A complex
    state (Adam's moments of a complex parameter) by its parts: the same L2 norm."""
    t = parts(t.detach()).float()
    return float(t.abs().sum().sqrt()) if "sq" in name else float(torch.linalg.vector_norm(t))


def findings(h: History | None, model: torch.nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None) -> list[dict]:
    """What the history says led up to the failing step (its last entry), each with the numbers
    that earn it. ``model``/``optimizer`` hold the failing step's pre-state (a replay restored
    them), for the pre-state checks."""
    if h is None or not h.entries:
        return []
    entries = h.entries
    out = _lr_jumps(entries)
    for key, what in (("loss", "the loss"), ("grad_norm", "the gradient norm")):
        j = _jumps(entries, key, what)
        if j is not None:
            out.append(j)
    if h.norms is None or len(entries) < 2:
        return out
    pre = h.norms[:-1]          # rows up to the step before the failing one: its pre-state
    finite_rows = torch.isfinite(pre).all(dim=(1, 2))
    if int(finite_rows.sum()) < JUMP_MIN:
        return out
    pre = pre[finite_rows]
    out += _param_extremes(h, pre, finite_rows)
    if model is None or optimizer is None:
        return out
    return out + _moment_extremes(h, pre, model, optimizer)


def _param_extremes(h: History, pre: torch.Tensor, finite_rows: torch.Tensor) -> list[dict]:
    """Parameters that entered the failing step with a norm `PARAM_RATIO` times their norm
    early in the history (``pre``: the finite rows before it), the largest 10."""
    entries = h.entries
    first = max(4, pre.shape[0] // 4)
    base = pre[:first, 0].median(dim=0).values
    last = pre[-1, 0]
    extreme = []
    for i, name in enumerate(h.parameters):
        b, v = float(base[i]), float(last[i])
        if b > 0 and v >= PARAM_RATIO * b:
            grew = (pre[:, 0, i] >= 2 * b).nonzero()
            since = entries[int(finite_rows.nonzero()[int(grew[0])])]["step"] if len(grew) else None
            extreme.append({"kind": "param-extreme", "parameter": name, "value": v,
                            "baseline": b, "ratio": v / b, "since_step": since,
                            "text": f"parameter {name} entered the failing step with norm "
                                    f"{v:.4g}, x{v / b:.3g} its norm early in the history "
                                    f"({b:.4g})" + (f"; above x2 since step {since}"
                                                    if since is not None else "")})
    return sorted(extreme, key=lambda f: -f["ratio"])[:10]


def _moment_extremes(h: History, pre: torch.Tensor, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer) -> list[dict]:
    """Optimizer states that entered the failing step at `MOMENT_RATIO` times the largest
    gradient norm of their parameter in the history, the largest 10."""
    gmax = pre[:, 1].max(dim=0).values
    index = {n: i for i, n in enumerate(h.parameters)}
    moments = []
    for name, p in model.named_parameters():
        st = optimizer.state.get(p) or {}
        i = index.get(name)
        if i is None or float(gmax[i]) <= 0:
            continue
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or not floating(v) or \
                    v.shape != p.shape or not bool(torch.isfinite(v).all()):
                continue
            m = _moment_norm(k, v)
            if m >= MOMENT_RATIO * float(gmax[i]):
                moments.append({"kind": "moment-extreme", "parameter": name, "state": k,
                                "value": m, "baseline": float(gmax[i]),
                                "ratio": m / float(gmax[i]),
                                "text": f"optimizer state {k} of {name} entered the failing step "
                                        f"at {m:.4g}, x{m / float(gmax[i]):.3g} the largest "
                                        f"gradient norm in the history ({float(gmax[i]):.4g}): "
                                        "set before the history or by something else than "
                                        "these gradients"})
    return sorted(moments, key=lambda f: -f["ratio"])[:10]
