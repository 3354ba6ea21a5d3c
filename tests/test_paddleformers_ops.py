"""Ops the PaddleFormers families reach beyond the first eight models, on sharded tensors in the simulated
world against plain paddle: paddle.gather / scatter in their torch form (DeepSeek-V3's gate), F.conv1d (the
causal depthwise conv of Qwen3-Next's linear attention), F.pad, and concat onto an empty KV cache."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap


@pytest.mark.parametrize("form", ["positional", "method", "keywords", "mixed"])
def test_torch_form_gather_equals_take_along_axis(form):
    """paddle.gather's torch form ``gather(input, dim, index)`` (DeepSeek-V3's gate: ``scores.gather(1, idx)``)
    is take_along_axis on a sharded input, every call form paddle accepts; paddle's own form still gathers rows."""
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.standard_normal((6, 5)).astype("float32"))
    idx = paddle.to_tensor(rng.integers(0, 5, (6, 2)).astype("int64"))
    call = {"positional": lambda a, i: paddle.gather(a, 1, i), "method": lambda a, i: a.gather(1, i),
            "keywords": lambda a, i: paddle.gather(input=a, dim=1, index=i),
            "mixed": lambda a, i: a.gather(1, index=i)}[form]
    ref = paddle.take_along_axis(x, idx, 1, broadcast=False).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        got = call(ap.shard_tensor(x, mesh, [ap.Shard(0)]), ap.shard_tensor(idx, mesh, [ap.Shard(0)]))
        assert str(got.placements) == "[S(0)]"
        np.testing.assert_allclose(got.full().numpy(), ref)
        rows = paddle.gather(ap.shard_tensor(x, mesh, [ap.Shard(1)]), paddle.to_tensor([4, 0]), axis=0)
        np.testing.assert_allclose(rows.full().numpy(), x.numpy()[[4, 0]])


def test_torch_form_scatter_equals_put_along_axis():
    rng = np.random.default_rng(1)
    x = paddle.to_tensor(rng.standard_normal((6, 5)).astype("float32"))
    idx = paddle.to_tensor(np.argsort(rng.standard_normal((6, 5)), axis=1)[:, :2].astype("int64"))
    src = paddle.to_tensor(rng.standard_normal((6, 2)).astype("float32"))
    ref = paddle.put_along_axis(x, idx, src, 1, broadcast=False).numpy()
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["data"])
        xs, ids, ss = (ap.shard_tensor(t, mesh, [ap.Shard(0)]) for t in (x, idx, src))
        np.testing.assert_allclose(paddle.scatter(xs, 1, ids, ss).full().numpy(), ref)
        np.testing.assert_allclose(xs.scatter(dim=1, index=ids, src=ss).full().numpy(), ref)


def _mesh():
    return ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])


