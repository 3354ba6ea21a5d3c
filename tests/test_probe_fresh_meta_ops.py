"""What paddle code calls on a distributed activation besides the common ops, against paddle on the whole tensor.
They were refused: the dtype-named casts (``x.float32()``, ``x.int64()``, ``x.uint8()``...; "not an op"), metadata
(``itemsize``, ``is_cuda``, ``get_device()``, ``stride()``, ``strides``, ``is_tensor()``, ``is_dense()``,
``persistable``, ``is_same_shape``), ``paddle.shape`` / ``paddle.rank`` / ``paddle.is_empty`` / ``paddle.tolist``
(model code reads ``paddle.shape(input_ids)[1]``), the ``data`` view and the in-place writes (``copy_``,
``set_value``, ``apply_``, ``random_``, ``data = v``, ``paddle.increment``), ``apply``, ``gammainc`` / ``gammaincc``
(+ in-place), and the functions paddle writes in python (``alpha_dropout``, ``feature_alpha_dropout``,
``dice_loss``, ``npair_loss``, ``triplet_margin_with_distance_loss``, ``multi_label_margin_loss``,
``adaptive_log_softmax_with_loss``, ``embedding_renorm_``), ``temporal_shift`` (slices and concats), or draw inside
a kernel (``gumbel_softmax``, ``rrelu``: one draw at the global shape, a single process's values and gradients),
``histogramdd``, and ``hsigmoid_loss``, ``fractional_max_pool2d/3d``, ``gather_tree``, ``rnnt_loss``, ``linalg.lstsq``,
``svd_lowrank``, ``pca_lowrank`` on the gathered tensors; ``paddle.as_tensor`` / ``asarray``."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.dist_tensor_ops import CONVERSIONS
from layout_sweep_helpers import LAYOUTS, failures, placements, x as _x

pytestmark = pytest.mark.sim


def _on_mesh(a, kind="S0", stop_gradient=True):
    shape = LAYOUTS[kind]
    mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
    return ap.shard_tensor(paddle.to_tensor(a, stop_gradient=stop_gradient), mesh, placements(kind, a.ndim))


@pytest.mark.parametrize("kind", ["S0", "S1", "P"])
def test_every_cast_method_gives_paddles_values_and_dtype(kind):
    a = _x(4, 6) * 3
    with ap.simulate(world_size=4):
        x = _on_mesh(a, kind)
        bad = []
        for name in CONVERSIONS:
            want = getattr(paddle.to_tensor(a), name)()
            got = getattr(x, name)()
            if got.dtype != want.dtype or not np.array_equal(got.numpy(), want.numpy()):
                bad.append(name)
    assert bad == []


def test_metadata_answers_for_the_global_tensor():
    a, plain = _x(4, 6), paddle.to_tensor(_x(4, 6))
    with ap.simulate(world_size=4):
        x = _on_mesh(a, "S0,Slast")
        assert (x.itemsize, x.is_cuda, x.get_device()) == (plain.itemsize, plain.is_cuda, plain.get_device())
        assert x.stride() == plain.stride() == x.strides == [6, 1] and x.stride(0) == 6 and x.stride(-1) == 1
        assert x.is_tensor() and x.is_dense() and not x.is_sparse() and not x.persistable
        assert x.is_same_shape(plain) and not x.is_same_shape(paddle.ones([6, 4]))
        assert paddle.shape(x).numpy().tolist() == [4, 6] and paddle.shape(x).dtype == paddle.shape(plain).dtype
        assert int(paddle.rank(x)) == 2 and int(x.rank()) == 2
        assert not bool(paddle.is_empty(x)) and not bool(x.is_empty())
        assert paddle.tolist(x) == plain.tolist()
        assert x.name == x.local_of(0).name and x.type == plain.type and x.layout == plain.layout
        assert x.inplace_version == 0
        with pytest.raises(IndexError, match=r"stride\(dim\)"):
            x.stride(2)
        with pytest.raises(NotImplementedError, match=r"cuda\(\): the shards of this distributed tensor are on "
                                                      r"Place\(cpu\); moving them"):
            x.cuda()
        with pytest.raises(NotImplementedError, match="pin the plain tensor"):
            x.pin_memory()


def test_data_view_and_in_place_writes_act_on_the_global_value():
    a = _x(4, 6)
    with ap.simulate(world_size=4):
        x = _on_mesh(a, "S1")
        x.data.zero_()                                   # the view shares storage, as paddle's does
        assert np.array_equal(x.numpy(), np.zeros((4, 6), "float32"))
        x.data = paddle.ones([4, 6])
        assert np.array_equal(x.numpy(), np.ones((4, 6), "float32"))
        x.copy_(paddle.full([4, 6], 2.0))
        assert np.array_equal(x.numpy(), np.full((4, 6), 2.0, "float32"))
        x.set_value(a)
        assert np.array_equal(x.numpy(), a)
        assert np.allclose(x.apply(lambda t: t * 2).numpy(), a * 2)
        x.apply_(lambda t: t + 1)
        assert np.allclose(x.numpy(), a + 1)
        assert x.placements == [ap.Shard(1)]            # every write kept the layout
        with pytest.raises(ValueError, match=r"global shape \[4, 6\], got \[6, 4\]"):
            x.copy_(paddle.ones([6, 4]))
        with pytest.raises(ValueError, match=r"global shape \[4, 6\], got \[3\]"):
            x.set_value(np.ones(3, "float32"))
        with pytest.raises(RuntimeError, match="required gradient"):
            _on_mesh(a, "S1", stop_gradient=False).apply(lambda t: t)


def test_random_fill_and_increment_equal_one_process():
    paddle.seed(11)
    want = paddle.zeros([4, 6])
    want.random_(0, 10)
    with ap.simulate(world_size=4):
        x = _on_mesh(np.zeros((4, 6), "float32"), "S0")
        paddle.seed(11)
        x.random_(0, 10)
        assert np.array_equal(x.numpy(), want.numpy())
        c = _on_mesh(np.array([1.5], "float32"), "S0")
        assert paddle.increment(c, 2.0) is c and float(c) == 3.5
        with pytest.raises(ValueError, match="exactly one element"):
            paddle.increment(x)


def _gammainc_(a, b):
    c = a.abs() + 0.5
    c.gammainc_(b.abs() + 1.0)
    return c


_ANCHOR_LABELS = np.array([1.0, 2.0, 1.0, 3.0], "float32")
_MULTI_LABELS = np.array([[1, 2, -1, 0, 0], [0, -1, 0, 0, 0], [4, 3, -1, 0, 0], [2, -1, 0, 0, 0]], "int64")
_DICE_LABELS = np.random.default_rng(1).integers(0, 5, (4, 1, 1))

_ALS_LABELS = np.array([0, 3, 5, 7, 1, 6], "int64")


def _adaptive_log_softmax(inp, head, t1a, t1b, t2a, t2b):
    out, loss = F.adaptive_log_softmax_with_loss(inp, paddle.to_tensor(_ALS_LABELS), head, [[t1a, t1b], [t2a, t2b]],
                                                 [2, 5, 8])
    return out * 0.5 + loss


CASES = {
    "gammainc": (lambda a, b: paddle.gammainc(a.abs() + 0.5, b.abs() + 1.0), [_x(4, 6), _x(4, 6, seed=1)], None),
    "gammaincc": (lambda a, b: paddle.gammaincc(a.abs() + 0.5, b.abs() + 1.0), [_x(4, 6), _x(4, 6, seed=1)], None),
    "gammainc_": (_gammainc_, [_x(4, 6), _x(4, 6, seed=1)], None),
    "alpha_dropout eval": (lambda a: F.alpha_dropout(a, 0.5, training=False), [_x(4, 5)], None),
    "dice_loss": (lambda a: F.dice_loss(F.softmax(a.reshape([4, 1, 5])), paddle.to_tensor(_DICE_LABELS)),
                  [_x(4, 5)], None),
    "npair_loss": (lambda a, b: F.npair_loss(a, b, paddle.to_tensor(_ANCHOR_LABELS)), [_x(4, 5), _x(4, 5, seed=1)],
                   None),
    "triplet distance": (lambda a, b, c: F.triplet_margin_with_distance_loss(a, b, c, margin=0.5),
                         [_x(4, 5), _x(4, 5, seed=1), _x(4, 5, seed=2)], None),
    "multi_label_margin": (lambda a: F.multi_label_margin_loss(a, paddle.to_tensor(_MULTI_LABELS)), [_x(4, 5)], None),
    "rrelu eval": (lambda a: F.rrelu(a, 0.1, 0.3, training=False), [_x(4, 6)], None),
    "adaptive_log_softmax": (_adaptive_log_softmax, [_x(6, 4), _x(4, 4, seed=1), _x(4, 2, seed=2), _x(2, 3, seed=3),
                                                     _x(4, 1, seed=4), _x(1, 3, seed=5)], None),
    "temporal_shift": (lambda a: F.temporal_shift(a, 3), [_x(6, 8, 2, 3)], None),
    "temporal_shift NHWC": (lambda a: F.temporal_shift(a, 2, 0.2, data_format="NHWC"), [_x(4, 2, 3, 10)], None),
    "temporal_shift one channel": (lambda a: F.temporal_shift(a, 2, 0.1), [_x(4, 5, 2, 2)], None),
}


@pytest.mark.parametrize("kind", ["S0", "S1", "P", "S0,Slast"])
def test_ops_match_the_whole_tensor(kind):
    assert failures(CASES, kind) == []


def _seeded(fn, a, kind=None, seed=3):
    """fn's value and input gradient under paddle.seed(seed): on one process, or laid out as ``kind``."""
    w = paddle.to_tensor(np.random.default_rng(1).standard_normal(a.shape).astype("float32"))
    with ap.simulate(world_size=4) if kind else _nothing():
        x = _on_mesh(a, kind, stop_gradient=False) if kind else paddle.to_tensor(a, stop_gradient=False)
        paddle.seed(seed)
        y = fn(x)
        (y * w).sum().backward()
        full = (lambda t: t.full().numpy()) if kind else (lambda t: t.numpy())
        return full(y), full(x.grad)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


