"""Freeze a training step into a bundle: `capture` on demand, `Guard` on failure.

Guarantees: a bundle holds the state *before* its step (parameters, buffers, optimizer state,
RNG of Python/NumPy/torch CPU/accelerators) plus the batch. `Guard` costs a healthy step one
snapshot copy of the parameters, buffers and optimizer state (kept on their device), one sum per
parameter and one host synchronisation; exact checks of loss, gradients and parameters run only
when that screen trips. Gradients are not screened on their own: a non-finite gradient becomes a
non-finite parameter through the update (so it is caught, and classified as a gradient fault by
the exact check), while a loop whose GradScaler skips an overflowed step stays silent. Not guaranteed: custom loops that zero gradients *after* the optimizer step
lose the gradients the guard checks (zero them at the start of the step instead).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from nanbisect.bundle.format import write_bundle
from nanbisect.multirank.coord import any_rank, broadcast_str, rank_info, write_all_ranks
from nanbisect.errors import NonFiniteStep
from nanbisect.bundle.state import RngState, accelerator_types, encode, encode_model, encode_optimizer, local
from nanbisect.task import Task, split_entry


def _device_of(model: torch.nn.Module) -> str:
    t = next(model.parameters(), None)
    return str(t.device) if t is not None else "cpu"


def _bundle_parts(task: Task, batch: Any, rng: RngState, *, entry: str, step: int | None,
                  observed: dict | None, path: Path) -> tuple[dict, dict]:
    split_entry(entry)  # fail early on a malformed entry, before anything is written
    tensors: dict[str, dict] = {"model": {}, "optimizer": {}, "batch": {}, "rng": {}}
    target = entry.rpartition(":")[0]
    entry_file = entry_rel = None
    if target.endswith(".py") and Path(target).is_file():
        entry_file = str(Path(target).resolve())
        entry_rel = os.path.relpath(entry_file, Path(path).resolve())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in task.model.parameters()})
    manifest = {
        "entry": entry, "entry_file": entry_file, "entry_file_from_bundle": entry_rel,
        "step": step, "world_size": rank_info().world_size, "rank": rank_info().rank,
        "devices": {"captured_on": _device_of(task.model), "accelerators": accelerator_types()},
        "dtypes": dtypes,
        "observed": observed,
        "model": encode_model(task.model, tensors["model"]),
        "optimizer": (encode_optimizer(task.optimizer, tensors["optimizer"])
                      if task.optimizer is not None else None),
        "batch": encode(batch, "batch", tensors["batch"]),
        "rng": rng.encode(tensors["rng"]),
    }
    return manifest, tensors


def capture(task: Task, batch: Any, path: str | Path, *, entry: str, step: int | None = None
            ) -> Path:
    """Write a bundle of the current model, optimizer and RNG state plus ``batch``.

    Call it *before* running the step it should replay. Under torch.distributed, call it on
    every rank: each writes its part of one bundle.

    >>> import tempfile
    >>> model = torch.nn.Linear(2, 1)
    >>> task = Task(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum())
    >>> path = capture(task, torch.ones(3, 2), Path(tempfile.mkdtemp()) / "step1",
    ...                entry="train.py:make_task", step=1)
    >>> (path / "manifest.json").is_file()
    True
    """
    path = Path(path)
    rng = RngState.get(accelerator_types())
    if rank_info().distributed:  # every rank writes its part of one bundle
        def part(p: Path) -> None:
            manifest, tensors = _bundle_parts(task, batch, rng, entry=entry, step=step,
                                              observed=None, path=p)
            write_bundle(p, manifest, tensors)
        return write_all_ranks(path, part, {"entry": entry, "step": step})
    manifest, tensors = _bundle_parts(task, batch, rng, entry=entry, step=step, observed=None,
                                      path=path)
    return write_bundle(path, manifest, tensors)


class _Snapshot:
    """Pre-step copies of everything an optimizer step or a forward pass may change in place."""

    def __init__(self) -> None:
        self._copies: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []
        self._opt_state: dict = {}
        self._groups: list[dict] = []

    def take(self, model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> None:
        live = [local(p.data) for p in model.parameters()] + [local(b) for b in model.buffers()]
        self._opt_state = {}
        if opt is not None:
            for p, st in opt.state.items():
                self._opt_state[p] = {k: v for k, v in st.items()}
                live += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
            self._groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        if [t.shape for t in live] != [t.shape for t in self._copies] or any(
                a.dtype != b.dtype or a.device != b.device for a, b in zip(live, self._copies)):
            self._copies = [torch.empty_like(t) for t in live]
        if live:
            torch._foreach_copy_(self._copies, live)
        self._live = live

    @torch.no_grad()
    def restore(self, opt: torch.optim.Optimizer | None) -> None:
        for dst, src in zip(self._live, self._copies):
            dst.copy_(src)
        if opt is not None:
            for p in list(opt.state):
                if p not in self._opt_state:
                    del opt.state[p]  # state created by the failing step itself
            for p, st in self._opt_state.items():
                opt.state[p] = dict(st)
            for g, saved in zip(opt.param_groups, self._groups):
                g.update(saved)


@dataclass
class StepWatch:
    """Handle yielded by `Guard.watch`; set ``loss`` so the guard can check and record it."""

    loss: torch.Tensor | None = None
    value: float | None = None


def _screen(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One float32 sum per tensor, summed: non-finite iff some element is (or the sum overflows).

    A finite sum that overflows trips the screen too; the exact check that follows clears it.
    """
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack([local(t).sum(dtype=torch.float32).to(device) for t in tensors]).sum()


