"""Arguments of the public API that paddle 3.3 accepts, checked for being honoured (not accepted and dropped):
``shard_tensor``'s default dtype of python numbers and its ``stop_gradient`` on a parameter,
``shard_optimizer``'s ``gradient_accumulation_steps`` as a numpy int with every ``shard_fn``, and
``ProcessMesh.get_mesh_with_dim``'s indexes as paddle takes them. Values are compared with paddle's own
``paddle.distributed`` call on a one-rank mesh, with one process, or with numpy."""
import numpy as np
import paddle
import paddle.distributed as pdist
import pytest
from paddle import nn

import autoparallel as ap


# ---- shard_tensor of python numbers: paddle's default dtype --------------------------------------------
@pytest.mark.parametrize("data", [[[1.0, 2.0], [3.0, 4.0]], 3.5, [1.5, 2], ((0.5,), (1.0,)), [1, 2, 3], True,
                                  [[1, 2], [3, 4.25]]])
def test_shard_tensor_of_python_numbers_takes_paddles_dtype(data):
    """A nested list / number of python floats is float32 (paddle's default dtype), as paddle's
    ``shard_tensor`` and ``paddle.to_tensor`` make it; it was float64 (numpy's), so a weight written as a list
    doubled its memory and mixed dtypes with the model's float32 tensors."""
    want = pdist.shard_tensor(data, pdist.ProcessMesh([0], dim_names=["x"]), [pdist.Replicate()])
    got = ap.shard_tensor(data, ap.ProcessMesh([0], dim_names=["x"]), [ap.Replicate()])
    assert got.dtype == want.dtype == paddle.to_tensor(data).dtype
    np.testing.assert_array_equal(got.full().numpy(), want.numpy())


def test_shard_tensor_of_python_floats_follows_set_default_dtype():
    old = paddle.get_default_dtype()
    paddle.set_default_dtype("float64")
    try:
        got = ap.shard_tensor([[1.0, 2.0]], ap.ProcessMesh([0], dim_names=["x"]), [ap.Shard(1)])
    finally:
        paddle.set_default_dtype(old)
    assert got.dtype == paddle.float64


def test_shard_tensor_of_numpy_and_explicit_dtype_keep_theirs():
    mesh = ap.ProcessMesh([0], dim_names=["x"])
    assert ap.shard_tensor(np.ones((2, 2)), mesh, [ap.Replicate()]).dtype == paddle.float64       # numpy's, as paddle
    assert ap.shard_tensor([[1.0, 2.0]], mesh, [ap.Replicate()], dtype="float64").dtype == paddle.float64
    assert ap.shard_tensor([1.0, 2.0], mesh, [ap.Replicate()], dtype="int32").dtype == paddle.int32


def test_a_list_weight_trains_with_float32_inputs_as_one_process():
    """A user weight written as a list, sharded over 2 ranks, in a float32 matmul: the same values as one
    process (before: a float64 weight against float32 inputs)."""
    w = [[0.5, -1.0, 2.0, 0.25], [1.5, 0.75, -0.5, 1.0], [-2.0, 0.5, 1.0, 0.125]]
    x = np.arange(6, dtype="float32").reshape(2, 3) / 4
    want = x @ np.asarray(w, dtype="float32")
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        wd = ap.shard_tensor(w, mesh, [ap.Shard(1)], stop_gradient=False)
        out = paddle.matmul(ap.shard_tensor(x, mesh, [ap.Replicate()]), wd)
        assert out.dtype == paddle.float32
        np.testing.assert_allclose(out.full().numpy(), want, rtol=1e-6)
        out.sum().backward()
        np.testing.assert_allclose(wd.grad.full().numpy(), np.repeat(x.sum(0)[:, None], 4, 1), rtol=1e-6)


# ---- shard_tensor(parameter, stop_gradient=...) --------------------------------------------------------
def _train(freeze_in_shard_fn: bool, world: int):
    paddle.seed(3)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x = paddle.to_tensor(np.linspace(-1, 1, 16, dtype="float32").reshape(4, 4))
    if world == 1:
        net[0].weight.stop_gradient = True
        opt = paddle.optimizer.AdamW(0.1, parameters=net.parameters())
        net(x).square().mean().backward()
        opt.step()
        return {k: v.numpy() for k, v in net.state_dict().items()}, None
    with ap.simulate(world_size=world):
        mesh = ap.ProcessMesh(list(range(world)), dim_names=["x"])

        def shard_fn(name, layer, pm):
            if name == "0":
                layer.weight = ap.shard_tensor(layer.weight, pm, [ap.Shard(1)], stop_gradient=freeze_in_shard_fn)
        ap.shard_layer(net, mesh, shard_fn)
        w = net[0].weight
        flags = {r: t.stop_gradient for r, t in w.locals.items()}
        opt = ap.shard_optimizer(paddle.optimizer.AdamW(0.1, parameters=net.parameters()))
        net(ap.shard_tensor(x, mesh, [ap.Replicate()])).square().mean().backward()
        opt.step()
        return {k: v.full().numpy() for k, v in net.state_dict().items()}, flags


