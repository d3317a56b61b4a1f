"""Pipeline stages decided in-process (tests/multirank/test_pipelined.py runs them on real ranks):
the Task's forms, which phase an op of a stage's step belongs to, and the verdict from every
rank's first-pass crossings when values travel by send and receive."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nanbisect
from nanbisect.errors import BadInput
from nanbisect.multirank.served import TapeServer
from nanbisect.multirank.paths import rank_paths
from nanbisect.multirank.verdict import choose_rank, decide, received_ranks
from nanbisect.records import Crossing, RankRoot, RankSummary
from nanbisect.step import in_stage_backward, op_phase, run_step
from nanbisect.util import torch_internals as ti


def _send(src: int, dst: int, phase: str, bad: int, seq: int = 0) -> Crossing:
    return Crossing(seq, "c10d.send.default", phase, "", None, [src, dst], "float32", None,
                    bad, 0, bad, 0, seq=seq)


def _recv(src: int, dst: int, phase: str, bad: int, seq: int = 0) -> Crossing:
    return Crossing(seq, "c10d.recv_.default", phase, "", None, [src, dst], "float32", None,
                    0, 0, bad, 0, seq=seq)


def test_a_send_and_its_receive_are_one_crossing_only_for_the_same_message():
    assert _send(0, 1, "forward", 4).same(_recv(0, 1, "forward", 4))
    assert not _send(0, 1, "forward", 4, seq=0).same(_recv(0, 1, "forward", 4, seq=1))
    assert not _send(0, 1, "forward", 4).same(_recv(1, 0, "backward", 4))


def test_stage_0_made_it_in_forward_though_its_first_pass_saw_its_gradients():
    """GPipe: stage 0 sent a NaN activation (its own gradients went bad later, when the NaN came
    back); stage 1's loss is NaN, from what it received. Before: stage 1's forward failure
    made the plan forward on rank 1, which only received it."""
    s0 = RankSummary(0, "backward", None, "nan", crossings=[_send(0, 1, "forward", 8),
                                                            _recv(1, 0, "backward", 8)])
    s1 = RankSummary(1, "forward", "nan", "nan", crossings=[_recv(0, 1, "forward", 8),
                                                           _send(1, 0, "backward", 8)])
    paths = rank_paths([s0, s1])
    assert (paths[0].how, paths[0].phase) == ("computed", "forward")
    assert (paths[1].how, paths[1].from_ranks, paths[1].via.op) == (
        "received", [0], "c10d.recv_.default")
    assert received_ranks(paths) == {1}
    plan = decide([s0, s1])
    assert (plan.phase, plan.rank) == ("forward", 0)
    # pass 2: rank 1's forward root is the receive, rank 0's its own op
    div = RankRoot("aten.div.Tensor", 7, "pool", 2, ["float32"], [[2, 8]], collective=False)
    recv = RankRoot("c10d.recv_.default", 3, "", None, [], [], collective=True)
    assert choose_rank([div, recv], 0, {1}) == (0, False)


def test_the_last_stage_made_it_in_backward_and_the_first_received_its_gradient():
    """A gradient born in stage 1's backward, sent back: stage 0 received it (its own backward
    then failed too, from it, and its first pass saw that first); a local root op on stage 0,
    traced inside its backward from the received gradient, does not make it the culprit."""
    s0 = RankSummary(0, "backward", None, "nan", crossings=[_recv(1, 0, "backward", 16)])
    s1 = RankSummary(1, "backward", 0.6, "nan", crossings=[_send(1, 0, "backward", 16)])
    plan = decide([s0, s1])
    assert (plan.phase, plan.rank) == ("backward", 1)
    mul0 = RankRoot("aten.mm.default", 5, "fc", 0, ["float32"], [[6, 8]], collective=False)
    mul1 = RankRoot("aten.mul.Tensor", 44, "dist", 0, ["float32"], [[2, 4]], collective=False)
    assert choose_rank([mul0, mul1], plan.rank, received_ranks(rank_paths([s0, s1]))) == (1, False)


def test_a_task_is_one_kind_of_step_and_a_pipelined_one_takes_no_accumulation():
    m = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="give one of loss_fn"):
        nanbisect.Task(m, None, loss_fn=lambda m, b: m(b).sum(), step_fn=lambda m, b: None)
    with pytest.raises(ValueError, match="pipelining schedule"):
        nanbisect.Task(m, None, schedule=object())
    with pytest.raises(ValueError, match="leave out accumulate"):
        nanbisect.Task(m, None, step_fn=lambda m, b: None, accumulate=2)
    assert nanbisect.Task(m, None, step_fn=lambda m, b: None).pipelined == "step_fn"
    assert nanbisect.Task(m, None, loss_fn=lambda m, b: m(b).sum()).pipelined is None


class _Phases(ti.ObserverMode):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def after(self, call, out):
        self.seen.append((call.name, op_phase("forward")))


def test_inside_a_stages_step_the_autograd_engines_ops_are_backward():
    """A stage's step runs forward and backward itself inside the one forward context; an op
    is backward when the autograd engine runs it, and only inside a pipelined step."""
    model = torch.nn.Linear(3, 1)

    def stage(m, x):
        loss = m(x).sqrt().sum()
        loss.backward()
        return loss.detach()

    task = nanbisect.Task(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=stage)
    mode = _Phases()
    with mode:
        events = [(e.phase, e.micro) for e in run_step(task, torch.ones(2, 3))]
    assert events == [("forward", 0), ("backward", 0), ("optimizer", 0)]
    phases = dict(mode.seen)
    assert phases["aten.sqrt.default"] == "forward"
    assert "backward" in {p for op, p in mode.seen if op != "aten.sqrt.default"}
    # outside a pipelined step an op inside backward keeps the label it was given
    x = torch.ones(2, requires_grad=True)
    y = x.exp().sum()
    labels = []
    x.register_hook(lambda g: labels.append(op_phase("forward")))
    y.backward()
    assert labels == ["forward"]


@pytest.fixture
def fake_rank_1():
    """This process as rank 1 of 2 on torch's fake process group (what a replay alone runs on)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _recv_entry(values: list[float]) -> dict:
    return {"op": "c10d.recv_.default", "group_size": 2, "shapes": [[len(values)]],
            "dtypes": ["float32"], "in_sha256": "", "in_nan": 0, "in_inf": 0,
            "out_nan": sum(v != v for v in values), "out_inf": 0, "kind": "tape",
            "group": [0, 1]}


