"""In-place forms on a distributed parameter as a paddle user writes them after ``shard_tensor`` /
``shard_layer``: ``zero_``, ``fill_``, ``copy_``, paddle's initializers, ``shard_tensor`` of a parameter already
distributed (with ``dtype`` / ``stop_gradient``). Each reaches every shard (every rank's copy in the simulated
world), checked against the full tensor."""
import numpy as np
import paddle
import pytest
from paddle import nn

import autoparallel as dist


@pytest.fixture
def layer():
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
        paddle.seed(0)
        lin = nn.Linear(6, 4)
        lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(1)])
        lin.bias = dist.shard_tensor(lin.bias, mesh, [dist.Replicate()])
        yield lin, mesh


def every_copy(p):
    return {r: t.numpy() for r, t in p.locals.items()}


def test_zero_and_fill_reach_every_shard(layer):
    lin, _ = layer
    with paddle.no_grad():
        lin.weight.zero_()
        lin.bias.fill_(3.0)
    np.testing.assert_array_equal(lin.weight.full().numpy(), np.zeros((6, 4)))
    for r, v in every_copy(lin.bias).items():
        np.testing.assert_array_equal(v, np.full(4, 3.0), err_msg=f"rank {r}")


def test_copy_of_the_global_value_sets_every_shard(layer):
    lin, _ = layer
    v = np.arange(24, dtype="float32").reshape(6, 4)
    with paddle.no_grad():
        lin.weight.copy_(paddle.to_tensor(v), False)
        lin.bias.copy_(paddle.ones([4]), True)
    np.testing.assert_array_equal(lin.weight.full().numpy(), v)
    for r, b in every_copy(lin.bias).items():
        np.testing.assert_array_equal(b, np.ones(4), err_msg=f"rank {r}")


@pytest.mark.parametrize("init", [lambda: nn.initializer.Constant(2.0), lambda: nn.initializer.XavierNormal(),
                                  lambda: nn.initializer.KaimingUniform()])
def test_initializers_fill_the_global_parameter(layer, init):
    lin, _ = layer
    ref = nn.Linear(6, 4)
    paddle.seed(7)
    init()(lin.weight)
    init()(lin.bias)
    paddle.seed(7)
    init()(ref.weight)
    init()(ref.bias)
    np.testing.assert_allclose(lin.weight.full().numpy(), ref.weight.numpy(), rtol=1e-6)   # global fan-in
    for r, b in every_copy(lin.bias).items():
        np.testing.assert_allclose(b, ref.bias.numpy(), rtol=1e-6, err_msg=f"rank {r}")


@pytest.mark.parametrize("fill", [lambda p: p.uniform_(-0.5, 0.5), lambda p: p.normal_(0.0, 0.02),
                                  lambda p: p.exponential_(2.0), lambda p: p.cauchy_()],
                         ids=["uniform_", "normal_", "exponential_", "cauchy_"])
def test_in_place_random_fills_draw_the_global_parameter(layer, fill):
    """``p.uniform_()`` / ``normal_`` / ``exponential_`` on a sharded and on a replicated parameter: every copy
    holds its part of the one-process draw under the same seed (not one shard's own draw)."""
    lin, _ = layer
    ref = nn.Linear(6, 4)
    with paddle.no_grad():
        paddle.seed(11)
        fill(lin.weight)
        fill(lin.bias)
        paddle.seed(11)
        fill(ref.weight)
        fill(ref.bias)
    np.testing.assert_array_equal(lin.weight.full().numpy(), ref.weight.numpy())
    assert not np.array_equal(*[v for v in every_copy(lin.weight).values()])     # the two column halves differ
    for r, b in every_copy(lin.bias).items():
        np.testing.assert_array_equal(b, ref.bias.numpy(), err_msg=f"rank {r}")


