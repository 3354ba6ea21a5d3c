"""paddle's optimizer classes, norm clips and ZeRO stages over a shard_layer'd model, written as a paddle user
writes them, equal a single-process run (losses and every parameter), Lamb's whole-parameter norms on a
sharded parameter included."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as dist

RNG = np.random.default_rng(0)
DATA = [(RNG.standard_normal((8, 6)).astype("float32"), RNG.standard_normal((8, 4)).astype("float32"))
        for _ in range(2)]


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def tp_shard_fn(name, layer, mesh):
    if name == "fc1":
        layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate(), dist.Shard(1)])
        layer.bias = dist.shard_tensor(layer.bias, mesh, [dist.Replicate(), dist.Shard(0)])
    if name == "fc2":
        layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate(), dist.Shard(0)])


OPTIMIZERS = {
    "SGD": lambda ps, **kw: paddle.optimizer.SGD(0.05, parameters=ps, **kw),
    "Adagrad": lambda ps, **kw: paddle.optimizer.Adagrad(0.05, parameters=ps, **kw),
    "RMSProp": lambda ps, **kw: paddle.optimizer.RMSProp(0.05, momentum=0.5, centered=True, parameters=ps, **kw),
    "Adamax": lambda ps, **kw: paddle.optimizer.Adamax(0.05, parameters=ps, **kw),
    "Adadelta": lambda ps, **kw: paddle.optimizer.Adadelta(0.5, parameters=ps, **kw),
    "NAdam": lambda ps, **kw: paddle.optimizer.NAdam(0.05, parameters=ps, **kw),
    "RAdam": lambda ps, **kw: paddle.optimizer.RAdam(0.05, parameters=ps, **kw),
    "Lamb": lambda ps, **kw: paddle.optimizer.Lamb(0.05, parameters=ps, **kw),
}


def plain_step(loss, opt):
    loss.backward()
    opt.step()
    opt.clear_grad()


def fit(model, opt, to_input=paddle.to_tensor, step=plain_step):
    losses = []
    for x, y in DATA:
        loss = F.mse_loss(model(to_input(x)), paddle.to_tensor(y))
        step(loss, opt)
        losses.append(float(loss))
    return losses, {n: (p.full() if dist.is_dist(p) else p).numpy() for n, p in model.named_parameters()}


def reference(make_opt, step=plain_step):
    paddle.seed(3)
    m = MLP()
    return fit(m, make_opt(m.parameters()), step=step)


def distributed(make_opt, shard_fn=tp_shard_fn, stage=None, step=plain_step):
    with dist.simulate(world_size=4):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        paddle.seed(3)
        m = dist.shard_layer(MLP(), mesh, shard_fn)
        opt = dist.shard_optimizer(make_opt(m.parameters()), None if stage is None else stage("dp", mesh))
        return fit(m, opt, lambda x: dist.shard_tensor(x, mesh, [dist.Shard(0), dist.Replicate()]), step)


def assert_same(got, want, tol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=tol, atol=tol, err_msg=n)


@pytest.mark.parametrize("kind", [k for k in OPTIMIZERS if k != "Lamb"])
def test_elementwise_optimizers_under_tensor_parallel_equal_one_process(kind):
    assert_same(distributed(OPTIMIZERS[kind]), reference(OPTIMIZERS[kind]))


@pytest.mark.parametrize("kind", ["Adagrad", "RMSProp"])
def test_elementwise_optimizers_under_zero_equal_one_process(kind):
    assert_same(distributed(OPTIMIZERS[kind], stage=dist.ShardingStage2), reference(OPTIMIZERS[kind]))


def test_lamb_over_replicated_parameters_equals_one_process():
    assert_same(distributed(OPTIMIZERS["Lamb"], shard_fn=None), reference(OPTIMIZERS["Lamb"]))


def test_lamb_over_sharded_parameters_equals_one_process():
    """The whole parameter's trust ratio (parallel/lamb_whole.py); the control below steps each shard alone."""
    assert_same(distributed(OPTIMIZERS["Lamb"]), reference(OPTIMIZERS["Lamb"]))


