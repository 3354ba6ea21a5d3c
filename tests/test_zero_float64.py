"""ZeRO keeps float64 parameters in float64: master weights, packed gradient chunks and the step, as the data-
parallel buckets do (``grads._bucket_dtype``). Stages 1/2/3 on a float64 MLP (simulated 4 ranks, data parallel 2 x
tensor parallel 2 for stages 1/2, sharding over 4 for stage 3) equal the float64 one-process run to 1e-12; a
float32 packing would differ by ~1e-7 (negative control). A binding ClipGradByGlobalNorm sums the squares in
float64 too (paddle's clip does for float64 gradients)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 6)) for _ in range(3)]
YS = [RNG.standard_normal((8, 4)) for _ in range(3)]


def mlp():
    paddle.set_default_dtype("float64")
    try:
        paddle.seed(3)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    finally:
        paddle.set_default_dtype("float32")


def tp_fn(name, layer, mesh):
    if name == "0":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Replicate(), ap.Shard(0)])
    if name == "2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(0)])


def run(stage=None, clip=None):
    m = mlp()
    opt = paddle.optimizer.AdamW(0.05, parameters=m.parameters(), weight_decay=0.1,
                                 grad_clip=clip and paddle.nn.ClipGradByGlobalNorm(clip))
    x = paddle.to_tensor
    if stage is not None:
        mesh = (ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"]) if stage < 3
                else ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"]))
        m = ap.shard_layer(m, mesh, tp_fn if stage < 3 else None)
        zero = {1: ap.ShardingStage1, 2: ap.ShardingStage2, 3: ap.ShardingStage3}[stage]
        opt = ap.shard_optimizer(opt, zero("dp", mesh))
        place = [ap.Shard(0), ap.Replicate()] if stage < 3 else [ap.Shard(0)]
        x = lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, place)          # noqa: E731
    losses = []
    for s in range(3):
        loss = F.mse_loss(m(x(XS[s])), paddle.to_tensor(YS[s]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, {n: (p.full() if ap.is_dist(p) else p) for n, p in m.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return run()


@pytest.mark.parametrize("stage,clip", [(1, None), (2, None), (3, None), (2, 0.05), (3, 0.05)])
def test_zero_float64_equals_the_float64_one_process_run(reference, stage, clip):
    """With a binding ClipGradByGlobalNorm too: the norm is summed in float64 as paddle's is for float64."""
    want = reference if clip is None else run(clip=clip)
    with ap.simulate(world_size=4):
        losses, params = run(stage, clip)
    np.testing.assert_allclose(losses, want[0], rtol=1e-12, atol=1e-14)
    for n, v in want[1].items():
        assert params[n].dtype == paddle.float64, n
        np.testing.assert_allclose(params[n].numpy(), v.numpy(), rtol=1e-12, atol=1e-14, err_msg=n)


def test_the_clip_binds(reference):
    assert not np.allclose(run(clip=0.05)[1]["0.weight"].numpy(), reference[1]["0.weight"].numpy(), rtol=1e-6)


def test_float32_packing_negative_control(reference, monkeypatch):
    """The same run with float32 master weights and chunks is off by far more than the tolerance above."""
    monkeypatch.setattr("autoparallel.parallel.sharding._master_dtype", lambda t: "float32")
    with ap.simulate(world_size=4):
        _, params = run(2)
    with pytest.raises(AssertionError):
        for n, v in reference[1].items():
            np.testing.assert_allclose(params[n].numpy(), v.numpy(), rtol=1e-12, atol=1e-14, err_msg=n)


def hand_clip(parallel):
    """paddle.nn.utils.clip_grad_norm_ called between backward and step on a float64 model (data parallel 4)."""
    m = mlp()
    opt = paddle.optimizer.Momentum(0.05, parameters=m.parameters())
    if parallel:
        s = ap.Strategy()
        s.data_parallel.degree = 4
        m, opt = ap.parallelize(m, opt, strategy=s)
    norms = []
    for s in range(3):
        F.mse_loss(m(paddle.to_tensor(XS[s])), paddle.to_tensor(YS[s])).backward()
        norms.append(float(paddle.nn.utils.clip_grad_norm_(m.parameters(), 0.05)))
        opt.step()
        opt.clear_grad()
    return norms, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def test_clip_grad_norm_by_hand_on_float64_data_parallel_equals_one_process():
    want = hand_clip(False)
    with ap.simulate(world_size=4):
        got = hand_clip(True)
    assert min(want[0]) > 0.05                                   # the clip binds
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-12, atol=1e-14, err_msg=n)
