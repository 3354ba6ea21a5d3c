"""paddle.amp.GradScaler in the forms a paddle user writes beyond ``scaler.scale(loss).backward()``, over a DP x TP
model and ZeRO 1/2/3, equal one process seeing the same overflow (an inf in ONE data-parallel rank's batch skips
the step on every rank and halves the scale once):

* the backward starts from a tensor computed from the scaled loss (``(scaler.scale(loss) / k).backward()``,
  ``(scaled * 0.5)``, ``scaled.sum()``): ZeRO used to reduce the gradients from the first backward's hooks (the
  root was not the tensor the scaler marked), and the step then raised instead of unscaling;
* one scaler stepping two optimizers (paddle's rule: each optimizer skips on its own overflow, the scale follows the
  optimizer stepped last);
* bfloat16 parameters with ``ClipGradByGlobalNorm`` under TP and ZeRO (paddle has no bfloat16 CPU
  ``squared_l2_norm``, so one process crashes; compared with paddle's clip math in float32 on the bfloat16
  gradients, within 2 bfloat16 ulps);
* a warm-up step without the scaler before its steps (the step used to raise), and an unscaled and a scaled backward
  in one step (refused with a ValueError)."""
import warnings

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as dist
from autoparallel.testing.gpu_scaler import gpu_grad_scaler
from autoparallel.testing.precision import BATCHES, full_values, low_model
from test_probe_api_optimizers import MLP, tp_shard_fn
from test_probe_precision_scaler import DATA

BACKWARDS = {"div": lambda s: (s / 2).backward(), "mul": lambda s: (s * 0.5).backward(),
             "sum": lambda s: s.sum().backward()}


def mesh2x2():
    return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


def shard_x(mesh):
    return lambda x: dist.shard_tensor(paddle.to_tensor(x), mesh, [dist.Shard(0), dist.Replicate()])