DRAWS = {
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.3),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x, 0.4),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x, 0.7),
    "gumbel_softmax hard axis 1": lambda x: F.gumbel_softmax(x, 0.5, hard=True, axis=1),
    "rrelu": lambda x: F.rrelu(x),
}


@pytest.mark.parametrize("kind", ["S0", "S2", "P", "S0,Slast"])
def test_random_activations_draw_what_one_process_draws(kind):
    a = np.random.default_rng(0).standard_normal((4, 6, 5)).astype("float32")
    bad = []
    for name, fn in DRAWS.items():
        want, got = _seeded(fn, a), _seeded(fn, a, kind)
        bad += [f"{name} {what}" for what, g, w in zip(("value", "grad"), got, want)
                if not np.allclose(g, w, rtol=1e-4, atol=1e-5)]
    assert bad == []


def test_bad_arguments_raise_before_drawing():
    with ap.simulate(world_size=4):
        x = _on_mesh(_x(4, 6), "S0")
        with pytest.raises(ValueError, match="temperature must be positive"):
            F.gumbel_softmax(x, 0.0)
        with pytest.raises(ValueError, match="0 <= lower <= upper <= 1"):
            F.rrelu(x, 0.5, 0.2)


@pytest.mark.parametrize("placement", ["S0", "S1", "R"])
def test_embedding_renorm_rescales_the_distributed_weight_in_place(placement):
    w = _x(6, 4) * 2
    ids = paddle.to_tensor(np.array([[0, 2], [2, 5]], "int64"))
    want = paddle.to_tensor(w)
    F.embedding_renorm_(ids, want, 1.0)
    p = {"S0": ap.Shard(0), "S1": ap.Shard(1), "R": ap.Replicate()}[placement]
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        emb = paddle.nn.Embedding(6, 4)
        emb.weight.set_value(w)
        emb = ap.shard_layer(emb, mesh, lambda n, layer, m: setattr(layer, "weight", ap.shard_tensor(
            layer.weight, m, [p])) if n == "" else None)
        F.embedding_renorm_(ids, emb.weight, 1.0)
        got = emb.weight.full().numpy()
    assert np.allclose(got, want.numpy()) and not np.allclose(got, w)      # rows 0, 2, 5 were rescaled