def test_shard_tensor_stop_gradient_true_freezes_a_parameter_as_one_process():
    """``shard_tensor(layer.weight, mesh, placements, stop_gradient=True)`` in a shard_fn: paddle's docs say the
    returned tensor has the asked stop_gradient; it kept the parameter's own (False) and the optimizer
    trained the weight. (paddle 3.3.1's own shard_tensor also keeps the parameter's: its bug, so the reference
    is one process with the weight frozen.)"""
    want, _ = _train(True, 1)
    got, flags = _train(True, 2)
    assert flags == {0: True, 1: True}                    # every held shard
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_shard_tensor_stop_gradient_false_unfreezes_a_frozen_parameter():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        lin = nn.Linear(4, 2)
        lin.weight.stop_gradient = True
        w = ap.shard_tensor(lin.weight, mesh, [ap.Shard(0)], stop_gradient=False)
        assert not w.stop_gradient and w.trainable and not w.locals[1].stop_gradient
        kept = ap.shard_tensor(lin.bias, mesh, [ap.Replicate()])            # None: the parameter's own
        assert kept.stop_gradient is False


def test_shard_tensor_stop_gradient_of_a_lazy_parameter():
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        with paddle.LazyGuard():
            lin = nn.Linear(4, 2)
        w = ap.shard_tensor(lin.weight, mesh, [ap.Shard(1)], stop_gradient=True)
        assert w.stop_gradient and all(t.stop_gradient for t in w.locals.values())