def test_shard_tensor_of_a_distributed_parameter_is_a_parameter(layer):
    lin, mesh = layer
    w = lin.weight.full().numpy()
    lin.weight = dist.shard_tensor(lin.weight, mesh, [dist.Shard(0)])          # a Layer slot takes it
    assert lin.weight.placements == [dist.Shard(0)] and not lin.weight.stop_gradient
    np.testing.assert_array_equal(lin.weight.full().numpy(), w)
    d = dist.shard_tensor(lin.weight, mesh, [dist.Replicate()], dtype="float64", stop_gradient=True)
    assert d.dtype == paddle.float64 and d.stop_gradient
    np.testing.assert_array_equal(d.full().numpy(), w)
    x = dist.shard_tensor(paddle.ones([4, 6]), mesh, [dist.Shard(0)])
    y = dist.shard_tensor(x, mesh, [dist.Shard(1)], dtype="float16")            # a DistTensor: dtype kept too
    assert y.dtype == paddle.float16 and y.placements == [dist.Shard(1)]


def test_nn_utils_parameter_vectors_over_distributed_parameters(layer):
    """parameters_to_vector / vector_to_parameters read and write global values, as one process (the clips run
    distributed too: test_probe_loop_forms.py)."""
    lin, mesh = layer
    ps = list(lin.parameters())
    want = np.concatenate([p.full().numpy().ravel() for p in ps])
    vec = paddle.nn.utils.parameters_to_vector(ps)
    np.testing.assert_array_equal(vec.numpy(), want)
    paddle.nn.utils.vector_to_parameters(paddle.to_tensor(np.arange(want.size, dtype="float32")), ps)
    np.testing.assert_array_equal(np.concatenate([p.full().numpy().ravel() for p in ps]), np.arange(want.size))
    with pytest.raises(ValueError, match="holds? .*values"):
        paddle.nn.utils.vector_to_parameters(paddle.zeros([3]), ps)


def test_nn_utils_over_plain_parameters_still_run(layer):
    paddle.seed(0)
    plain = nn.Linear(6, 4)
    plain(paddle.ones([2, 6])).sum().backward()
    before = np.linalg.norm(np.concatenate([p.grad.numpy().ravel() for p in plain.parameters()]))
    norm = paddle.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    np.testing.assert_allclose(float(norm), before, rtol=1e-5)
    after = np.linalg.norm(np.concatenate([p.grad.numpy().ravel() for p in plain.parameters()]))
    np.testing.assert_allclose(after, 1.0, rtol=1e-4)


def test_set_state_dict_of_a_single_process_model_into_a_distributed_one(layer):
    lin, mesh = layer
    paddle.seed(5)
    ref = nn.Linear(6, 4)                                # other weights than the distributed layer's
    missing, unexpected = lin.set_state_dict(ref.state_dict())
    assert missing == [] and unexpected == []
    np.testing.assert_array_equal(lin.weight.full().numpy(), ref.weight.numpy())
    for r, b in every_copy(lin.bias).items():
        np.testing.assert_array_equal(b, ref.bias.numpy(), err_msg=f"rank {r}")
    x = np.arange(12, dtype="float32").reshape(2, 6)
    out = lin(dist.shard_tensor(x, mesh, [dist.Replicate()]))
    np.testing.assert_allclose(out.numpy(), ref(paddle.to_tensor(x)).numpy(), rtol=1e-6)
    other = dist.shard_tensor(paddle.to_tensor(-ref.weight.numpy()), mesh, [dist.Shard(0)])   # another layout
    lin.set_dict({"weight": other})
    np.testing.assert_array_equal(lin.weight.full().numpy(), -ref.weight.numpy())
    with pytest.raises(ValueError, match="weight has shape \\[3, 3\\].*global shape \\[6, 4\\]"):
        lin.set_state_dict({"weight": paddle.ones([3, 3])})


def test_set_state_dict_with_one_wrong_shape_loads_nothing(layer):
    """A wrong shape listed after a good entry raises before the good entry is written: no half-loaded model."""
    lin, _ = layer
    before = lin.weight.full().numpy(), every_copy(lin.bias)
    good_weight = np.full([6, 4], 7.0, "float32")
    with pytest.raises(ValueError, match="bias has shape \\[3\\].*global shape \\[4\\].*nothing was loaded"):
        lin.set_state_dict({"weight": good_weight, "bias": np.zeros([3], "float32")})
    np.testing.assert_array_equal(lin.weight.full().numpy(), before[0])
    for r, b in every_copy(lin.bias).items():
        np.testing.assert_array_equal(b, before[1][r])
    lin.set_state_dict({"weight": good_weight})                 # the same good entry alone is loaded
    np.testing.assert_array_equal(lin.weight.full().numpy(), good_weight)
