"""The Guard's reading of a step (`Reader`): the screen read back in the step's one host
synchronisation (`Reader.read_screen`), the exact check of a screen that tripped (agreed between
ranks by `Reader.confirm`), and a step whose gradients were not finite but whose parameters did
not move (`Reader.nonfinite_grads`). A collaborator `nanbisect.guard.core.Guard` owns.

Guarantees: a healthy step costs one host synchronisation (under torch.distributed, after one
all-reduce of a three-element flag); the exact checks run only when the screen trips.
"""
from __future__ import annotations

import warnings

import torch

from nanbisect import devices
from nanbisect.bundle.state import local
from nanbisect.guard.coord import any_rank
from nanbisect.guard.guarded import Guarded, Progress
from nanbisect.guard.screen import (any_nonfinite, bad_names, listed_names,
                                    step_and_buffer_norms, step_norms, value_kind)
from nanbisect.guard.snapshot import live_scale
from nanbisect.task import Task
from nanbisect.util import torch_internals as ti
from nanbisect.util.tensors import floating


def declared_scaler(task: Task) -> bool:
    """Does the Task declare an enabled GradScaler?"""
    return task.grad_scaler is not None and task.grad_scaler.is_enabled()


def _loss_slot(loss: torch.Tensor | None, dev: torch.device) -> torch.Tensor:
    """[1]: the loss as the screen reads it (float32, summed when it is not one element), with
    no kernel when it already is one float32 element on ``dev``."""
    if loss is None:
        return torch.zeros(1, device=dev)
    t = local(loss)      # NB: called under no_grad: no detach needed
    if t.numel() != 1:
        t = t.float().sum()
    t = t.reshape(1)
    return t if t.dtype == torch.float32 and t.device == dev else \
        t.to(device=dev, dtype=torch.float32)


