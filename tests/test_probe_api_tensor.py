"""paddle's autograd and storage forms on distributed tensors, as a paddle user writes them: ``paddle.grad``
(also ``create_graph``, ``grad_outputs``), ``register_hook`` on a DistTensor and on a distributed parameter,
``item(*index)``, ``set_value`` with the global value; values against the full-tensor computation."""
import numpy as np
import paddle
import pytest

import autoparallel as dist

X = np.arange(24, dtype="float32").reshape(4, 6)


@pytest.fixture
def mesh():
    with dist.simulate(world_size=2):
        yield dist.ProcessMesh([0, 1], dim_names=["x"])


def test_paddle_grad_of_a_sharded_input(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    (g,) = paddle.grad((d * d).sum(), d)
    assert g.placements == [dist.Shard(0)]
    np.testing.assert_allclose(g.numpy(), 2 * X)
    (g,) = paddle.grad(outputs=[(d * d * d).sum()], inputs=[d], create_graph=True)
    g.sum().backward()                                  # d/dx of 3x^2 summed
    np.testing.assert_allclose(d.grad.numpy(), 6 * X)


def test_paddle_grad_partial_output_with_plain_grad_outputs(mesh):
    w = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(1)], stop_gradient=False)
    v = dist.shard_tensor(paddle.ones([6, 3]), mesh, [dist.Shard(0)])
    out = paddle.matmul(w, v)
    assert out.placements == [dist.Partial()]
    go = np.arange(12, dtype="float32").reshape(4, 3)
    (g,) = paddle.grad(out, [w], grad_outputs=paddle.to_tensor(go))
    np.testing.assert_allclose(g.numpy(), go @ np.ones((3, 6)))
    with pytest.raises(ValueError, match="global gradient of its output, shape \\[4, 3\\]"):
        paddle.grad(paddle.matmul(w, v), [w], grad_outputs=paddle.ones([2, 3]))


def test_paddle_grad_of_distributed_parameters(mesh):
    paddle.seed(0)
    lin = paddle.nn.Linear(6, 4)
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
    lin.bias = dist.shard_tensor(lin.bias, mesh, [dist.Replicate()])
    x = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Replicate()])
    gw, gb = paddle.grad(lin(x).sum(), [lin.weight, lin.bias])
    np.testing.assert_allclose(gw.numpy(), np.tile(X.sum(0)[:, None], (1, 4)))
    np.testing.assert_allclose(gb.numpy(), np.full(4, 4.0))
    assert lin.weight.grad is None                      # paddle.grad accumulates nothing


def test_paddle_grad_with_an_unrequested_plain_parameter_on_the_path_is_refused(mesh):
    lin = paddle.nn.Linear(6, 4)
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
    x = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Replicate()])
    with pytest.raises(NotImplementedError, match="paddle.grad over distributed tensors.*loss.backward"):
        paddle.grad(lin(x).sum(), [lin.weight, lin.bias])


def test_register_hook_on_a_dist_tensor_changes_the_gradient(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    seen = []
    y = d * 2
    handle = y.register_hook(lambda g: (seen.append(g.placements), g * 10)[1])
    y.sum().backward()
    assert seen == [[dist.Shard(0)]] * 2                # once per held rank, with the gradient's layout
    np.testing.assert_allclose(d.grad.numpy(), np.full_like(X, 20))
    handle.remove()
    e = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Replicate()], stop_gradient=False)
    z = e * 2
    z.register_hook(lambda g: g + 1)                    # replicated: each rank's whole gradient
    (z * z).sum().backward()
    np.testing.assert_allclose(e.grad.numpy(), 2 * (4 * X + 1))


def test_register_hook_on_a_distributed_parameter_reaches_every_shard(mesh):
    paddle.seed(0)
    lin = paddle.nn.Linear(6, 4)
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
    lin.weight.register_hook(lambda g: g * 0)
    x = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Replicate()])
    lin(x).sum().backward()
    for r, t in lin.weight.locals.items():
        np.testing.assert_array_equal(t.grad.numpy(), np.zeros([6, 2]), err_msg=f"rank {r}")


def test_item_with_an_index(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)])
    assert d.item(3, 5) == X[3, 5] and d.item(7) == X.reshape(-1)[7] and d[2, 1].item() == X[2, 1]


