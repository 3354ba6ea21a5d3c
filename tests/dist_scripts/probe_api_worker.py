"""Runs on every rank (2): the user forms of docs/api_user_forms.md on real gloo ranks (one shard per process),
each check against the single-process value computed on the rank itself; reports {check: True / error text}."""
import traceback

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap
from autoparallel.testing.launch import write_result

world = ap.init_parallel_env()
MESH = ap.ProcessMesh([0, 1], dim_names=["x"])
X = np.arange(24, dtype="float32").reshape(4, 6)
RNG = np.random.default_rng(0)
DATA = [(RNG.standard_normal((8, 6)).astype("float32"), RNG.standard_normal((8, 4)).astype("float32"))
        for _ in range(2)]


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def tp(name, layer, mesh):
    if name == "fc1":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Shard(0)])
    if name == "fc2":
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Shard(0)])


def fit(make_opt, shard_fn=None, stage=None, step=None):
    paddle.seed(3)
    m = MLP()
    if shard_fn is not False:
        m = ap.shard_layer(m, MESH, shard_fn)
    opt = make_opt(m.parameters())
    if shard_fn is not False:
        opt = ap.shard_optimizer(opt, None if stage is None else stage("x", MESH))
    losses = []
    for x, y in DATA:
        xin = paddle.to_tensor(x) if shard_fn is False else ap.shard_tensor(x, MESH, [ap.Replicate()])
        loss = F.mse_loss(m(xin), paddle.to_tensor(y))
        (step or _step)(loss, opt)
        losses.append(float(loss))
    return losses, {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def _step(loss, opt):
    loss.backward()
    opt.step()
    opt.clear_grad()


def same(make_opt, **kw):
    got, want = fit(make_opt, **kw), fit(make_opt, shard_fn=False, step=kw.get("step"))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for n, v in want[1].items():
        np.testing.assert_allclose(got[1][n], v, rtol=1e-5, atol=1e-6, err_msg=n)


def clip_by_norm():
    same(lambda ps: paddle.optimizer.Momentum(0.05, parameters=ps, grad_clip=nn.ClipGradByNorm(0.05)), shard_fn=tp)


def minimize_set_lr_zero():
    def step(loss, opt):
        loss.backward()
        opt.minimize(loss)
        opt.clear_grad()
        opt.set_lr(opt.get_lr() * 0.5)
    same(lambda ps: paddle.optimizer.Momentum(0.05, parameters=ps, weight_decay=paddle.regularizer.L2Decay(0.1)),
         stage=ap.ShardingStage2, step=step)


def zero3_read_back():
    same(lambda ps: paddle.optimizer.Adagrad(0.05, parameters=ps), stage=ap.ShardingStage3)


def lamb_whole_ratio():
    same(lambda ps: paddle.optimizer.Lamb(0.05, parameters=ps), shard_fn=tp)


def autograd_and_hooks():
    d = ap.shard_tensor(paddle.to_tensor(X), MESH, [ap.Shard(0)], stop_gradient=False)
    (g,) = paddle.grad((d * d).sum(), d)
    np.testing.assert_allclose(g.numpy(), 2 * X)
    y = d * 2
    y.register_hook(lambda gr: gr * 10)
    y.sum().backward()
    np.testing.assert_allclose(d.grad.numpy(), np.full_like(X, 20))
    lin = nn.Linear(6, 4)
    lin.weight = ap.shard_tensor(lin.weight, MESH, [ap.Shard(1)])
    lin.bias = ap.shard_tensor(lin.bias, MESH, [ap.Replicate()])
    lin.weight.register_hook(lambda gr: gr * 0)
    lin(ap.shard_tensor(paddle.ones([2, 6]), MESH, [ap.Replicate()])).sum().backward()
    assert not lin.weight.grad.numpy().any()


def set_value_and_init():
    lin = nn.Linear(6, 4)
    lin.weight = ap.shard_tensor(lin.weight, MESH, [ap.Shard(1)])
    v = np.arange(24, dtype="float32").reshape(6, 4)
    lin.weight.set_value(v)
    np.testing.assert_array_equal(lin.weight.full().numpy(), v)
    lin.weight.set_value(v[:, 2 * world.rank:2 * world.rank + 2] * 2)     # one shard held: this shard
    np.testing.assert_array_equal(lin.weight.full().numpy(), v * 2)
    nn.initializer.Constant(3.0)(lin.weight)
    np.testing.assert_array_equal(lin.weight.full().numpy(), np.full((6, 4), 3.0))


out = {}
for check in (clip_by_norm, minimize_set_lr_zero, zero3_read_back, lamb_whole_ratio, autograd_and_hooks,
              set_value_and_init):
    try:
        check()
        out[check.__name__] = True
    except Exception:                                    # noqa: BLE001  (reported per check)
        out[check.__name__] = traceback.format_exc()[-1500:]
write_result(out)