class Reader:
    """A Guard's reading of the step and its exact checks, from what the Guard shares
    (`Guarded`, `Progress`)."""

    def __init__(self, guarded: Guarded, progress: Progress) -> None:
        self.g, self.p = guarded, progress
        self._prev_row: tuple[int, torch.Tensor] | None = None   # (step, its history row)
        self._warned_undeclared = False

    def read_screen(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
                    skipped: torch.Tensor | None, before: bool = False
                    ) -> tuple[torch.device, torch.Tensor | None, dict, list[float]]:
        """The screen of the step, read back in its one host synchronisation: (the device, the
        scaler's live scale, slot -> value, the ranks' failure flag (under torch.distributed)).
        Slots: the loss, the sum of the parameters' norms (the screen), the gradients' global
        norm (their finiteness flag), the floating buffers' NaN flag (``buffers``, when the
        model has some: NaN when one holds a NaN), and what the step or the history adds. ``before``: read
        just before the update (the parameters are the step's pre-state: they are the previous
        step's "after" in the history); the flag is [a failure, a failure whose update ran].
        """
        g, p = self.g, self.p
        g.snapshot.wait()     # a step without the Task's optimizer: its copies, before all
        params = p.params
        dev = local(params[0]).device if params else devices.HOST
        scaler, scale = g.task.grad_scaler, live_scale(g.task.grad_scaler)
        if skipped is None and scale is not None and not before:
            # a loop of its own (watch): the scaler skipped when it backed its scale off
            began = (g.snapshot.scale if g.snapshot.scale is not None else
                     torch.full_like(scale, ti.scaler_settings(scaler)["init_scale"]))
            skipped = (scale < began).float()
        with torch.no_grad():
            # per parameter its norm after the update (the screen) and its gradient's, in one
            # pass, written straight into the history's ring row when there is a history
            row = g.history.row(p.step_index, len(params), dev, lambda: [
                n for n, _ in g.task.model.named_parameters()]) \
                if g.history is not None else None
            # the model's floating buffers (running statistics, a codebook's moving averages),
            # as the forward left them, in the same pass: a NaN the model makes in one is
            # caught at that step (inf there may be by design: a mask, an observer's minimum)
            norms, buffers = step_and_buffer_norms(
                params, [q.grad for q in params], [b for b in p.buffers if floating(b)], dev,
                out=row)
            if row is not None:
                prev = self._prev_row
                if before and prev is not None and prev[0] == p.step_index - 1:
                    prev[1][0].copy_(row[0])    # the previous step's parameters after its update
                self._prev_row = (p.step_index, row) if before else None
            # [the parameters' screen, the gradients' global norm] in one kernel: each is
            # non-finite iff some norm is (or the sum of squares overflows: the exact check
            # clears it); the global norm is the gradients' finiteness flag
            parts = [_loss_slot(loss, dev), torch.linalg.vector_norm(norms, dim=1)]
            keys = ["loss", "screen", "grads"]
            if buffers is not None:
                parts.append(buffers)
                keys.append("buffers")
            for key, t in (("grad_norm", grad_norm), ("skipped", skipped)):
                if t is not None:
                    parts.append(t.detach().float().reshape(1).to(dev))
                    keys.append(key)
            if g.history is not None and isinstance(p.lr, torch.Tensor):
                parts.append(p.lr.detach().float().reshape(1).to(dev))
                keys.append("lr")
            vals = torch.cat(parts)      # one kernel: every slot in one tensor, read at once
        # NB: a non-finite gradient reaches the parameters through any update with lr > 0; one
        # that does not (the step was skipped) is checked exactly on the host (the step's end).
        # The one host synchronisation of a healthy step (under torch.distributed, after one
        # all-reduce of a one-element flag, so that all ranks agree on a failure):
        if g.rank.distributed:
            out, flag = self._agree_read(vals, keys, skipped, dev, before)
            return dev, scale, out, flag
        got = vals.tolist()
        return dev, scale, dict(zip(keys, got)), [0.0, 0.0]

    def _agree_read(self, vals: torch.Tensor, keys: list[str], skipped: torch.Tensor | None,
                    dev: torch.device, before: bool) -> tuple[dict, list[float]]:
        """Under torch.distributed: the screen's slots read back after one all-reduce of the
        ranks' three-element flag (a failure, a failure whose update ran, the kept steps past
        their share), so that every rank takes the same path."""
        g, p = self.g, self.p
        stall_next = p.scaler_skips + 1 >= g.max_scaler_skips
        flag = (~torch.isfinite(vals[:4 if "buffers" in keys else 3])).any()
        if skipped is not None and stall_next:
            flag = flag | (skipped.reshape(()).to(dev) > 0)
        # a failure whose update ran: parameters no longer finite after an update
        ran = (~torch.isfinite(vals[1])) if before and p.last_applied is not None \
            else torch.zeros((), dtype=torch.bool, device=dev)
        # the kept steps past their share on some rank: a snapshot on every rank
        over = torch.tensor(before and g.keeper is not None and
                            g.keeper.over_share(), device=dev)
        flag = torch.stack([flag, ran, over]).float()
        flag = any_rank(flag.to(devices.collective_device(g.rank.backend, dev)))
        vals = torch.cat([vals, flag.to(dev)])
        got = vals.tolist()
        out = dict(zip(keys, got[:-3]))
        out["over"] = got[-1] > 0
        return out, got[-3:-1]

    def nonfinite_grads(self, skipped: bool, watched: bool) -> tuple[bool, bool]:
        """The exact check of gradients the screen saw non-finite while loss and parameters are
        finite: (the step was skipped, a non-finite update was applied). With parameters that
        moved, something applied part of a non-finite update: a failure at once. With
        parameters that did not move, the step was skipped: a declared scaler says so itself
        (``skipped``); without one, whatever skipped it (a GradScaler the loop keeps for itself:
        warned about once). `step` without an optimizer skips nothing: a failure at once."""
        g, p = self.g, self.p
        if not any_nonfinite(q.grad for q in p.params):
            return skipped, False     # the sum of squares overflowed on finite gradients
        moved = p.copying and g.snapshot.moved()
        if moved or (not watched and g.task.optimizer is None):
            return skipped, True
        if declared_scaler(g.task):
            return skipped, False
        if not self._warned_undeclared:
            self._warned_undeclared = True
            warnings.warn(
                f"Guard: step {p.step_index} was skipped (its gradients are not finite "
                "and the parameters did not move) but the Task declares no GradScaler; "
                "if the loop scales its loss with one, declare it: Task(grad_scaler="
                f"scaler). {g.max_scaler_skips} skipped steps in a row are a failure "
                "(a stalled scaler)", RuntimeWarning, stacklevel=5 if watched else 4)
        return True, False

    def _observe(self, loss: float | None, grad_norm: float | None,
                 stalled: bool = False, applied: bool = False) -> dict | None:
        g, p = self.g, self.p
        named = list(g.task.model.named_parameters())
        grads = bad_names([(n, q.grad) for n, q in named if q.grad is not None])
        params = bad_names([(n, q.data) for n, q in named])
        # a buffer fails with NaN only (inf may be by design: a mask, an observer's minimum)
        buffers = {"nan": bad_names([(n, b) for n, b in g.task.model.named_buffers()
                                     if floating(b)])["nan"], "inf": []}
        loss_kind = value_kind(loss) if loss is not None else "unknown"
        if loss_kind not in ("nan", "inf") and not any(params.values()) and not stalled \
                and not applied and not any(buffers.values()):
            return None  # loss, parameters, buffers and skips decide; gradients say where from
        grads_kind = "nan" if grads["nan"] else "inf" if grads["inf"] else "finite"
        if grads_kind == "finite" and not any(q.grad is not None for _, q in named
                                              if q.requires_grad):
            # no parameter holds a gradient: an engine keeps them elsewhere (DeepSpeed ZeRO's
            # partitioned buffers) or backward did not run: what was not read is not "finite"
            grads_kind = "unread"
        if grad_norm is not None and value_kind(grad_norm) != "finite":
            # clipping multiplied the gradients by max_norm / norm: an inf gradient became NaN.
            # The norm before clipping has the kind the gradients had after backward.
            grads_kind = value_kind(grad_norm)
        first = ("loss" if loss_kind in ("nan", "inf") else
                 "grad" if grads_kind not in ("finite", "unread") else
                 "scaler" if stalled else
                 "buffer" if any(buffers.values()) and not any(params.values()) else "param")
        summary = {"loss": loss_kind, "grads": grads_kind,
                   "params": "nan" if params["nan"] else "inf" if params["inf"] else "finite"}
        out = {"step": p.step_index, "first": first,
               "loss": loss if loss_kind not in ("nan", "inf") else loss_kind,
               "summary": summary, "nonfinite_grads": listed_names(grads),
               "nonfinite_params": listed_names(params)}
        if any(buffers.values()):
            summary["buffers"] = "nan"
            out["nonfinite_buffers"] = listed_names(buffers)
        if grad_norm is not None:
            out["grad_norm"] = grad_norm if value_kind(grad_norm) == "finite" else \
                value_kind(grad_norm)
        if stalled:
            out["scaler_skips"] = p.scaler_skips
            if not declared_scaler(g.task):
                # skipped by what the Task does not know of: the note names the fix
                out["undeclared_scaler"] = True
        return out

    def confirm(self, loss: float | None, loss_v: float, grad_norm: float | None,
                stalled: bool, dev: torch.device, applied: bool = False,
                before: bool = False) -> dict | None:
        """The exact check of a tripped screen: what was observed, or None when it clears (the
        screen overflowed on finite values; under torch.distributed, no rank confirms it)."""
        observed = self._observe(loss, grad_norm, stalled, applied)
        rank = self.g.rank
        if rank.distributed:  # does any rank confirm it with the exact check?
            confirmed = any_rank(torch.tensor(
                [float(observed is not None)],
                device=devices.collective_device(rank.backend, dev)))
            if confirmed.item() == 0:
                return None
            observed = observed or {"step": self.p.step_index, "first": "other-rank",
                                    "loss": loss_v, "summary": {"local": "finite"}}
        return observed     # None: the screen overflowed on finite values

    def values(self, total: torch.Tensor | None) -> tuple[float | None, float]:
        """(the loss, the gradients' global norm) as `read_screen` reads them, for a rebuild to
        compare with."""
        params = list(self.g.task.model.parameters())
        dev = local(params[0]).device if params else devices.HOST
        with torch.no_grad():
            norms = step_norms(params, [p.grad for p in params], dev)
            v = torch.cat([_loss_slot(total, dev), torch.linalg.vector_norm(norms, dim=1)])
            v = v.tolist()
        return (v[0] if total is not None else None), v[2]

    def late_loss(self, loss: torch.Tensor) -> float:
        """A loss the loop set after its update, read now (one more synchronisation)."""
        with torch.no_grad():
            return _loss_slot(loss, loss.device).item()