def params(m):
    return {n: (p.full() if dist.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def train(m, opts, to_input, backward, poison=None, data=DATA):
    """3 steps of auto_cast(float16) + GradScaler, ``scaler.step`` on each optimizer in turn, one ``update``."""
    scaler = gpu_grad_scaler(init_loss_scaling=2.0**15, incr_every_n_steps=1, decr_every_n_nan_or_inf=1)
    losses, scales = [], []
    for i, (x, y) in enumerate(data):
        with paddle.amp.auto_cast(dtype="float16"):
            loss = F.mse_loss(m(to_input(x)), paddle.to_tensor(y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backward(scaler.scale(loss))
            if poison is not None and i == 0:
                poison(m)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        for opt in opts:
            opt.clear_grad()
        losses.append(float(loss))
        scales.append(float(scaler._scale))
    return losses, scales, params(m)


def assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1] == want[1]
    for n, v in want[2].items():
        np.testing.assert_allclose(got[2][n], v, rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("form,stage", [("div", dist.ShardingStage1), ("mul", dist.ShardingStage2),
                                        ("sum", dist.ShardingStage3)])
def test_a_backward_from_a_tensor_of_the_scaled_loss_under_zero(form, stage):
    paddle.seed(3)
    m = MLP()
    want = train(m, [paddle.optimizer.AdamW(0.05, parameters=m.parameters())], paddle.to_tensor, BACKWARDS[form])
    assert want[1] == [2.0**16, 2.0**15, 2.0**16]          # DATA[1] overflows on the second data-parallel rank
    with dist.simulate(world_size=4):
        mesh = mesh2x2()
        paddle.seed(3)
        m = dist.shard_layer(MLP(), mesh, tp_shard_fn)
        opt = dist.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters()), stage("dp", mesh))
        assert_same(train(m, [opt], shard_x(mesh), BACKWARDS[form]), want)


@pytest.mark.parametrize("order", ["fc1 first", "fc2 first"])
def test_one_scaler_two_optimizers_an_inf_in_one_tensor_parallel_shard(order):
    """An inf in fc1's gradient (one TP rank's shard): fc1's optimizer skips, fc2's steps; the scale is halved only
    when fc1's optimizer is stepped last (paddle keeps the last optimizer's found-inf for ``update``)."""
    def poison_full(m):
        a = m.fc1.weight.grad.numpy()
        a[0, 5] = np.inf
        m.fc1.weight.grad.set_value(paddle.to_tensor(a))

    def poison_shard(m):                            # rank 3 holds fc1.weight's columns 4..7
        t = m.fc1.weight.locals[3].grad
        a = t.numpy()
        a[0, 1] = np.inf
        t.set_value(paddle.to_tensor(a))

    def opts(m, wrap=lambda o: o):
        a = wrap(paddle.optimizer.AdamW(0.05, parameters=m.fc1.parameters()))
        b = wrap(paddle.optimizer.AdamW(0.05, parameters=m.fc2.parameters()))
        return [a, b] if order == "fc1 first" else [b, a]

    clean = [DATA[0], DATA[2], DATA[0]]
    paddle.seed(3)
    m = MLP()
    want = train(m, opts(m), paddle.to_tensor, BACKWARDS["div"], poison_full, clean)
    assert want[1][0] == (2.0**16 if order == "fc1 first" else 2.0**14)
    with dist.simulate(world_size=4):
        mesh = mesh2x2()
        paddle.seed(3)
        m = dist.shard_layer(MLP(), mesh, tp_shard_fn)
        got = train(m, opts(m, lambda o: dist.shard_optimizer(o, dist.ShardingStage2("dp", mesh))),
                    shard_x(mesh), BACKWARDS["div"], poison_shard, clean)
    assert_same(got, want)


def clip_math():
    """paddle's ClipGradByGlobalNorm on a bfloat16 model in float32 numbers: the global norm of the bfloat16
    gradients, each scaled by clip / max(norm, clip) and rounded to bfloat16; SGD without masters."""
    m = low_model()
    for x in BATCHES:
        m(paddle.to_tensor(x).astype("bfloat16")).backward()
        gs = {n: p.grad.astype("float32").numpy() for n, p in m.named_parameters()}
        norm = np.sqrt(sum(float((g * g).sum()) for g in gs.values()))
        for n, p in m.named_parameters():
            g = paddle.to_tensor(gs[n] * (0.5 / max(norm, 0.5))).astype("bfloat16").astype("float32").numpy()
            p.set_value(paddle.to_tensor(p.astype("float32").numpy() - 0.01 * g).astype("bfloat16"))
        m.clear_gradients()
    return full_values(m)


@pytest.mark.parametrize("stage", [None, dist.ShardingStage2])
def test_bfloat16_global_norm_clip_under_tensor_parallel(stage):
    want = clip_math()
    with pytest.raises(RuntimeError, match="squared_l2_norm"):          # one process: no bfloat16 CPU kernel
        m = low_model()
        opt = paddle.optimizer.SGD(0.01, parameters=m.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
        m(paddle.to_tensor(BATCHES[0]).astype("bfloat16")).backward()
        opt.step()

    def tp(name, layer, mesh):
        layer.w = dist.shard_tensor(layer.w, mesh, [dist.Replicate(), dist.Shard(1)])
        layer.b = dist.shard_tensor(layer.b, mesh, [dist.Replicate(), dist.Shard(0)])

    with dist.simulate(world_size=4):
        mesh = mesh2x2()
        m = dist.shard_layer(low_model(), mesh, tp)
        opt = paddle.optimizer.SGD(0.01, parameters=m.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
        opt = dist.shard_optimizer(opt, None if stage is None else stage("dp", mesh))
        for x in BATCHES:
            m(shard_x(mesh)(paddle.to_tensor(x).astype("bfloat16"))).backward()
            opt.step()
            opt.clear_grad()
        got = full_values(m)
    for n, v in want.items():
        np.testing.assert_allclose(got[n], v, rtol=2 * 2.0**-7, atol=1e-3, err_msg=n)


@pytest.mark.parametrize("stage", [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3])
def test_grad_scaler_after_unscaled_zero_steps(stage):
    """A warm-up step without the scaler (``loss.backward(); opt.step()``), then GradScaler steps: the hooks the
    unscaled backward installed (reducing gradients out of p.grad during backward) stop at the first scaled
    backward; before, the scaler's step raised."""
    def loop(m, opt, to_input):
        scaler = gpu_grad_scaler(init_loss_scaling=2.0**15, incr_every_n_steps=2)
        losses, scales = [], []
        for i, (x, y) in enumerate([DATA[0]] + DATA):
            with paddle.amp.auto_cast(dtype="float16"):
                loss = F.mse_loss(m(to_input(x)), paddle.to_tensor(y))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if i == 0:
                    loss.backward()
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
            opt.clear_grad()
            losses.append(float(loss))
            scales.append(float(scaler._scale))
        return losses, scales, params(m)

    paddle.seed(3)
    m = MLP()
    want = loop(m, paddle.optimizer.AdamW(0.05, parameters=m.parameters()), paddle.to_tensor)
    assert want[1] == [2.0**15, 2.0**15, 2.0**14, 2.0**14]
    with dist.simulate(world_size=4):
        mesh = mesh2x2()
        paddle.seed(3)
        m = dist.shard_layer(MLP(), mesh, tp_shard_fn)
        opt = dist.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters()), stage("dp", mesh))
        assert_same(loop(m, opt, shard_x(mesh)), want)


def test_an_unscaled_backward_in_the_scalers_step_is_refused():
    """``loss.backward()`` then ``scaler.scale(loss).backward()`` before one ``scaler.step``: the step's gradients mix
    two scales (one process would step on them silently); ZeRO reduced the unscaled ones during their backward, so
    the step raises a ValueError on every rank, naming the form expected."""
    with dist.simulate(world_size=4):
        mesh = mesh2x2()
        m = dist.shard_layer(MLP(), mesh, tp_shard_fn)
        opt = dist.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=m.parameters()),
                                   dist.ShardingStage2("dp", mesh))
        scaler = gpu_grad_scaler(init_loss_scaling=2.0**15)
        x, y = DATA[0]
        for scaled in (False, True):
            with paddle.amp.auto_cast(dtype="float16"):
                loss = F.mse_loss(m(shard_x(mesh)(x)), paddle.to_tensor(y))
            (scaler.scale(loss) if scaled else loss).backward()
        with pytest.raises(ValueError, match=r"expected scaler.scale\(loss\).backward\(\) for every backward"):
            scaler.step(opt)