def test_causal_depthwise_conv1d_layer_and_functional():
    """Qwen3-Next: ``F.silu(conv1d(x)[:, :, :t])`` with a depthwise ``nn.Conv1D`` (groups = channels,
    padding k-1), batch split over "data" and channels over "model": values and gradients as one process."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8, 6)).astype("float32")
    paddle.seed(0)
    conv = paddle.nn.Conv1D(8, 8, 4, groups=8, padding=3)

    def run(layer, xt):
        y = F.silu(layer(xt)[:, :, :6])
        (y * y).sum().backward()
        return y

    xr = paddle.to_tensor(x, stop_gradient=False)
    ref = run(conv, xr).numpy()
    ref_gw = conv.weight.grad.numpy()
    conv.clear_gradients()
    with ap.simulate(world_size=4):
        layer = ap.shard_layer(conv, _mesh())
        xd = ap.shard_tensor(paddle.to_tensor(x, stop_gradient=False), _mesh(), [ap.Shard(0), ap.Shard(1)])
        got = run(layer, xd)
        ap.reduce_gradients(layer.parameters())
        np.testing.assert_allclose(got.full().numpy(), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.weight.as_dist().grad.full().numpy(), ref_gw, rtol=1e-5, atol=1e-5)


def test_conv1d_channel_parallel_weight_gives_partial_and_uneven_channels_stay_whole():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, 6, 7)).astype("float32"), rng.standard_normal((4, 6, 3)).astype("float32")
    ref = F.conv1d(paddle.to_tensor(x), paddle.to_tensor(w), padding=[2, 0]).numpy()
    with ap.simulate(world_size=4):
        m = _mesh()
        xd = ap.shard_tensor(paddle.to_tensor(x), m, [ap.Replicate(), ap.Shard(1)])
        wd = ap.shard_tensor(paddle.to_tensor(w), m, [ap.Replicate(), ap.Shard(1)])
        out = F.conv1d(xd, wd, padding=[2, 0])
        assert str(out.placements) == "[R, P(sum)]"
        np.testing.assert_allclose(out.full().numpy(), ref, rtol=1e-5, atol=1e-5)
        m3 = ap.ProcessMesh([0, 1, 2], dim_names=["model"])       # 4 output channels over 3: not split
        out3 = F.conv1d(ap.shard_tensor(paddle.to_tensor(x), m3, [ap.Replicate()]),
                        ap.shard_tensor(paddle.to_tensor(w), m3, [ap.Shard(0)]), padding=[2, 0])
        assert str(out3.placements) == "[R]"
        np.testing.assert_allclose(out3.full().numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad,kw", [([1, 2], {}), ([0, 0, 2, 1], {}), ([1, 0, 0, 0, 0, 2], {}),
                                    ([3, 0], {"value": 1.5}), ([1, 1], {"mode": "replicate"})])
def test_pad_keeps_unpadded_dims_split(pad, kw):
    x = np.random.default_rng(4).standard_normal((4, 6, 5)).astype("float32")
    ref = F.pad(paddle.to_tensor(x), pad, **kw).numpy()
    with ap.simulate(world_size=4):
        xd = ap.shard_tensor(paddle.to_tensor(x), _mesh(), [ap.Shard(0), ap.Shard(1)])
        out = F.pad(xd, pad, **kw)
        np.testing.assert_allclose(out.full().numpy(), ref)
        padded = {d for d in range(3) if ref.shape[d] != x.shape[d]}
        assert str(out.placements) == ("[S(0), S(1)]" if 1 not in padded and 0 not in padded else
                                       "[R, S(1)]" if 1 not in padded else "[S(0), R]"), (pad, out.placements)


def test_pad_reads_a_tensor_pad_list_as_its_values():
    """A pad list given as a tensor is read as numbers (dispatch_values), as paddle reads it: equal to one process."""
    x = np.arange(120, dtype="float32").reshape(4, 6, 5)
    ref = F.pad(paddle.to_tensor(x), paddle.to_tensor([1, 2], dtype="int32"), value=-1.0).numpy()   # paddle: int32 only
    with ap.simulate(world_size=4):
        xd = ap.shard_tensor(paddle.to_tensor(x), _mesh(), [ap.Shard(0), ap.Replicate()])
        out = F.pad(xd, paddle.to_tensor([1, 2], dtype="int32"), value=-1.0)
        np.testing.assert_array_equal(out.full().numpy(), ref)


def test_concat_onto_an_empty_cache_stays_split_with_no_collective():
    from autoparallel.comm.counter import count_collectives

    k = np.random.default_rng(5).standard_normal((4, 8, 4, 16)).astype("float32")
    with ap.simulate(world_size=4):
        kd = ap.shard_tensor(paddle.to_tensor(k), _mesh(), [ap.Shard(0), ap.Shard(2)])
        with count_collectives() as calls:
            out = paddle.concat([paddle.zeros([4, 8, 0, 16]), kd], axis=-2)
        assert str(out.placements) == "[S(0), S(2)]" and not calls.per_group()
        np.testing.assert_allclose(out.full().numpy(), k)
        two = paddle.concat([kd, kd], axis=2)                    # two real pieces: the axis is gathered
        assert str(two.placements) == "[S(0), R]"
        np.testing.assert_allclose(two.full().numpy(), np.concatenate([k, k], axis=2))


def test_paddles_reentrant_recompute_on_distributed_inputs():
    """A library calling ``fleet.utils.recompute(layer, x)`` (reentrant, a PyLayer that accepts only paddle
    Tensors) on a distributed activation: the layer runs again in backward, gradients as one process; paddle's
    reentrant-only input offload is refused by name."""
    from paddle.distributed.fleet.utils import recompute

    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((4, 6)).astype("float32"), rng.standard_normal((6, 5)).astype("float32")
    paddle.seed(0)
    lin = paddle.nn.Linear(6, 5)
    lin.weight.set_value(w)
    xr = paddle.to_tensor(x, stop_gradient=False)
    (recompute(lin, xr) ** 2).sum().backward()
    ref_gw, ref_gx = lin.weight.grad.numpy(), xr.grad.numpy()
    lin.clear_gradients()
    with ap.simulate(world_size=4):
        layer = ap.shard_layer(lin, _mesh())
        calls = []
        layer.register_forward_pre_hook(lambda *a: calls.append(1))
        xd = ap.shard_tensor(paddle.to_tensor(x, stop_gradient=False), _mesh(), [ap.Shard(0), ap.Replicate()])
        (recompute(layer, xd) ** 2).sum().backward()
        assert len(calls) == 2
        ap.reduce_gradients(layer.parameters())
        np.testing.assert_allclose(layer.weight.as_dist().grad.full().numpy(), ref_gw, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(xd.grad.full().numpy(), ref_gx, rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match="offload_indices"):
            recompute(layer, xd, offload_indices=[0])
