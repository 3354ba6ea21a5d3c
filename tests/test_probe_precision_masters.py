"""A bfloat16 model (``model.to(dtype="bfloat16")``) trained under data parallel and ZeRO 1/2/3 equals one process
(SGD: the one paddle optimizer with a bfloat16 CPU kernel), and ``multi_precision`` means what it means in paddle:
True keeps float32 masters (sharded as the state is), False loses an update below half a bfloat16 ulp.

Paddle's CPU SGD kernel ignores its master weights (it updates the bfloat16 value), so the multi_precision=True
reference is the math paddle documents: a float32 master stepped with the bfloat16 gradient, the parameter its
rounding."""
import numpy as np
import paddle
import pytest

import autoparallel as dist
from autoparallel.testing.precision import BATCHES as X, Scale, low_model, full_values as full

BF16 = 2.0**-7                                   # bfloat16's relative spacing


def sgd(ps, mp):
    return paddle.optimizer.SGD(0.01, parameters=ps, multi_precision=mp)


def adamw(ps, mp):
    return paddle.optimizer.AdamW(0.01, parameters=ps, multi_precision=mp)


def one_process(make_opt, mp):
    m = low_model()
    opt = make_opt(m.parameters(), mp)
    for x in X:
        m(paddle.to_tensor(x).astype("bfloat16")).backward()
        opt.step()
        opt.clear_grad()
    return full(m)


def master_math(make_opt):
    """float32 masters stepped with the gradient of the bfloat16 model at their rounding."""
    low = low_model()
    masters = [paddle.create_parameter(p.shape, "float32") for p in low.parameters()]
    for m, p in zip(masters, low.parameters()):
        m.set_value(p.astype("float32"))
    opt = make_opt(masters, False)
    for x in X:
        for m, p in zip(masters, low.parameters()):
            p.set_value(m.astype("bfloat16"))
        low(paddle.to_tensor(x).astype("bfloat16")).backward()
        for m, p in zip(masters, low.parameters()):
            m._set_grad_ivar(p.grad.astype("float32"))
        opt.step()
        opt.clear_grad()
        low.clear_gradients()
    return {n: m.astype("bfloat16").astype("float32").numpy() for (n, _), m in zip(low.named_parameters(), masters)}


def distributed(make_opt, mp, stage=None, inspect=None):
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        m = dist.shard_layer(low_model(), mesh)
        opt = dist.shard_optimizer(make_opt(m.parameters(), mp), None if stage is None else stage("dp", mesh))
        for x in X:
            m(dist.shard_tensor(paddle.to_tensor(x).astype("bfloat16"), mesh, [dist.Shard(0)])).backward()
            opt.step()
            opt.clear_grad()
        assert all(p.dtype == paddle.bfloat16 for p in m.parameters())
        if inspect:
            inspect(m, opt)
        return full(m)


def assert_close(got, want, ulps=2):
    for n, v in want.items():
        np.testing.assert_allclose(got[n], v, rtol=ulps * BF16, atol=1e-3, err_msg=n)


@pytest.mark.parametrize("stage", [None, dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3])
def test_bfloat16_sgd_without_masters_equals_one_process(stage):
    assert_close(distributed(sgd, False, stage), one_process(sgd, False))


def test_zero_adamw_keeps_float32_masters_sharded_like_the_state():
    def inspect(m, opt):
        zopt = opt.zero if hasattr(opt, "zero") else opt
        for r in (0, 1):
            chunks = zopt.master[r]
            for p in m.parameters():
                assert chunks[id(p)].dtype == paddle.float32
                assert chunks[id(p)].shape[0] * 2 >= int(np.prod(p.shape)) > chunks[id(p)].shape[0]   # half each

    got = distributed(adamw, True, dist.ShardingStage2, inspect)
    assert_close(got, master_math(adamw), ulps=1)


def _stagnation(mp, stage):
    """Ten SGD steps of 1e-3 on a parameter of 1.0: below half a bfloat16 ulp each."""
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        m = Scale(init=1.0)
        m.to(dtype="bfloat16")
        m = dist.shard_layer(m, mesh)
        opt = dist.shard_optimizer(paddle.optimizer.SGD(1.0, parameters=[m.w], multi_precision=mp), stage("dp", mesh))
        x = dist.shard_tensor(paddle.full([8, 4], 1e-3).astype("bfloat16"), mesh, [dist.Replicate()])
        for _ in range(10):
            (x * m.w).sum().backward()
            opt.step()
            opt.clear_grad()
        return float(m.w.full().astype("float32").numpy()[0, 0])


@pytest.mark.parametrize("stage", [dist.ShardingStage1, dist.ShardingStage3])
def test_multi_precision_flag_decides_whether_small_updates_survive(stage):
    assert _stagnation(False, stage) == 1.0                         # paddle without masters: every update lost
    assert _stagnation(True, stage) == pytest.approx(0.98828125)     # bfloat16(1 - 10 * 1e-3)
