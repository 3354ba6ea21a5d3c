"""Real gloo ranks (4, one launch): gradient reductions launched from backward hooks. Losses and final
parameters equal the single-process run (DP4, DP4 with sync_op=False, DP2xTP2 with gradient accumulation,
more backward passes than announced, ZeRO-2/3); from the first step on each backward issues one
all_reduce per bucket (the number of buckets planned in-process for the same model) and the step none; a
non-final accumulation micro-step issues no gradient reduction; a negative control fails the comparison."""
import os
import pathlib

import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.parallel.grads import plan_buckets
from autoparallel.parallelize import parallelize
from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "reducer_worker.py")

from zero_common import assert_matches, batches, make_opt, matches, tiny  # noqa: E402

STEPS = 4
BUCKET_BYTES = 40 * 1024                 # several buckets for the tiny GPT (170 kB of parameters)
JOB = shared_launch.job(__name__, "reducer", WORKER, 4, args=lambda out: [out, BUCKET_BYTES])


def reference(ga):
    """Single process: ``ga`` micro-batches per step, gradients averaged over them."""
    m = tiny()
    opt = make_opt(m)
    data = batches(STEPS * ga)
    losses = []
    for i in range(STEPS):
        total = 0.0
        for j in range(ga):
            x, y = data[i * ga + j]
            loss = F.cross_entropy(m(paddle.to_tensor(x)), paddle.to_tensor(y))
            (loss * (1.0 / ga)).backward()
            total += float(loss) / ga
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses, {n: p.numpy() for n, p in m.named_parameters()}


def planned_buckets(dp, tp):
    """The DP buckets of the same model, planned in the simulated world."""
    s = ap.Strategy()
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    with ap.simulate(world_size=4):
        m = tiny()
        m, _ = parallelize(m, make_opt(m), strategy=s)
        x, _ = batches(1)[0]
        m(paddle.to_tensor(x))                     # the forward records the partial dims
        return len(plan_buckets(list(m.parameters()), BUCKET_BYTES))


@pytest.fixture(scope="module")
def run():
    out, ranks = shared_launch.results(JOB)
    return pathlib.Path(out), ranks


@pytest.fixture(scope="module")
def refs():
    return {1: reference(1), 2: reference(2)}


@pytest.mark.parametrize("name,ga", [("dp4", 1), ("dp4_async", 1), ("dp4_step_time", 1), ("dp2tp2_ga2", 2),
                                     ("dp2tp2_ga2_step_time", 2), ("dp4_ga2_expect1", 2), ("zero2", 1),
                                     ("zero3", 1)])
def test_matches_single_process(run, refs, name, ga):
    assert_matches(name, run, refs[ga])


def test_negative_control_fails(run, refs):
    """A late gradient accumulated onto the reduced value without turning it back into partial sums:
    the next reduction counts the reduced part once per rank."""
    assert matches("neg_no_partial", run, refs[2]) == (False, False)


def all_reduces(calls):
    return sum(c == "all_reduce" for c in calls)


def eager(rank_result, i):
    """all_reduces of step i's backward without hooks: the eager ones dispatch inserts (the positional
    embedding's output meets the batch-sharded token embedding), not gradient buckets."""
    return all_reduces(rank_result["configs"]["dp4_step_time"]["steps"][i]["backward"][0])


@pytest.mark.parametrize("name", ["dp4", "dp4_async"])
def test_one_all_reduce_per_bucket_in_backward(run, name):
    n = planned_buckets(4, 1)
    assert n >= 3
    for r in run[1]:
        cfg = r["configs"][name]
        assert cfg["buckets"] == n
        for i, s in enumerate(cfg["steps"]):              # buckets fixed as the first backward starts
            assert all_reduces(s["backward"][0]) == eager(r, i) + n and all_reduces(s["step"]) == 0
            assert i == 0 or s["launches"] == [[j, "backward"] for j in range(n)]


def test_step_time_reduction_counts(run):
    n = planned_buckets(4, 1)
    for r in run[1]:
        for s in r["configs"]["dp4_step_time"]["steps"]:
            assert s["step"] == ["all_reduce"] * n and s["launches"] == []


def test_accumulation_reduces_on_the_final_micro_step_only(run):
    """DP2xTP2 backward also runs tensor-parallel all_reduces; the hooks add one per bucket to the final
    micro-step's backward and none to the first."""
    n = planned_buckets(2, 2)
    for r in run[1]:
        hooks, plain = r["configs"]["dp2tp2_ga2"], r["configs"]["dp2tp2_ga2_step_time"]
        assert hooks["buckets"] == n and all_reduces(plain["steps"][0]["step"]) == n
        for i, (h, p) in enumerate(zip(hooks["steps"], plain["steps"])):
            extra = n
            assert all_reduces(h["backward"][0]) == all_reduces(p["backward"][0])
            assert all_reduces(h["backward"][1]) == all_reduces(p["backward"][1]) + extra
            assert all_reduces(h["step"]) == all_reduces(p["step"]) - extra


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_zero_reduce_scatters_in_backward(run, name):
    """gloo emulates reduce_scatter with one all_reduce per bucket."""
    for r in run[1]:
        cfg = r["configs"][name]
        n = cfg["buckets"]
        assert n >= 3
        for i, s in enumerate(cfg["steps"]):              # from the first backward on
            assert all_reduces(s["backward"][0]) == eager(r, i) + n and all_reduces(s["step"]) == 0
            assert i == 0 or [l[1] for l in s["launches"]] == ["backward"] * n
