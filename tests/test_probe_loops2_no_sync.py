"""``model.no_sync()`` (paddle.DataParallel's gradient-accumulation context) on distributed models: k-1
micro-batches under it, a synced backward, one step -- losses and every parameter equal one process, under
DP x TP, ZeRO 1/2/3, ap.parallelize and ap.DataParallel; no gradient reduction runs inside the context (counted
at the collectives), while the same loop without it reduces on the first micro-batch (the control)."""
import contextlib

import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.comm.counter import count_collectives
from loops2_helpers import RUNS, XS, YS, One, both, params

K = 3


def accumulate(env, use_no_sync=True, steps=2, log=None):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.AdamW(0.05, parameters=m.parameters()))
    losses = []
    for s in range(steps):
        for i in range(K):
            inside = use_no_sync and i < K - 1
            with m.no_sync() if inside else contextlib.nullcontext():
                loss = F.mse_loss(m(env.x(XS[s + i])), paddle.to_tensor(YS[s + i])) / K
                with count_collectives() as calls:      # backward only: the forward settles the loss's value
                    loss.backward()
            if log is not None and s == 0 and i == 0:
                log.update(calls.counts(rank=0))
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    return losses, params(m)


@pytest.mark.parametrize("run", ["dp x tp", "zero1", "zero2", "zero3", "parallelize dp", "parallelize zero3",
                                 "DataParallel"])
def test_no_sync_accumulation_equals_one_process(run):
    both(run, lambda env: accumulate(env, use_no_sync=type(env) is not One))     # one process: no wrapper


@pytest.mark.parametrize("run,reduction", [("parallelize dp", "all_reduce"), ("parallelize zero2", "reduce_scatter")])
def test_no_gradient_reduction_inside_no_sync(run, reduction):
    inside, plain = {}, {}
    with ap.simulate(world_size=4):
        accumulate(RUNS[run](), True, steps=1, log=inside)
    with ap.simulate(world_size=4):
        accumulate(RUNS[run](), False, steps=1, log=plain)
    assert inside.get(reduction, 0) == 0, inside
    assert plain.get(reduction, 0) >= 1, plain          # control: the first micro-batch reduces without no_sync


def test_no_sync_only_on_distributed_models_and_data_parallel_refused():
    assert not hasattr(paddle.nn.Linear(2, 2), "no_sync")       # PaddleFormers' Trainer asks hasattr()
    with ap.simulate(world_size=2):
        m = ap.shard_layer(paddle.nn.Linear(2, 2), ap.ProcessMesh([0, 1], dim_names=["dp"]))
        assert hasattr(m, "no_sync")
        with pytest.raises(NotImplementedError, match="paddle.DataParallel over Linear"):
            paddle.DataParallel(m)
    assert hasattr(paddle.DataParallel(paddle.nn.Linear(2, 2)), "no_sync")     # paddle's own stays
