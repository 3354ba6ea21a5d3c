"""The ops vision-language models add, on distributed tensors in the simulated world, against paddle on the
whole tensor: ``masked_scatter`` of image features into text embeddings (uneven image tokens per sample: the
per-shard run is the negative control), ``argwhere``, ``searchsorted`` / ``bucketize``, ``paddle.compat.split``,
and tensors standing for numbers (``arange(h)``, ``x.expand([-1, w])``, ``F.pad`` widths, ``linspace``,
``full_like``, ``to_tensor`` of a list of scalars, a 0-d ``// 2``) read from a sharded ``grid_thw``."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from spmd_rules import get_spmd_rule, register_spmd_rule
from spmd_rules.result import SpmdResult


def _mesh():
    return ap.ProcessMesh([0, 1], dim_names=["dp"])


def _scatter_case():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5, 3)).astype("float32")
    mask = np.zeros((4, 5), bool)
    mask[0, 1:4] = True             # 3 image tokens in sample 0, 1 in sample 1, 0 in 2, 2 in 3
    mask[1, 2] = True
    mask[3, 0:2] = True
    value = rng.standard_normal((6, 3)).astype("float32")
    return x, mask, value


def _scatter(x, mask, value, mesh=None, place=None):
    """(output, grad of x, grad of value) of masked_scatter then a weighted sum."""
    t = [paddle.to_tensor(a) for a in (x, mask, value)]
    if mesh is not None:
        t = [ap.shard_tensor(a, mesh, place or [ap.Shard(0)]) for a in t]
    t[0].stop_gradient = t[2].stop_gradient = False
    m = t[1].unsqueeze(-1).expand_as(t[0])
    out = t[0].masked_scatter(m, t[2])
    w = paddle.arange(int(np.prod(out.shape)), dtype="float32").reshape(out.shape)
    (out * w).sum().backward()
    whole = [v.full() if hasattr(v, "full") else v for v in (out, t[0].grad, t[2].grad)]
    return [v.numpy() for v in whole]


@pytest.mark.parametrize("world,place", [(2, None), (4, None), (4, "S(0),S(1)")], ids=["2", "4", "2x2"])
def test_masked_scatter_with_uneven_image_tokens_equals_paddle(world, place):
    """On 4 ranks, rank 2 holds a sample with no image token; on 2x2 the rows split over "dp" and the sequence
    over "mp" (gathered: the offsets follow the rows)."""
    want = _scatter(*_scatter_case())
    with ap.simulate(world_size=world):
        mesh = _mesh() if world == 2 else ap.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
        if place is not None:
            mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
            place = [ap.Shard(0), ap.Shard(1)]
        got = _scatter(*_scatter_case(), mesh, place)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    specs = [ap.DistSpec(_mesh(), (ap.Shard(0),), s, d) for s, d in
             (((4, 5, 3), "float32"), ((4, 5, 3), "bool"), ((6, 3), "float32"))]
    assert str(get_spmd_rule("masked_scatter")(*specs)) == "(S(0), S(0), R) -> S(0) via sharded_masked_scatter"
    specs[1] = ap.DistSpec(_mesh(), (ap.Shard(0),), (4, 5, 1), "bool")       # a broadcast mask: gathered
    assert str(get_spmd_rule("masked_scatter")(*specs)) == "(R, R, R) -> R"


def test_masked_scatter_call_forms():
    """The function, the method and the in-place method (GLM's ``inputs_embeds[mask] = ...`` is setitem)."""
    x, mask, value = _scatter_case()
    m3 = np.broadcast_to(mask[..., None], x.shape).copy()
    want = paddle.masked_scatter(*[paddle.to_tensor(a) for a in (x, m3, value)]).numpy()
    with ap.simulate(world_size=2):
        d = [ap.shard_tensor(paddle.to_tensor(a), _mesh(), [ap.Shard(0)]) for a in (x, m3, value)]
        got = [paddle.masked_scatter(*d), paddle.masked_scatter(x=d[0], mask=d[1], value=d[2])]
        d[0].masked_scatter_(d[1], d[2])
        got = [g.full().numpy() for g in got + [d[0]]]
    for g in got:
        np.testing.assert_allclose(g, want)


def test_negative_control_per_shard_masked_scatter_is_wrong():
    """Each rank scattering value from its first row into its own samples (no data-dependent offset): wrong,
    since samples 0 and 1 hold 4 image tokens -- rank 1 must start at value row 4."""
    rule = get_spmd_rule("masked_scatter")

    def per_shard(x, mask, value, name=None):
        return SpmdResult((x, mask, value.with_placements((ap.Replicate(),))), (x,))

    register_spmd_rule("masked_scatter", per_shard)
    try:
        with ap.simulate(world_size=2):
            got = _scatter(*_scatter_case(), _mesh())
    finally:
        register_spmd_rule("masked_scatter", rule.fn, reverse=rule.reverse)
    assert not np.allclose(got[0], _scatter(*_scatter_case())[0])


def test_masked_scatter_rejects_a_wrong_mask_shape():
    specs = [ap.DistSpec(_mesh(), (ap.Replicate(),), s, d) for s, d in
             (((4, 3), "float32"), ((5, 3), "bool"), ((6, 3), "float32"))]
    with pytest.raises(ValueError, match="broadcast"):
        get_spmd_rule("masked_scatter")(*specs)


def test_argwhere_searchsorted_bucketize_equal_paddle():
    ids = np.array([[5, 121, 120, 120, 122, 7], [121, 120, 122, 9, 9, 9]], "int64")
    seq = np.array([0, 4, 8, 12], "int64")
    vals = np.arange(12, dtype="int64").reshape(2, 6)
    want = [paddle.argwhere(paddle.to_tensor(ids) == 121).numpy(),
            paddle.searchsorted(paddle.to_tensor(seq), paddle.to_tensor(vals), right=True).numpy(),
            paddle.bucketize(paddle.to_tensor(vals), paddle.to_tensor(seq)).numpy()]
    with ap.simulate(world_size=2):
        mesh = _mesh()
        d_ids = ap.shard_tensor(paddle.to_tensor(ids), mesh, [ap.Shard(0)])
        d_seq = ap.shard_tensor(paddle.to_tensor(seq), mesh, [ap.Shard(0)])
        d_vals = ap.shard_tensor(paddle.to_tensor(vals), mesh, [ap.Shard(1)])
        got = [paddle.argwhere(d_ids == 121), paddle.searchsorted(d_seq, d_vals, right=True),
               paddle.bucketize(d_vals, d_seq)]
        assert [str(g.placements) for g in got[1:]] == ["[S(1)]", "[S(1)]"]    # values keep their sharding
        got = [g.full().numpy() for g in got]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_compat_split_by_lengths_equals_paddle():
    x = np.random.default_rng(1).standard_normal((1, 2, 7, 4)).astype("float32")
    want = [p.numpy() for p in paddle.compat.split(paddle.to_tensor(x), [3, 4], dim=2)]
    want3 = [p.numpy() for p in paddle.compat.split(paddle.to_tensor(x), 3, dim=2)]
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.to_tensor(x), _mesh(), [ap.Shard(1)])
        got = [p.full().numpy() for p in paddle.compat.split(d, [3, 4], dim=2)]
        got3 = [p.full().numpy() for p in paddle.compat.split(d, 3, dim=2)]
        with pytest.raises(ValueError, match="sum"):
            paddle.compat.split(d, [3, 3], dim=2)
    for w, g in zip(want + want3, got + got3):
        np.testing.assert_array_equal(g, w)
    assert [w.shape[2] for w in want3] == [3, 3, 1]