def test_temporal_shift_names_bad_arguments():
    with ap.simulate(world_size=4):
        x = _on_mesh(_x(6, 8, 2, 3), "S0")
        with pytest.raises(ValueError, match=r"seg_num must be a positive int dividing dim 0 \(6\), got 4"):
            F.temporal_shift(x, 4)
        with pytest.raises(ValueError, match=r"shift_ratio must be in \(0, 0.5\)"):
            F.temporal_shift(x, 3, 0.5)


def test_histogramdd_counts_the_whole_sample():
    a = _x(10, 2)
    w = np.abs(_x(10, seed=1))
    want_h, want_edges = paddle.histogramdd(paddle.to_tensor(a), bins=[3, 4], weights=paddle.to_tensor(w),
                                            density=True)
    with ap.simulate(world_size=4):
        x, wd = _on_mesh(a, "S0"), _on_mesh(w, "S0")
        h, edges = paddle.histogramdd(x, bins=[3, 4], weights=wd, density=True)
        h2, _ = x.histogramdd(bins=5, ranges=[-2.0, 2.0, -2.0, 2.0])
    assert np.allclose(h.numpy(), want_h.numpy()) and len(edges) == 2
    assert all(np.allclose(e.numpy(), f.numpy()) for e, f in zip(edges, want_edges))
    want_h2, _ = paddle.histogramdd(paddle.to_tensor(a), bins=5, ranges=[-2.0, 2.0, -2.0, 2.0])
    assert np.allclose(h2.numpy(), want_h2.numpy())