def test_a_stage_alone_is_served_its_receives_and_its_sends_go_nowhere(fake_rank_1):
    arrived = [1.0, float("nan")]
    server = TapeServer({"schema": 1, "entries": [_recv_entry(arrived)], "ddp": None},
                        {"c0.0": torch.tensor(arrived)})
    buf = torch.zeros(2)
    with server:
        dist.send(torch.ones(3), dst=0)            # not on the tape: the fake group sends it
        dist.irecv(buf, src=0).wait()
    assert server.i == 1 and buf[0] == 1.0 and buf[1].isnan()


def test_a_pipeline_stages_first_step_vote_is_answered_and_a_shape_exchange_refused(
        fake_rank_1):
    """torch.distributed.pipelining's stages vote on their shapes at their first step (not on
    the capture's tape: the stages had voted before the failing step): a stage that knows its
    shapes is answered "static"; one that learns them from its neighbours cannot replay alone."""
    server = TapeServer({"schema": 1, "entries": [], "ddp": None}, {})

    def _warmup_forward_vote():           # named as torch's (replay/p2p.pipeline_setup)
        acc = torch.zeros(1, dtype=torch.int32)
        dist.recv(acc, src=0)
        return acc

    def _recv_meta():
        dist.recv(torch.zeros(4, dtype=torch.uint8), src=0)

    with server:
        assert _warmup_forward_vote().item() == 1
        with pytest.raises(BadInput, match="input_args= and output_args=.*drop --ranks"):
            _recv_meta()
    assert server.i == 0


def test_a_send_or_receive_carries_what_the_first_function_that_names_it_says():
    from nanbisect.replay.p2p import _named_for

    # megatron-core's p2p communicator: the word after each op
    assert _named_for("send_forward_recv_backward", "send") == "forward"
    assert _named_for("send_forward_recv_backward", "recv") == "backward"
    assert _named_for("recv_forward", "recv") == "forward"
    assert _named_for("_recv_grad", "recv") == "backward"        # one direction: that one
    # a name with both and no order for this op says nothing: the caller's caller decides
    assert _named_for("forward_backward_pipelining_without_interleaving", "send") is None
    assert _named_for("_communicate", "recv") is None


def test_a_collective_after_a_step_fns_backward_outside_any_module_is_backward(fake_rank_1):
    """megatron's finish_grad_sync, a replicas' average: the gradient reduction after the
    backward, in a step_fn, is labelled backward; a collective inside a module's forward (a
    tensor-parallel all-reduce) stays forward."""
    from nanbisect.replay.tracker import ModuleTracker

    class Reduced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, x):
            y = self.fc(x)
            dist.all_reduce(y.detach())     # (a tensor-parallel reduction)
            return y

    model = Reduced()

    def step(m, x):
        loss = m(x).sum()
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad)
        return loss

    class Labels(ti.ObserverMode):
        def __init__(self, tracker):
            super().__init__()
            self.tracker, self.seen = tracker, []

        def wants(self, func):      # as every mode of nanbisect's: asked for every op
            in_stage_backward()
            return True

        def before(self, call):
            if call.func.namespace == "c10d":
                self.seen.append(op_phase("forward", collective=True,
                                          in_module=self.tracker.current() is not None))
            return True

    task = nanbisect.Task(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step)
    tracker = ModuleTracker(model)
    mode = Labels(tracker)
    with tracker, mode:
        list(run_step(task, torch.ones(2, 3)))
    assert mode.seen == ["forward", "backward", "backward"], mode.seen