def _bad_names(named: list[tuple[str, torch.Tensor]]) -> dict:
    out = {"nan": [], "inf": []}
    for name, t in named:
        t = local(t)
        if torch.isnan(t).any():
            out["nan"].append(name)
        elif torch.isinf(t).any():
            out["inf"].append(name)
    return out


def _kind(x: float) -> str:
    return "nan" if x != x else ("inf" if abs(x) == float("inf") else "finite")


class Guard:
    """Run training steps and freeze the first non-finite one into a bundle.

    >>> import tempfile
    >>> model = torch.nn.Linear(2, 1)
    >>> _ = torch.nn.init.ones_(model.weight), torch.nn.init.zeros_(model.bias)
    >>> task = Task(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...             lambda m, b: m(b).log().sum())      # log of a negative output: NaN
    >>> guard = Guard(task, entry="train.py:make_task", out=tempfile.mkdtemp())
    >>> try:
    ...     for batch in [torch.ones(3, 2), -torch.ones(3, 2), torch.ones(3, 2)]:
    ...         loss = guard.step(batch)
    ... except NonFiniteStep as e:
    ...     print(e.bundle.name, e.observed["first"])
    step000001 loss
    """

    def __init__(self, task: Task, *, entry: str, out: str | Path, start_step: int = 0) -> None:
        split_entry(entry)
        self.task, self.entry, self.out = task, entry, Path(out)
        self.step_index = start_step
        self._accel = accelerator_types()
        self._snapshot = _Snapshot()
        self._rank = rank_info()

    def step(self, batch: Any) -> float:
        """zero_grad, forward via ``loss_fn``, backward, optimizer step; return the loss."""
        task = self.task
        with self.watch(batch) as w:
            if task.optimizer is not None:
                task.optimizer.zero_grad(set_to_none=True)
            w.loss = task.loss_fn(task.model, batch)
            w.loss.backward()
            if task.optimizer is not None:
                task.optimizer.step()
        return w.value

    @contextmanager
    def watch(self, batch: Any) -> Iterator[StepWatch]:
        """Guard a step that your own loop runs (forward, backward, optimizer step inside).

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = Guard(Task(model, opt, lambda m, b: m(b).sum()), entry="train.py:task",
        ...               out="unused-while-finite")
        >>> with guard.watch(torch.ones(3, 2)) as w:
        ...     opt.zero_grad(); w.loss = model(torch.ones(3, 2)).sum(); w.loss.backward()
        ...     opt.step()
        >>> isinstance(w.value, float)
        True
        """
        rng = RngState.get(self._accel)
        self._snapshot.take(self.task.model, self.task.optimizer)
        w = StepWatch()
        yield w
        params = [local(p.data) for p in self.task.model.parameters()]
        dev = params[0].device if params else torch.device("cpu")
        loss = (local(w.loss).detach().float().reshape(-1).sum().to(dev) if w.loss is not None
                else torch.zeros((), device=dev))
        # NB: gradients are not screened: a non-finite gradient reaches the parameters through
        # any update with lr > 0, and a loop whose GradScaler skips inf gradients must not trip.
        # The one host synchronisation of a healthy step (under torch.distributed, after one
        # all-reduce of a one-element flag, so that all ranks agree on a failure):
        vals = torch.stack([loss, _screen(params, dev)])
        if self._rank.distributed:
            flag = (~torch.isfinite(vals)).any().float().reshape(1)
            flag = any_rank(flag.cpu() if self._rank.backend == "gloo" else flag)
            vals = torch.cat([vals, flag.to(dev)])
        loss_v, param_v, *flag_v = vals.tolist()
        w.value = loss_v
        tripped = flag_v[0] > 0 if flag_v else not (_kind(param_v) == "finite" and
                                                    _kind(loss_v) == "finite")
        if not tripped:
            self.step_index += 1
            return
        observed = self._observe(loss_v if w.loss is not None else None)
        if self._rank.distributed:  # does any rank confirm it with the exact check?
            confirmed = any_rank(torch.tensor([float(observed is not None)]))
            if confirmed.item() == 0:
                self.step_index += 1
                return
            observed = observed or {"step": self.step_index, "first": "other-rank",
                                    "loss": loss_v, "summary": {"local": "finite"}}
        elif observed is None:  # the screen overflowed on finite values
            self.step_index += 1
            return
        self._snapshot.restore(self.task.optimizer)
        path = self._free_path()
        if self._rank.distributed:
            path = Path(broadcast_str(str(path)))
            observed["rank"] = self._rank.rank

            def part(p: Path) -> None:
                manifest, tensors = _bundle_parts(self.task, batch, rng, entry=self.entry,
                                                  step=self.step_index, observed=observed,
                                                  path=p)
                write_bundle(p, manifest, tensors)

            write_all_ranks(path, part, {"entry": self.entry, "step": self.step_index})
        else:
            manifest, tensors = _bundle_parts(self.task, batch, rng, entry=self.entry,
                                              step=self.step_index, observed=observed, path=path)
            write_bundle(path, manifest, tensors)
        raise NonFiniteStep(path, observed)

    def _observe(self, loss: float | None) -> dict | None:
        named = list(self.task.model.named_parameters())
        grads = _bad_names([(n, p.grad) for n, p in named if p.grad is not None])
        params = _bad_names([(n, p.data) for n, p in named])
        loss_kind = _kind(loss) if loss is not None else "unknown"
        if loss_kind not in ("nan", "inf") and not any(params.values()):
            return None  # only loss and parameters decide; gradients say where it came from
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if any(grads.values()) else "param")
        summary = {"loss": loss_kind,
                   "grads": "nan" if grads["nan"] else "inf" if grads["inf"] else "finite",
                   "params": "nan" if params["nan"] else "inf" if params["inf"] else "finite"}
        return {"step": self.step_index, "first": first, "loss": loss if loss_kind != "nan" and
                loss_kind != "inf" else loss_kind, "summary": summary,
                "nonfinite_grads": {k: v[:20] for k, v in grads.items()},
                "nonfinite_params": {k: v[:20] for k, v in params.items()}}

    def _free_path(self) -> Path:
        base = self.out / f"step{self.step_index:06d}"
        path, i = base, 1
        while path.exists():
            path, i = base.with_name(f"{base.name}-{i}"), i + 1
        return path
