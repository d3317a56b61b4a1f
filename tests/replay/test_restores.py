"""The state is loaded once and restored in place: a replay's first restore writes every
parameter, buffer and optimizer state tensor from the bundle's files; a later one writes only
what a run since changed, and what it writes is the bundle's value bit for bit. Real bundles
(the shipped fixtures), replayed in-process."""
from __future__ import annotations

import pytest
import torch

from helpers import FIXTURES

from nanbisect.bundle.format import read_bundle
from nanbisect.bundle.lazy import LazyTensors, Layered
from nanbisect.bundle.state import local, model_entries
from nanbisect.pipeline import RunOptions, run_bundle
from nanbisect.replay.replayer import Replayer


def state(rep: Replayer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer state tensor of the replay, copied."""
    out = {f"model:{n}": local(t).detach().clone() for n, t, _ in model_entries(rep.task.model)}
    names = {p: n for n, p in rep.task.model.named_parameters()}
    for p, st in rep.task.optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt:{names[p]}.{k}"] = local(v).detach().clone()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) or (
        a[k].is_floating_point() and torch.equal(a[k].isnan(), b[k].isnan())
        and torch.equal(a[k].nan_to_num(), b[k].nan_to_num())) for k in a)


@pytest.fixture()
def rep() -> Replayer:
    bundle = read_bundle(FIXTURES / "optimizer_adam_eps0")
    return Replayer(bundle, torch.device("cpu"))


def test_the_state_is_read_from_the_files_not_held(rep):
    assert isinstance(rep.tensors, Layered)
    lazy = [m for m in rep.tensors.layers if isinstance(m, LazyTensors)]
    assert lazy and any(k.startswith("model/") for k in lazy[0])
    # nothing the size of the model is kept: each read is a fresh tensor
    name = next(k for k in lazy[0] if k.startswith("model/"))
    assert rep.tensors[name] is not rep.tensors[name]


def test_a_restore_after_the_optimizer_stepped_writes_everything_back_bit_for_bit(rep):
    rep.restore()
    first = state(rep)
    total = rep.restore_counts[0]
    assert total == len(first)            # the first restore wrote every tensor
    rep.run()                             # a whole step: the optimizer moves parameters, moments
    assert rep.stepped and not same(state(rep), first)
    rep.restore()
    assert rep.restore_counts[-1] == total and same(state(rep), first)


def test_a_restore_after_a_pass_that_stopped_before_the_optimizer_writes_nothing(rep):
    rep.run(stop_after="backward")
    before = state(rep)
    rep.run(stop_after="forward")
    rep.run(stop_after="backward")
    # three restores, one that wrote the state, two that had nothing to write
    assert rep.restore_counts == [rep.restore_counts[0], 0, 0] and rep.restore_counts[0] > 0
    assert same(state(rep), before)


def test_what_a_pass_wrote_in_place_is_undone(rep):
    rep.restore()
    first = state(rep)
    p = next(rep.task.model.parameters())
    with torch.no_grad():
        p.mul_(2)                         # user code writing a parameter outside the optimizer
    rep.restore()
    assert rep.restore_counts[-1] == 1 and same(state(rep), first)


def test_a_run_restores_the_state_once_per_pass_and_writes_it_once(tmp_path, monkeypatch):
    # a backward failure: pass 1, the op recording (twice: backward, then forward and backward
    # together; the inputs caught on its way); none of them steps the optimizer, so only the first restore
    # writes the state
    made: list[Replayer] = []
    init = Replayer.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Replayer, "__init__", keep)
    report = run_bundle(FIXTURES / "backward_nan_custom_function",
                        RunOptions(remedies=0, run_repro=False), out=tmp_path / "rep")
    assert report.verdict == "culprit" and report.phase == "backward"
    counts = made[0].restore_counts
    assert len(counts) >= 3 and counts[0] > 0
    assert counts[1:] == [0] * (len(counts) - 1), counts


TASK = '''
import torch
import nanbisect


def make_task():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return nanbisect.Task(model=model, optimizer=opt,
                          loss_fn=lambda m, b: (m(b) ** 2).mean())
'''


def test_a_stepped_optimizers_state_is_overwritten_where_it_stands(tmp_path):
    """An optimizer with state (AdamW's moments after two steps): the first restore builds it,
    a later one writes the bundle's values into the same tensors (no second copy of the
    moments), bit for bit, also after a step moved them."""
    import nanbisect
    from nanbisect.task import load_task

    (tmp_path / "task.py").write_text(TASK)
    entry = f"{tmp_path / 'task.py'}:make_task"
    task = load_task(entry)
    batch = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        task.optimizer.zero_grad()
        task.loss_fn(task.model, batch).backward()
        task.optimizer.step()
    nanbisect.capture(task, batch, tmp_path / "bundle", entry=entry)
    rep = Replayer(read_bundle(tmp_path / "bundle"), torch.device("cpu"))
    rep.restore()
    first = state(rep)
    moments = {k: v for k, v in first.items() if k.startswith("opt:")}
    assert moments and any(v.abs().sum() > 0 for v in moments.values())
    where = {id(v): v.data_ptr() for st in rep.task.optimizer.state.values()
             for v in st.values() if isinstance(v, torch.Tensor)}
    rep.run()                                  # the optimizer steps: moments move
    assert not same(state(rep), first)
    rep.restore()
    assert rep.restore_counts[-1] == rep.restore_counts[0] and same(state(rep), first)
    now = {id(v): v.data_ptr() for st in rep.task.optimizer.state.values()
           for v in st.values() if isinstance(v, torch.Tensor)}
    assert now == where                        # the same tensors, written where they stand
    rep.run(stop_after="backward")
    rep.restore()
    assert rep.restore_counts[-1] == 0 and same(state(rep), first)