def test_lamb_shard_norms_would_differ():
    """Negative control for the refusal: paddle's Lamb stepping each shard alone gives another value."""
    from autoparallel.parallel.optimizer import ShardedOptimizer

    check = ShardedOptimizer._check_whole_tensor_update
    ShardedOptimizer._check_whole_tensor_update = lambda self: None
    try:
        with pytest.raises(AssertionError):
            assert_same(distributed(OPTIMIZERS["Lamb"]), reference(OPTIMIZERS["Lamb"]))
    finally:
        ShardedOptimizer._check_whole_tensor_update = check


@pytest.mark.parametrize("clip", [lambda: nn.ClipGradByNorm(0.05), lambda: nn.ClipGradByGlobalNorm(0.05),
                                  lambda: nn.ClipGradByValue(0.01)])
def test_gradient_clips_under_tensor_parallel_equal_one_process(clip):
    make = lambda ps: paddle.optimizer.Momentum(0.05, parameters=ps, grad_clip=clip())   # noqa: E731
    assert_same(distributed(make), reference(make))


def test_per_parameter_norm_clip_on_shards_alone_differs(monkeypatch):
    """Negative control: ClipGradByNorm by each shard's own norm (paddle's clip on local shards) differs."""
    monkeypatch.setattr("autoparallel.parallel.optimizer.ShardedOptimizer._clip_global_norm", lambda self: None)
    make = lambda ps: paddle.optimizer.Momentum(0.05, parameters=ps, grad_clip=nn.ClipGradByNorm(0.05))  # noqa
    with pytest.raises(AssertionError):
        assert_same(distributed(make), reference(make))


def minimize_step(loss, opt):
    loss.backward()
    opt.minimize(loss)
    opt.clear_grad()


def scaler_minimize_step(loss, opt):
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(opt, scaled)
    opt.clear_grad()


def halving_lr_step(loss, opt):
    plain_step(loss, opt)
    opt.set_lr(opt.get_lr() * 0.5)


@pytest.mark.parametrize("step", [minimize_step, scaler_minimize_step, halving_lr_step])
@pytest.mark.parametrize("stage", [None, dist.ShardingStage2])
def test_minimize_and_set_lr_equal_one_process(step, stage):
    make = OPTIMIZERS["SGD"] if step is not halving_lr_step else \
        (lambda ps: paddle.optimizer.Adam(0.05, parameters=ps))
    assert_same(distributed(make, stage=stage, step=step), reference(make, step=step))


def test_set_lr_negative_control():
    """The learning rate matters: stepping without halving differs from the halving reference."""
    make = lambda ps: paddle.optimizer.Adam(0.05, parameters=ps)          # noqa: E731
    with pytest.raises(AssertionError):
        assert_same(distributed(make, stage=dist.ShardingStage2), reference(make, step=halving_lr_step))


def test_minimize_of_a_subset_is_refused():
    def step(loss, opt):
        loss.backward()
        opt.minimize(loss, parameters=opt.parameters[:1])
    with pytest.raises(NotImplementedError, match="minimize\\(parameters="):
        distributed(OPTIMIZERS["SGD"], step=step)


GROUPS = {
    "momentum L2Decay": lambda ps: paddle.optimizer.Momentum(0.05, parameters=ps,
                                                             weight_decay=paddle.regularizer.L2Decay(0.1)),
    "param groups": lambda ps: paddle.optimizer.AdamW(0.05, parameters=[
        {"params": list(ps)[:2], "learning_rate": 0.5}, {"params": list(ps)[2:], "weight_decay": 0.0}]),
}


@pytest.mark.parametrize("kind", list(GROUPS))
@pytest.mark.parametrize("stage", [None, dist.ShardingStage1])
def test_weight_decay_and_parameter_groups_equal_one_process(kind, stage):
    assert_same(distributed(GROUPS[kind], stage=stage), reference(GROUPS[kind]))


@pytest.mark.parametrize("make", [
    OPTIMIZERS["Adagrad"],
    lambda ps: paddle.optimizer.AdamW(0.05, parameters=ps, grad_clip=nn.ClipGradByGlobalNorm(0.05)),
])
def test_stage3_over_a_shard_layer_model_equals_one_process(make):
    """paddle's ShardingStage3 on a model distributed by shard_layer (it needed ap.parallelize); parameters
    are read back (full()) while released between uses."""
    assert_same(distributed(make, stage=dist.ShardingStage3), reference(make))
