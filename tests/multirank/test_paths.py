"""How each rank came to hold a failure, decided from every rank's crossings (the collectives and
comm-hook ops of its first pass): in-process, from records, with no torch.distributed. The
end-to-end cases (real ranks, real hooks) are in test_collective_birth.py."""
from __future__ import annotations

from dataclasses import replace

from nanbisect.multirank.paths import birth, rank_paths
from nanbisect.multirank.verdict import decide, job_report
from nanbisect.records import Bucket, Crossing, Losses, Plan, RankResult, RankSummary, RunFacts

AR = "c10d.allreduce_.default"


def cross(nth, *, op=AR, phase="forward", group=(0, 1), dtype="float32", fed=(0, 0),
          got=(0, 0), absmax=None, params=(), bucket=None, unit=None, module="mlp.fc2"):
    return Crossing(nth, op, phase, module if phase == "forward" else "",
                    0 if phase == "forward" else None, list(group) if nth is not None else None,
                    dtype, "sum" if nth is not None else None, *fed, *got, absmax, list(params),
                    bucket, unit, "train.py:9", [dtype], [[4]], seq=nth)


def summary(rank, phase, *crossings, buckets=()):
    return RankSummary(rank, phase, "nan" if phase else 1.0, "nan" if phase else None,
                       buckets=list(buckets), crossings=list(crossings))


# DDP's view of the bucket: finite gradients into the comm hook, inf out of it
INF_OUT = [Bucket(0, ["fc1.weight", "head.bias"], 0, 0, 0, 1)]


def test_a_rank_that_fed_the_collective_computed_it_the_others_received_it():
    # rank 1 made NaN in forward; the all-reduce handed it to rank 0
    s = [summary(0, "forward", cross(0, got=(6, 0))),
         summary(1, "forward", cross(0, fed=(6, 0), got=(6, 0)))]
    p = rank_paths(s)
    assert (p[0].how, p[0].via.op, p[0].from_ranks) == ("received", AR, [1])
    assert (p[1].how, p[1].via) == ("computed", None)
    assert birth(p)[:2] == ("computed", [1])


def test_finite_inputs_on_every_rank_and_inf_out_is_born_in_the_collective():
    # a float16 sum of 23376 and 47264 overflows: nobody computed the inf
    s = [summary(r, "forward", cross(0, dtype="float16", got=(0, 4), absmax=a))
         for r, a in ((0, 23376.0), (1, 47264.0))]
    p = rank_paths(s)
    assert [q.how for q in p.values()] == ["born-in-collective"] * 2
    how, ranks, c = birth(p)
    assert (how, ranks, c.overflow) == ("collective", [0, 1], True)
    results = [RankResult(x.rank, plan=Plan("forward", 0, True), summary=x) for x in s]
    rep = job_report(RunFacts("b", "t.py:f", "cpu", "none", {"0": {"first": "loss"}},
                              Losses(1.0, "nan")), 2, "gloo", results)
    assert (rep.verdict, rep.classification, rep.phase) == ("culprit", "communication",
                                                           "forward")
    assert (rep.culprit.op, rep.culprit.module, rep.culprit.module_call) == (AR, "mlp.fc2", 0)
    said = " ".join(rep.notes)
    assert "float16 sum overflowed (over 65504)" in said and "rank 1 47264" in said
    assert all(r.path.how == "born-in-collective" and r.root.collective for r in rep.ranks)


def test_an_op_of_a_comm_hook_that_overflows_on_one_rank_names_that_rank_and_parameter():
    cast = dict(op="aten._to_copy.default", phase="grad-reduce", bucket=0, dtype="float16")
    s = [summary(0, "backward", cross(0, phase="grad-reduce", group=(0, 1), dtype="float16",
                                      got=(0, 1), bucket=0, params=["head.bias"]),
                 buckets=INF_OUT),
         summary(1, "backward", cross(None, got=(0, 1), absmax=74000.0, params=["head.bias"],
                                      **cast),
                 cross(0, phase="grad-reduce", dtype="float16", fed=(0, 1), got=(0, 1),
                       bucket=0, params=["head.bias"]), buckets=INF_OUT)]
    p = rank_paths(s)
    assert (p[1].how, p[1].via.op) == ("computed", "aten._to_copy.default")
    assert (p[0].how, p[0].from_ranks) == ("received", [1])
    assert decide(s) == Plan("grad-reduce", 1)
    results = [RankResult(x.rank, plan=decide(s), summary=x) for x in s]
    rep = job_report(RunFacts("b", "t.py:f", "cpu", "none", {"1": {"first": "grad"}},
                              Losses(1.0, 1.0)), 2, "gloo", results)
    c = rep.culprit
    assert (rep.classification, rep.phase, c.rank, c.op, c.parameter) == (
        "communication", "grad-reduce", 1, "aten._to_copy.default", "head.bias")
    said = " ".join(rep.notes)
    assert "largest magnitude fed in: 74000" in said
    assert "rank 0 received it through c10d.allreduce_.default in DDP bucket 0's comm hook" \
        in said and "from rank 1" in said


def test_a_rank_whose_side_of_the_collective_is_unknown_is_not_called_the_birthplace():
    # rank 1 kept its entries before it reached collective 20: who fed it is not known
    full = [cross(i, got=(0, 0), fed=(1, 0)) for i in range(16)]
    s = [summary(0, "forward", cross(20, got=(2, 0))), summary(1, "forward", *full)]
    p = rank_paths(s)
    assert (p[0].how, p[0].from_ranks) == ("received", [])


def test_the_same_collective_is_matched_by_its_place_in_its_group_not_in_the_step():
    # rank 0 and 1 issued one collective more on their pair's group than rank 2 and 3 did:
    # the world's all-reduce is the 3rd collective on ranks 0-1 and the 2nd on 2-3
    world = (0, 1, 2, 3)

    def ar(nth, seq, **kw):
        return replace(cross(nth, group=world, **kw), seq=seq)

    s = [summary(0, "forward", ar(2, 1, got=(1, 0))), summary(1, "forward", ar(2, 1, got=(1, 0))),
         summary(2, "forward", ar(1, 1, fed=(1, 0), got=(1, 0))),
         summary(3, "forward", ar(1, 1, got=(1, 0)))]
    p = rank_paths(s)
    assert [(p[r].how, p[r].from_ranks) for r in range(4)] == [
        ("received", [2]), ("received", [2]), ("computed", []), ("received", [2])]


def test_a_rank_that_failed_in_forward_before_anything_crossed_computed_it():
    s = [summary(0, "forward", cross(3, phase="backward", got=(1, 0)))]
    assert rank_paths(s)[0].how == "computed"


def test_a_rank_that_stayed_finite_has_no_path():
    assert rank_paths([summary(0, None)])[0].how is None