# ---- shard_optimizer(gradient_accumulation_steps=numpy int) ----------------------------------------------
def _zero_run(steps, shard_fn_of):
    paddle.seed(5)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    xs = np.linspace(-2, 2, 32, dtype="float32").reshape(8, 4)
    if steps is None:                                      # one process, one step over the whole batch
        opt = paddle.optimizer.AdamW(0.05, parameters=net.parameters())
        net(paddle.to_tensor(xs)).square().mean().backward()
        opt.step()
        return {k: v.numpy() for k, v in net.state_dict().items()}
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        ap.shard_layer(net, mesh)
        opt = ap.shard_optimizer(paddle.optimizer.AdamW(0.05, parameters=net.parameters()), shard_fn_of(mesh),
                                 gradient_accumulation_steps=steps)
        for half in (xs[:4], xs[4:]):                      # two micro-batches (the loop divides), one step
            loss = net(ap.shard_tensor(half, mesh, [ap.Shard(0)])).square().mean() / 2
            loss.backward()
        opt.step()
        opt.clear_grad()
        k = opt.gradient_accumulation_steps
        assert type(k) is int and k == 2, k
        return {k: v.full().numpy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("shard_fn_of", [lambda m: None, lambda m: ap.ShardingStage1("data", m),
                                         lambda m: ap.ShardingStage2(0, m), lambda m: m],
                         ids=["none", "stage1", "stage2", "mesh"])
def test_numpy_int_accumulation_steps_with_every_shard_fn(shard_fn_of):
    """``gradient_accumulation_steps=np.int64(2)`` (from a config array) was taken with ``shard_fn=None`` but
    refused by the ZeRO forms ("must be an int >= 1, got 2"); it is the int 2 with every ``shard_fn``."""
    want = _zero_run(None, shard_fn_of)
    got = _zero_run(np.int64(2), shard_fn_of)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("bad", [np.float64(2.0), True, 0, "2"])
def test_bad_accumulation_steps_are_refused_before_any_work(bad):
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        net = ap.shard_layer(nn.Linear(4, 2), mesh)
        opt = paddle.optimizer.AdamW(parameters=net.parameters())
        with pytest.raises(ValueError, match="gradient_accumulation_steps"):
            ap.shard_optimizer(opt, ap.ShardingStage1("data", mesh), gradient_accumulation_steps=bad)


# ---- ProcessMesh.get_mesh_with_dim(dim_name, index) as paddle indexes ------------------------------------
@pytest.mark.parametrize("dim", ["dp", "mp", "pp"])
@pytest.mark.parametrize("index", [0, 1, -1, -2, (0,), (-1,), np.int64(-1)])
def test_get_mesh_with_dim_takes_paddles_indexes(dim, index):
    """paddle indexes the mesh with ``dim_name`` moved first (numpy indexing): ``get_mesh_with_dim("pp", -1)``
    is the last stage's mesh. A negative index and a one-element tuple raised here."""
    ids = np.arange(8).reshape(2, 2, 2).tolist()
    names = ["pp", "dp", "mp"]
    want = pdist.ProcessMesh(ids, dim_names=names).get_mesh_with_dim(dim, index)
    got = ap.ProcessMesh(ids, dim_names=names).get_mesh_with_dim(dim, index)
    assert got.dim_names == want.dim_names
    assert got.shape == want.shape
    assert got.process_ids == want.process_ids


def test_get_mesh_with_dim_index_out_of_range_is_refused():
    m = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    for bad in (2, -3):
        with pytest.raises(ValueError, match="size 2"):
            m.get_mesh_with_dim("x", bad)
    assert m.get_submesh_with_dim("y", -1) == ap.ProcessMesh([1, 3], dim_names=["x"])


# ---- unshard_dtensor of a parameter: a Parameter, as paddle's ---------------------------------------------
def test_unshard_dtensor_of_a_parameter_goes_back_into_the_layer():
    """paddle's ``unshard_dtensor`` of a distributed parameter returns a Parameter (``EagerParamBase.from_tensor``
    with the parameter's attributes), so ``layer.weight = dist.unshard_dtensor(layer.weight)`` gathers a layer back;
    it was a plain tensor here and the assignment raised TypeError."""
    from autoparallel.compat import EagerParamBase

    paddle.seed(2)
    ref = nn.Linear(4, 6)
    x = paddle.rand([3, 4])
    want = ref(x).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        lin = nn.Linear(4, 6)
        lin.set_state_dict(ref.state_dict())
        lin.bias.stop_gradient = True

        def shard_fn(name, layer, pm):
            if name == "":
                layer.weight = ap.shard_tensor(layer.weight, pm, [ap.Shard(1)])
        ap.shard_layer(lin, mesh, shard_fn)
        for name in ("weight", "bias"):
            p = ap.unshard_dtensor(getattr(lin, name))
            assert isinstance(p, EagerParamBase) and not ap.is_dist(p)
            assert list(p.shape) == list(getattr(ref, name).shape)
            setattr(lin, name, p)
        assert lin.weight.trainable and not lin.weight.stop_gradient
        assert lin.bias.stop_gradient and not lin.bias.trainable                 # attributes kept
        np.testing.assert_allclose(lin(x).numpy(), want, rtol=1e-6)
        t = ap.unshard_dtensor(ap.shard_tensor(x, mesh, [ap.Shard(0)]))        # a tensor stays a tensor
        assert not isinstance(t, EagerParamBase) and not ap.is_dist(t)
        np.testing.assert_array_equal(t.numpy(), x.numpy())


# ---- a tensor distributed by paddle's own runtime --------------------------------------------------------
def test_a_tensor_distributed_by_paddle_itself_is_refused_naming_it():
    """``paddle.distributed.shard_tensor``'s result holds only this rank's part; ``ap.shard_tensor`` took it as the
    full value (paddle's own ``shard_tensor`` refuses a distributed tensor too)."""
    full = paddle.arange(6, dtype="float32").reshape([2, 3])
    px = pdist.shard_tensor(full, pdist.ProcessMesh([0], dim_names=["x"]), [pdist.Shard(0)])
    assert px.is_dist()
    mesh = ap.ProcessMesh([0], dim_names=["x"])
    with pytest.raises(TypeError, match="distributed by paddle.distributed"):
        ap.shard_tensor(px, mesh, [ap.Shard(1)])
    with pytest.raises(TypeError, match="distributed by paddle.distributed"):
        ap.dtensor_from_local(px, mesh, [ap.Replicate()])
    np.testing.assert_array_equal(ap.shard_tensor(full, mesh, [ap.Shard(1)]).full().numpy(), full.numpy())


# ---- DistModel's loss: paddle's executor fetch (Strategy.return_numpy=True) ------------------------------
def test_dist_model_loss_is_a_numpy_array_as_paddles_fetch():
    """paddle's DistModel returns the loss its executor fetched with ``return_numpy=True`` (the default, the only
    value taken here): a numpy array. Paddle code such as ``np.isnan(loss)`` or ``np.round(loss, 4)`` failed on the
    paddle Tensor returned before (no ufuncs); the value is the train step's mean loss."""
    from dist_scripts.static_models import MLP, mse
    from test_to_static import SPEC, SimSGD, mlp_batches

    batches = mlp_batches(2)
    with ap.simulate(world_size=2):
        paddle.seed(0)
        ref_model = MLP()
        s = ap.Strategy()
        s.data_parallel.degree = 2
        ref = ap.to_static(ref_model, None, mse, SimSGD(0.1, ref_model.parameters()), s, input_spec=SPEC)
        paddle.seed(0)
        model = MLP()
        dm = ap.to_static(model, None, mse, SimSGD(0.1, model.parameters()), s, input_spec=SPEC)
        dm.train()
        for x, y in batches:
            want = ref.train_step((x, y))
            loss = dm(paddle.to_tensor(x), paddle.to_tensor(y))
            assert isinstance(loss, np.ndarray) and loss.dtype == np.float32 and loss.shape == ()
            assert not np.isnan(loss) and np.round(loss, 4) == np.round(np.float32(want), 4)
            assert loss.item() == pytest.approx(want, rel=1e-6)
        dm.eval()
        loss = dm(*batches[0])
        assert isinstance(loss, np.ndarray) and float(loss) == pytest.approx(ref.eval_step(batches[0]), rel=1e-6)