_HS_LABELS = np.array([[1], [3], [0], [5]], "int64")
_RNNT = {"labels": np.array([[1, 2], [3, 1]], "int32"), "lengths": np.array([4, 3], "int32"),
         "label_lengths": np.array([2, 1], "int32")}


def _rnnt(a):
    t = {k: paddle.to_tensor(v) for k, v in _RNNT.items()}
    return F.rnnt_loss(a, t["labels"], t["lengths"], t["label_lengths"], blank=0, fastemit_lambda=0.0)


WHOLE = {
    "hsigmoid_loss": (lambda a, w, b: F.hsigmoid_loss(a, paddle.to_tensor(_HS_LABELS), 6, w, b),
                      [_x(4, 3), _x(5, 3, seed=1), _x(5, 1, seed=2)], None),
    "fractional_max_pool2d": (lambda a: F.fractional_max_pool2d(a, 3, random_u=0.3), [_x(2, 3, 7, 7)], None),
    "fractional_max_pool3d": (lambda a: F.fractional_max_pool3d(a, 2, random_u=0.6), [_x(2, 2, 5, 5, 5)], None),
    "rnnt_loss": (_rnnt, [_x(2, 4, 3, 5)], None),
    "lstsq": (lambda a, b: paddle.linalg.lstsq(a, b)[0], [_x(3, 5, 4), _x(3, 5, 2, seed=1)], None),
    "lstsq gelsd": (lambda a, b: paddle.concat([t.flatten() for t in paddle.linalg.lstsq(a, b, driver="gelsd")
                                                 if t.dtype == paddle.float32]), [_x(3, 5, 4), _x(3, 5, 2, seed=1)],
                    None),
    "Tensor.lstsq": (lambda a, b: a.lstsq(b)[0], [_x(3, 5, 4), _x(3, 5, 2, seed=1)], None),
}


@pytest.mark.parametrize("kind", ["S0", "S1", "P", "S0,Slast"])
def test_ops_computed_on_the_whole_tensors_match(kind):
    """hsigmoid_loss, fractional max pooling, rnnt_loss: gathered (differentiable), paddle's own op, whole result."""
    assert failures(WHOLE, kind) == []


def test_low_rank_decompositions_draw_as_one_process():
    a = _x(6, 5)
    paddle.seed(2)
    want = [t.numpy() for t in paddle.linalg.svd_lowrank(paddle.to_tensor(a), q=3)]
    want += [t.numpy() for t in paddle.linalg.pca_lowrank(paddle.to_tensor(a), q=3)]
    with ap.simulate(world_size=4):
        x = _on_mesh(a, "S0")
        paddle.seed(2)
        got = [t.numpy() for t in paddle.linalg.svd_lowrank(x, q=3)] + [
            t.numpy() for t in paddle.linalg.pca_lowrank(x, q=3)]
    assert len(got) == 6 and all(np.allclose(g, w, atol=1e-5) for g, w in zip(got, want))


def test_as_tensor_and_asarray_copy_in_the_same_layout():
    a = _x(4, 6)
    with ap.simulate(world_size=4):
        x = _on_mesh(a, "S1")
        y = paddle.as_tensor(x, dtype="float64", requires_grad=True)
        z = paddle.asarray(x)
        assert y.placements == z.placements == x.placements and y.dtype == paddle.float64 and not y.stop_gradient
        assert z is not x and np.allclose(y.numpy(), a) and np.allclose(z.numpy(), a)
        with pytest.raises(NotImplementedError, match="pin_memory"):
            paddle.as_tensor(x, pin_memory=True)


def test_gather_tree_and_fractional_pooling_draw_as_one_process():
    ids = np.array([[[2, 2], [6, 1]], [[3, 9], [6, 1]], [[0, 1], [9, 0]]], "int64")
    parents = np.array([[[0, 0], [1, 1]], [[1, 0], [1, 0]], [[0, 0], [0, 1]]], "int64")
    want = F.gather_tree(paddle.to_tensor(ids), paddle.to_tensor(parents)).numpy()
    a = _x(2, 3, 7, 7)
    paddle.seed(4)
    want_pool = F.fractional_max_pool2d(paddle.to_tensor(a), 3).numpy()        # random pooling regions
    with ap.simulate(world_size=4):
        got = F.gather_tree(_on_mesh(ids, "S1"), paddle.to_tensor(parents))
        paddle.seed(4)
        got_pool = F.fractional_max_pool2d(_on_mesh(a, "S0"), 3)
    assert np.array_equal(got.numpy(), want) and np.allclose(got_pool.numpy(), want_pool)
