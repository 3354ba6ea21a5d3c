"""Higher-order and functional autograd on distributed models: a gradient penalty on the parameters'
gradients (WGAN-GP style, ``paddle.grad(..., create_graph=True)``), an R1 penalty on the input gradient, input
saliency (``x.grad`` of a plain input entering ap.parallelize's input sharding), a batched Hessian, and the
gradient through ``DistTensor.full()`` in the simulated world: losses and every parameter equal one process."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from loops2_helpers import XS, YS, One, Parallelize, both, full, params


def train(env, loss_fn, steps=2):
    m = env.model()
    m, opt = env.wrap(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()))
    losses = []
    for s in range(steps):
        loss = loss_fn(m, env, s)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, params(m)


def param_penalty(m, env, s):
    loss = F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))
    gs = paddle.grad(loss, list(m.parameters()), create_graph=True)
    return loss + 0.1 * sum((g * g).sum() for g in gs)


def input_penalty(m, env, s):
    x = env.x(XS[s])
    x.stop_gradient = False
    out = m(x)
    g, = paddle.grad(out.sum(), [x], create_graph=True)
    return F.mse_loss(out, paddle.to_tensor(YS[s])) + 0.1 * (g * g).sum()


@pytest.mark.parametrize("run", ["dp x tp", "zero3", "parallelize tp", "parallelize zero3"])
def test_parameter_gradient_penalty(run):
    both(run, lambda env: train(env, param_penalty))


@pytest.mark.parametrize("run", ["dp x tp", "parallelize dp", "parallelize zero3"])
def test_input_gradient_penalty(run):
    both(run, lambda env: train(env, input_penalty))


def test_penalty_cut_at_collectives_is_the_control():
    """Without the differentiable adjoint of the collectives the second-order terms through communication are
    lost: the same tensor-parallel run with the collectives' backward forced to no_grad differs."""
    from autoparallel.comm import collectives as C

    orig = C._differentiable_backward
    C._differentiable_backward = _no_grad
    try:
        with pytest.raises(AssertionError):
            both("dp x tp", lambda env: train(env, param_penalty))
    finally:
        C._differentiable_backward = orig


def _no_grad(ctx, gs):
    from autoparallel.local_mode import local_mode

    with paddle.no_grad(), local_mode():
        outs = ctx.bwd(dict(zip(ctx.order, gs)))
    return tuple(outs[r] for r in ctx.order)


def saliency(env):
    m = env.model()
    m, _ = env.wrap(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()))
    x = paddle.to_tensor(XS[0])
    x.stop_gradient = False
    F.mse_loss(m(x), paddle.to_tensor(YS[0])).backward()
    return x.grad


@pytest.mark.parametrize("tp", [1, 2])
def test_plain_input_gradient_through_parallelize(tp):
    want = saliency(One()).numpy()
    with ap.simulate(world_size=4):
        got = saliency(Parallelize(tp=tp))
    assert got is not None                   # the input sharding used to detach it: x.grad stayed None
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def hessian(env):
    m = env.model()
    m, _ = env.wrap(m, paddle.optimizer.SGD(0.1, parameters=m.parameters()))
    x = paddle.to_tensor(XS[0][:4])
    x.stop_gradient = False
    out = m(x)
    return full(paddle.autograd.hessian((out * out).sum(axis=1), x, batch_axis=0)[:])


def test_hessian_under_tensor_parallel():
    want = hessian(One())
    with ap.simulate(world_size=4):
        got = hessian(Parallelize(tp=2))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_gradient_through_full_reaches_every_shard():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        x = ap.shard_tensor(paddle.to_tensor(np.arange(4.0, dtype="float32")), mesh, [ap.Shard(0)])
        x.stop_gradient = False
        y = x.full()
        (y * y).sum().backward()
        np.testing.assert_allclose(full(x.grad), [0.0, 2.0, 4.0, 6.0])     # was [0, 2, 0, 0]: rank 0's shard only


def shrink_by_vector(m, env, s):
    if s == 1:                                 # paddle.nn.utils round trip of every parameter's value
        v = paddle.nn.utils.parameters_to_vector(m.parameters())
        paddle.nn.utils.vector_to_parameters(v * 0.9, m.parameters())
    return F.mse_loss(m(env.x(XS[s])), paddle.to_tensor(YS[s]))


@pytest.mark.parametrize("run", ["zero3", "parallelize tp"])
def test_parameter_vector_round_trip(run):
    both(run, lambda env: train(env, shrink_by_vector))
