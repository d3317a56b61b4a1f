"""The Guard's pre-step snapshot and screen (`nanbisect.guard.snapshot`, `nanbisect.guard.screen`):
the one walk of the module tree, the copy lists kept from step to step (and rebuilt when a live
tensor is replaced), and the norms written straight into the history's ring row."""
from __future__ import annotations

import torch
import torch.nn as nn

from nanbisect import Guard, Task
from nanbisect.guard.snapshot import Snapshot, model_tensors

ENTRY = "fixtures/tasks/healthy.py:task"


class Quirky(nn.Module):
    """Tied weights, a submodule listed twice, a None parameter and a None buffer, BatchNorm's
    buffers, nesting: every case `model.parameters()` / `model.buffers()` deduplicate or skip."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.shared = nn.Linear(4, 4, bias=False)            # bias: None in _parameters
        self.blocks = nn.ModuleList([nn.Sequential(self.shared, nn.BatchNorm1d(4)),
                                     nn.Sequential(nn.Linear(4, 4), self.shared)])
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight                 # tied
        self.register_buffer("nothing", None)
        self.register_buffer("scale", torch.ones(1), persistent=False)


def test_model_tensors_are_parameters_and_buffers_in_one_walk():
    m = Quirky()
    params, buffers = model_tensors(m)
    assert len(params) == len(list(m.parameters())) == 6
    assert all(a is b for a, b in zip(params, m.parameters()))
    assert len(buffers) == len(list(m.buffers())) == 4
    assert all(a is b for a, b in zip(buffers, m.buffers()))

    class Listed(Quirky):       # lists its tensors its own way: asked through its methods
        def parameters(self, recurse=True):
            return iter([self.head.weight])

    only = Listed()
    assert model_tensors(only)[0][0] is only.head.weight and len(model_tensors(only)[0]) == 1


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for t in [*model.parameters(), *model.buffers()] +
            [v for st in opt.state.values() for v in st.values()]]


def _scribble(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """What a step may do in place: every parameter, buffer and state tensor changed."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()] + \
                [v for st in opt.state.values() for v in st.values()]:
            t.add_(7)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y)
                                    for x, y in zip(a, b))


def test_the_kept_copy_lists_follow_every_replaced_tensor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()                                      # the state exists
    snap = Snapshot(side_stream=False)
    for replace in (None, "param-data", "param-data-shape", "buffer", "state", "state-entry"):
        lin, bn = model[0], model[1]
        if replace == "param-data":                 # same object, new storage
            lin.weight.data = torch.randn(3, 4)
        elif replace == "param-data-shape":         # same object, another shape: new copies
            lin.bias.data = torch.randn(5)
        elif replace == "buffer":
            bn.running_mean = torch.randn(3)
        elif replace == "state":                    # a state tensor re-bound
            opt.state[lin.weight]["exp_avg"] = torch.randn(3, 4)
        elif replace == "state-entry":              # an entry the optimizer did not have
            opt.state[lin.weight]["extra"] = torch.randn(2)
        snap.take(model, opt)
        pre = _state(model, opt)
        _scribble(model, opt)
        assert not _same(_state(model, opt), pre)
        snap.restore(opt)
        assert _same(_state(model, opt), pre), replace


def test_the_history_row_holds_the_norms_of_the_last_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    task = Task(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                lambda m, b: m(b).pow(2).mean())
    guard = Guard(task, entry=ENTRY, out=tmp_path, history=4)
    for i in range(5):           # the ring wraps around
        guard.step(torch.randn(5, 4))
    ps = list(model.parameters())
    before = torch.stack([torch.linalg.vector_norm(t) for t in ps])
    guard.step(torch.randn(5, 4))
    after = torch.stack([torch.linalg.vector_norm(t) for t in ps])
    want = torch.stack([before, torch.stack([torch.linalg.vector_norm(p.grad) for p in ps])])
    log = guard._history
    last = (log._next - 1) % log.n
    assert log._steps[last] == 5 and log._steps[(last - 1) % log.n] == 4
    # read just before the update: the step's parameters as it began (step 4's "after") ...
    torch.testing.assert_close(log._ring[last], want)
    torch.testing.assert_close(log._ring[(last - 1) % log.n][0], before)
    # ... and the next reading writes the parameters after step 5's update into its row
    guard.step(torch.randn(5, 4))
    torch.testing.assert_close(log._ring[last][0], after)
    torch.testing.assert_close(log._ring[last][1], want[1])
    # the gradients' global norm (their finiteness flag) is the one the history keeps
    torch.testing.assert_close(torch.tensor(log.entries[-2]["grad_norm"]),
                               torch.linalg.vector_norm(want[1]))


def test_every_step_history_rows_hold_each_steps_own_norms_with_a_scaler(tmp_path):
    """snapshot='every-step' reads after the update: each row's parameter norms are that step's
    own, after its update, also in a watched loop with a declared GradScaler (whose scale the
    reading compares with the one the step began with)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    task = Task(model, opt, lambda m, b: m(b).pow(2).mean(), grad_scaler=scaler)
    guard = Guard(task, entry=ENTRY, out=tmp_path, history=8, snapshot="every-step")
    after = []
    for i in range(4):
        b = torch.randn(5, 4)
        with guard.watch(b) as w:
            opt.zero_grad()
            w.loss = task.loss_fn(model, b)
            scaler.scale(w.loss).backward()
            scaler.step(opt)
            scaler.update()
        after.append(torch.stack([torch.linalg.vector_norm(p) for p in model.parameters()]))
    log = guard._history
    rows = {s: log._rows[i] for i, s in enumerate(log._steps) if s is not None}
    for s in range(4):
        torch.testing.assert_close(rows[s][0], after[s])