def _grid_values(grid):
    """What a vision tower computes from its grid: position ids, a padded index, a linspace, ..."""
    out = []
    for t, h, w in grid:
        hp = paddle.arange(h).unsqueeze(1).expand([-1, w]).reshape([h // 2, 2, w // 2, 2])
        out.append(hp.flatten())
        idx = paddle.arange(end=t * h * w).reshape([t, h, w])
        out.append(F.pad(idx, (0, 4 - w % 4, 0, 4 - h % 4), "constant", -100).flatten())
        out.append(paddle.linspace(0, 3, h))
        out.append(paddle.full_like(paddle.ones([2], "int64"), h * w))
        out.append(paddle.full([2], h // 2, dtype="int64"))                 # a [1] tensor as the fill value
        out.append(paddle.to_tensor([t, h, w]))
        out.append(h // 2)
    return out


def test_tensors_standing_for_numbers_are_read_from_a_sharded_grid():
    grid = np.array([[1, 4, 6], [1, 2, 2], [2, 4, 4], [1, 6, 2]], "int64")
    want = _grid_values(paddle.to_tensor(grid))
    with ap.simulate(world_size=2):
        d = ap.shard_tensor(paddle.to_tensor(grid), _mesh(), [ap.Shard(0)])
        got = _grid_values(d)
        assert d.device == paddle.to_tensor(grid).device
        got = [g.full() if hasattr(g, "full") else g for g in got]
    for w, g in zip(want, got):
        assert list(g.shape) == list(w.shape)                 # 0-d // 2 is [1], as in paddle
        np.testing.assert_allclose(g.numpy(), w.numpy())


@pytest.mark.parametrize("make", [
    lambda h: paddle.empty([h, 3]), lambda h: paddle.rand([h, 2]), lambda h: paddle.randn([2, h]),
    lambda h: paddle.standard_normal([h]), lambda h: paddle.uniform([h, 1]), lambda h: paddle.randint(0, h, [h]),
    lambda h: paddle.eye(h), lambda h: paddle.eye(h, h + 1)],
    ids=["empty", "rand", "randn", "standard_normal", "uniform", "randint", "eye", "eye_cols"])
def test_creation_ops_read_a_size_held_in_a_sharded_grid(make):
    """Every creation op that takes sizes reads them from a tensor as paddle does (the grid's entries here),
    not only those the models of the library call."""
    grid = np.array([[1, 2, 3], [1, 4, 5]], "int64")
    want = make(paddle.to_tensor(grid)[1, 1])
    with ap.simulate(world_size=2):
        got = make(ap.shard_tensor(paddle.to_tensor(grid), _mesh(), [ap.Shard(0)])[1, 1])
        got = got.full() if hasattr(got, "full") else got
    assert list(got.shape) == list(want.shape) == list(make(4).shape)
    if "eye" in str(make.__code__.co_names):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