def test_set_value_with_the_global_value_sets_every_shard(mesh):
    lin = paddle.nn.Linear(6, 4)
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
    lin.bias = dist.shard_tensor(lin.bias, mesh, [dist.Replicate()])
    v = np.arange(24, dtype="float32").reshape(6, 4)
    lin.weight.set_value(v)
    np.testing.assert_array_equal(lin.weight.full().numpy(), v)
    lin.weight.set_value(paddle.to_tensor(-v))
    np.testing.assert_array_equal(lin.weight.full().numpy(), -v)
    lin.bias.set_value(np.ones(4, "float32"))
    for r, t in lin.bias.locals.items():                # every rank's copy, not only the lowest rank's
        np.testing.assert_array_equal(t.numpy(), np.ones(4), err_msg=f"rank {r}")
    with pytest.raises(TypeError, match="float32"):
        lin.weight.set_value(v.astype("float64"))


def test_set_value_of_one_shard_shape_is_refused_where_several_shards_are_held(mesh):
    lin = paddle.nn.Linear(6, 4)
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
    with pytest.raises(ValueError, match="ranks \\[0, 1\\].*global value, shape \\[6, 4\\]"):
        lin.weight.set_value(np.ones([6, 2], "float32"))


def test_in_place_on_a_leaf_requiring_grad_is_refused_as_paddle_does(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    one = dist.shard_tensor(paddle.ones([4, 6]), mesh, [dist.Shard(0)])
    with pytest.raises(ValueError, match="leaf tensor that requires a gradient"):
        d.add_(one)
    with pytest.raises(ValueError, match="leaf tensor that requires a gradient"):
        d[0, 0] = 1.0
    np.testing.assert_array_equal(d.numpy(), X)                    # unchanged
    with paddle.no_grad():
        d.add_(one)
    np.testing.assert_array_equal(d.numpy(), X + 1)
    plain = paddle.to_tensor(X, stop_gradient=False)                # paddle's own refusal, for reference
    with pytest.raises(ValueError):
        plain.add_(paddle.ones([4, 6]))


def test_clear_gradient_on_a_dist_tensor(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    (d * 2).sum().backward()
    (d * 3).sum().backward()
    np.testing.assert_array_equal(d.grad.numpy(), np.full_like(X, 5))    # accumulated
    d.clear_gradient()
    np.testing.assert_array_equal(d.grad.numpy(), np.zeros_like(X))
    d.clear_grad(set_to_zero=False)
    assert d.grad is None


def test_to_tensor_and_assign_of_a_dist_tensor(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    t = paddle.to_tensor(d, dtype="float64")
    assert t.placements == [dist.Shard(0)] and t.stop_gradient and t.dtype == paddle.float64
    np.testing.assert_array_equal(t.numpy(), X)
    out = dist.shard_tensor(paddle.zeros([4, 6]), mesh, [dist.Shard(1)])
    paddle.assign(d * 2, output=out)
    assert out.placements == [dist.Shard(1)]
    np.testing.assert_array_equal(out.numpy(), 2 * X)
    c = paddle.assign(d)
    (c * c).sum().backward()                                         # a differentiable copy
    np.testing.assert_array_equal(d.grad.numpy(), 2 * X)


def test_backward_with_a_gradient_tensor(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    g = np.arange(24, dtype="float32").reshape(4, 6)
    (d * 2).backward(paddle.to_tensor(g))                           # paddle's form: a plain global gradient
    np.testing.assert_array_equal(d.grad.numpy(), 2 * g)
    e = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(1)], stop_gradient=False)
    out = paddle.matmul(e, dist.shard_tensor(paddle.ones([6, 3]), mesh, [dist.Shard(0)]))
    go = np.arange(12, dtype="float32").reshape(4, 3)
    out.backward(dist.shard_tensor(paddle.to_tensor(go), mesh, [dist.Shard(0)]))   # another layout than out's
    np.testing.assert_array_equal(e.grad.numpy(), go @ np.ones((3, 6)))
    with pytest.raises(ValueError, match="shape \\[2, 2\\], the tensor \\[4, 6\\]"):
        (d * 3).backward(paddle.ones([2, 2]))


def test_paddle_autograd_backward_over_dist_tensors(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)], stop_gradient=False)
    e = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Replicate()], stop_gradient=False)
    g = np.arange(24, dtype="float32").reshape(4, 6)
    paddle.autograd.backward([(d * 2).sum(), e * 3], [None, paddle.to_tensor(g)])
    np.testing.assert_array_equal(d.grad.numpy(), np.full_like(X, 2))
    np.testing.assert_array_equal(e.grad.numpy(), 3 * g)


def test_numpy_conversion_of_a_dist_tensor(mesh):
    d = dist.shard_tensor(paddle.to_tensor(X), mesh, [dist.Shard(0)])
    np.testing.assert_array_equal(np.asarray(d), X)                  # an object array of one element before
    assert np.array(d, dtype="float64").dtype == np.float64
