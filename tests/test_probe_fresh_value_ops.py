"""Scatter, count, statistics and in-place composite ops on distributed tensors, against paddle on the whole tensor
(values and every input's gradient) over the layouts of tests/layout_sweep_helpers.py. They were refused:
``scatter_add`` / ``scatter_add_`` / ``scatter_reduce`` (every reduce, ``include_self``), ``scatter_nd``,
``block_diag``, ``meshgrid``, ``cartesian_prod``, ``combinations``, ``isin``, ``histogram`` (an explicit range:
shards counted apart and summed; the data's own range; weights; density), ``histogram_bin_edges``,
``unique_consecutive``, ``reduce_as``, ``linalg.cov`` (rows or columns, ``ddof``, frequency and analytic
weights, a vector) and ``linalg.corrcoef``, ``cumulative_trapezoid``, ``vander``, and the in-place ``addmm_`` /
``baddbmm_`` / ``ldexp_``, ``pdist`` (also ``F.pdist``), ``multigammaln(_)``, ``frexp``, ``multiplex``,
``shard_index``, ``paddle.assign(value, output=h)`` into a non-leaf (its gradient reached the value as 1.0 where
paddle gives the true one: the write ran under no_grad), the per-matrix ``paddle.linalg`` ops (inv, det, slogdet,
cholesky, qr, svd, eigh, matrix_power, matrix_exp, pinv, solve, triangular_solve, cholesky_solve, matrix_rank,
cond, cholesky_inverse, lu, lu_unpack, lu_solve, householder_product, ormqr), and paddle's
in-place random fills on an activation (``uniform_`` ... ``geometric_``: one draw at the global shape, the single
process's values under the same seed)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from layout_sweep_helpers import LAYOUTS, failures, x as _x

_IDX = np.random.default_rng(3).integers(0, 6, (4, 3, 5))          # row picks along dim 1 of a [4, 6, 5] tensor
_FW = np.array([1, 2, 1, 3, 1, 1, 2], "int64")                    # frequency weights of 7 observations


def _idx():
    return paddle.to_tensor(_IDX)


def _scatter_add_(a, s):
    c = a * 1.0
    c.scatter_add_(1, _idx(), s)
    return c


def _addmm_(i, a, b):
    c = i * 1.0
    c.addmm_(a, b, 0.5, 2.0)
    return c


def _baddbmm_(i, a, b):
    c = i * 1.0
    paddle.baddbmm_(c, a, b, 0.5, 2.0)
    return c


def _ldexp_(a):
    c = a * 1.0
    c.ldexp_(paddle.to_tensor(np.array([1, 2, 0, 3, 1], "int32")))
    return c


def _multigammaln_(a):
    c = a.abs() + 3
    c.multigammaln_(2)
    return c


def _assign_into(a, b):
    """paddle.assign(value, output=h) with h a non-leaf: h's gradient flows to the value, as in paddle."""
    h = a * 1.0
    paddle.assign(b * 2.0, output=h)
    return h * a


def _spd(b, n):
    """b symmetric positive definite n x n matrices, well conditioned (a aT + n I)."""
    a = np.random.default_rng(11).standard_normal((b, n, n)).astype("float32")
    return (a @ a.transpose(0, 2, 1) + n * np.eye(n)).astype("float32")


_SPD = _spd(3, 4)                                    # a batch of 3: split over 4 ranks, one holds none
_CHOL = np.linalg.cholesky(_SPD).astype("float32")
L = paddle.linalg


def _qr_both(a):
    """Q and R both used (paddle's qr backward with R alone segfaults: QrGradKernel, in one process too)."""
    q, r = L.qr(a)
    return paddle.concat([q, r.transpose([0, 2, 1])], 1)


def _lu_unpacked(a):
    lu, pivots = L.lu(a)
    p, lower, upper = L.lu_unpack(lu, pivots)
    return paddle.concat([p, lower, upper], 1)


def _lu_solved(a, y):
    lu, pivots = L.lu(a)
    return L.lu_solve(y, lu, pivots)


def _counted(h):
    """A count (no gradient in paddle) joined to a differentiable input, so the table's backward runs."""
    return lambda a, *rest: a.sum() * 0 + h(a, *rest).astype("float32")


CASES = {   # name: (f, input arrays, reference f or None for f itself on plain tensors)
    "scatter_add": (lambda a, s: paddle.scatter_add(a, 1, _idx(), s), [_x(4, 6, 5), _x(4, 3, 5)], None),
    "scatter_add_": (_scatter_add_, [_x(4, 6, 5), _x(4, 3, 5)], None),
    **{f"scatter_reduce_{r}": ((lambda r: lambda a, s: paddle.scatter_reduce(a, 1, _idx(), s, r))(r),
                               [_x(4, 6, 5), _x(4, 3, 5)], None) for r in ("sum", "prod", "mean", "amin", "amax")},
    "scatter_reduce_without_self": (lambda a, s: paddle.scatter_reduce(a, 1, _idx(), s, "amax", include_self=False),
                                    [_x(4, 6, 5), _x(4, 3, 5)], None),
    "scatter_nd": (lambda u: paddle.scatter_nd(paddle.to_tensor([[1], [3], [1]]), u, [6, 5]), [_x(3, 5)], None),
    "block_diag": (lambda a, b: paddle.block_diag([a, b, a[0]]), [_x(3, 4), _x(2, 5)], None),
    "meshgrid": (lambda a, b: paddle.stack(paddle.meshgrid(a, b)), [_x(5), _x(6)], None),
    "meshgrid_list": (lambda a, b: sum(paddle.meshgrid([a, b])) * 2.0, [_x(5), _x(6)], None),
    "cartesian_prod": (lambda a, b: paddle.cartesian_prod([a, b]), [_x(5), _x(6)], None),
    "combinations": (lambda a: paddle.combinations(a), [_x(5)], None),
    "combinations_3_replacement": (lambda a: paddle.combinations(a, 3, True), [_x(4)], None),
    "isin": (lambda a: a * paddle.isin(a, a[0, :2, 1]).astype("float32"), [np.round(_x(4, 6, 5))], None),
    "histogram_range": (_counted(lambda a: paddle.histogram(a, 5, -1.0, 1.0)), [_x(4, 6, 5)], None),
    "histogram_data_range": (_counted(lambda a: paddle.histogram(a, 5)), [_x(4, 6, 5)], None),
    "histogram_weight": (_counted(lambda a, w: paddle.histogram(a, 5, -1.0, 1.0, weight=w)),
                         [_x(4, 6, 5), np.abs(_x(4, 6, 5))], None),
    "histogram_density": (_counted(lambda a: paddle.histogram(a, 5, -1.0, 1.0, density=True)), [_x(4, 6, 5)], None),
    "histogram_bin_edges": (_counted(lambda a: paddle.histogram_bin_edges(a, 5)), [_x(4, 6, 5)], None),
    "unique_consecutive": (_counted(lambda a: paddle.unique_consecutive(a.flatten().round().astype("int64"))[None]),
                           [_x(4, 6, 5)], None),
    "reduce_as": (lambda a, t: paddle.reduce_as(a, t), [_x(4, 6, 5), _x(6, 1)], None),
    "cov": (lambda a: paddle.linalg.cov(a), [_x(4, 7)], None),
    "cov_columns": (lambda a: paddle.linalg.cov(a, rowvar=False, ddof=False), [_x(4, 7)], None),
    "cov_vector": (lambda a: paddle.linalg.cov(a[0])[None], [_x(4, 7)], None),
    "cov_weights": (lambda a, w: paddle.linalg.cov(a, fweights=paddle.to_tensor(_FW), aweights=w),
                    [_x(4, 7), np.abs(_x(7)) + 0.1], None),
    "corrcoef": (lambda a: paddle.linalg.corrcoef(a), [_x(4, 7)], None),
    "cumulative_trapezoid": (lambda a: paddle.cumulative_trapezoid(a, dx=0.5, axis=1), [_x(4, 7)], None),
    "cumulative_trapezoid_x": (lambda a, t: paddle.cumulative_trapezoid(a, t.abs().cumsum(1)), [_x(4, 7), _x(4, 7)],
                               None),
    "vander": (lambda a: paddle.vander(a, 4), [_x(6)], None),
    "addmm_": (_addmm_, [_x(6, 4), _x(6, 5), _x(5, 4)], None),
    "baddbmm_": (_baddbmm_, [_x(2, 6, 4), _x(2, 6, 5), _x(2, 5, 4)], None),
    "ldexp_": (_ldexp_, [_x(6, 5)], None),
    "pdist": (lambda a: paddle.pdist(a), [_x(5, 4)], None),
    "pdist_1_functional": (lambda a: F.pdist(a, 1.0), [_x(5, 4)], None),
    "pdist_inf": (lambda a: paddle.pdist(a, float("inf")), [_x(5, 4)], None),
    "multigammaln": (lambda a: paddle.multigammaln(a.abs() + 3, 3), [_x(5, 4)], None),
    "multigammaln_": (_multigammaln_, [_x(5, 4)], None),
    "frexp": (lambda a: paddle.frexp(a)[0] + paddle.frexp(a)[1], [_x(5, 4) * 10], None),
    "multiplex": (lambda a, b: paddle.multiplex([a, b], paddle.to_tensor(np.array([[1], [0], [1], [1], [0]], "int32"))),
                  [_x(5, 4), _x(5, 4, seed=1)], None),
    "shard_index": (lambda a: a + paddle.shard_index(paddle.to_tensor(np.array([[1], [7], [12], [19], [4]])), 20, 2, 1)
                    .astype("float32"), [_x(5, 1)], None),
    "assign_into_output": (_assign_into, [_x(5, 4), _x(5, 4, seed=1)], None),
    **{f"linalg_{k}": v for k, v in {
        "inv": (lambda a: L.inv(a), [_SPD], None),
        "inverse_method": (lambda a: a.inverse(), [_SPD], None),
        "det": (lambda a: L.det(a), [_SPD], None),
        "slogdet": (lambda a: L.slogdet(a), [_SPD], None),
        "cholesky": (lambda a: L.cholesky(a), [_SPD], None),
        "cholesky_upper_method": (lambda a: a.cholesky(upper=True), [_SPD], None),
        "qr": (_qr_both, [_x(3, 5, 4)], None),
        "svd_values": (lambda a: L.svd(a)[1], [_x(3, 5, 4)], None),
        "svdvals": (lambda a: L.svdvals(a), [_x(3, 5, 4)], None),
        "eigvalsh": (lambda a: L.eigvalsh(a), [_SPD], None),
        "eigh_values": (lambda a: L.eigh(a)[0], [_SPD], None),
        "matrix_power": (lambda a: L.matrix_power(a, 3) * 1e-3, [_SPD], None),
        "matrix_power_negative": (lambda a: L.matrix_power(a, -2), [_SPD], None),
        "matrix_exp": (lambda a: L.matrix_exp(a * 0.02), [_SPD], None),
        "pinv": (lambda a: L.pinv(a), [_x(3, 5, 4)], None),
        "solve": (lambda a, y: L.solve(a, y), [_SPD, _x(3, 4, 2)], None),
        "solve_vectors": (lambda a, y: L.solve(a, y), [_SPD, _x(3, 4)], None),
        "triangular_solve": (lambda a, y: L.triangular_solve(a, y, upper=False), [_CHOL, _x(3, 4, 2)], None),
        "cholesky_solve": (lambda y, c: L.cholesky_solve(y, c), [_x(3, 4, 2), _CHOL], None),
        "matrix_rank": (lambda a: L.matrix_rank(a).astype("float32") + a.sum() * 0, [_x(3, 5, 4)], None),
        "cond": (lambda a: L.cond(a), [_SPD], None),
        "cond_fro": (lambda a: L.cond(a, "fro"), [_SPD], None),
        "cholesky_inverse": (lambda c: L.cholesky_inverse(c), [_CHOL[0]], None),
        "lu": (lambda a: L.lu(a)[0], [_SPD], None),
        "lu_unpack": (_lu_unpacked, [_SPD], None),
        "lu_solve": (_lu_solved, [_SPD, _x(3, 4, 2)], None),
        "householder_product": (lambda a: L.householder_product(a.detach(), paddle.ones([3, 4]) * 0.5) + a.sum() * 0,
                                [_x(3, 5, 4)], None),         # paddle's backward of it fails (in place in its body)
        "ormqr": (lambda a, y: L.ormqr(a.detach(), paddle.ones([3, 4]) * 0.5, y.detach()) + (a.sum() + y.sum()) * 0,
                  [_SPD, _x(3, 4, 2)], None),
    }.items()},
}


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_scatter_count_and_statistics_ops_equal_the_whole_tensor(kind):
    assert failures(CASES, kind) == []
    assert len(CASES) == 71                  # every entry of the table ran


def _laid_out(a, placements, n=4):
    mesh = ap.ProcessMesh(list(range(n)), dim_names=["a"])
    return ap.shard_tensor(paddle.to_tensor(a), mesh, placements)


def test_hand_computed_values():
    """Figures written out: scatter_add of ones at rows [0, 2, 0] of a 3-row zero column gives [2, 0, 1];
    histogram of 0.5, 1.5, 1.5, 2.5, 3.5, 3.9 in 4 bins over [0, 4] counts 1, 2, 1, 2 (each rank counts its
    shard, the Partial sum is the whole count); block_diag of [[1]] and [[2, 3]] is [[1, 0, 0], [0, 2, 3]];
    cov of the rows [1, 2, 3] and [2, 4, 6] is [[1, 2], [2, 4]] (ddof 1); isin of 1..6 in [2, 5] is true at 2, 5."""
    with ap.simulate(world_size=2):
        z = _laid_out(np.zeros((3, 1), "float32"), [ap.Shard(0)], 2)
        ones = _laid_out(np.ones((3, 1), "float32"), [ap.Shard(0)], 2)
        got = paddle.scatter_add(z, 0, paddle.to_tensor([[0], [2], [0]]), ones).full().numpy()
        assert got.ravel().tolist() == [2, 0, 1]
        v = _laid_out(np.array([0.5, 1.5, 1.5, 2.5, 3.5, 3.9], "float32"), [ap.Shard(0)], 2)
        h = paddle.histogram(v, 4, 0.0, 4.0)
        assert [str(p) for p in h.placements] == ["P(sum)"]
        assert h.full().numpy().tolist() == [1, 2, 1, 2]
        a, b = _laid_out(np.ones((1, 1), "float32"), [ap.Replicate()], 2), \
            _laid_out(np.array([[2, 3]], "float32"), [ap.Shard(1)], 2)
        assert paddle.block_diag([a, b]).full().numpy().tolist() == [[1, 0, 0], [0, 2, 3]]
        m = _laid_out(np.array([[1, 2, 3], [2, 4, 6]], "float32"), [ap.Shard(1)], 2)
        assert np.allclose(paddle.linalg.cov(m).full().numpy(), [[1, 2], [2, 4]])
        t = _laid_out(np.arange(1, 7, dtype="float32"), [ap.Shard(0)], 2)
        assert paddle.isin(t, paddle.to_tensor([2.0, 5.0])).full().numpy().tolist() == \
            [False, True, False, False, True, False]


def test_in_place_composite_on_a_leaf_that_requires_a_gradient_is_refused():
    """paddle refuses ``addmm_`` on a leaf tensor that requires a gradient; so does its distributed form."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["a"])
        leaf = ap.shard_tensor(paddle.to_tensor(_x(6, 4), stop_gradient=False), mesh, [ap.Shard(0)])
        with pytest.raises(ValueError, match="leaf tensor"):
            leaf.addmm_(paddle.to_tensor(_x(6, 5)), paddle.to_tensor(_x(5, 4)))


@pytest.mark.parametrize("call, error, match", [
    (lambda a: paddle.scatter_reduce(a, 0, paddle.zeros([2, 4], "int64"), a[:2], "median"), ValueError, "reduce"),
    (lambda a: paddle.histogram(a, 0), ValueError, "bins"),
    (lambda a: paddle.histogram(a, 4, 2.0, 1.0), ValueError, "max must be >= min"),
    (lambda a: paddle.reduce_as(a, a[:2, :3]), ValueError, "target's shape"),
    (lambda a: paddle.combinations(a), TypeError, "1-D"),
    (lambda a: paddle.linalg.cov(a.unsqueeze(0)), ValueError, "1 or 2 dims"),
])
def test_bad_arguments_get_a_typed_error(call, error, match):
    with ap.simulate(world_size=4):
        a = _laid_out(_x(4, 4), [ap.Shard(0)])
        with pytest.raises(error, match=match):
            call(a)


FILLS = [("uniform_", (-0.5, 0.5)), ("normal_", (1.0, 2.0)), ("exponential_", (2.0,)), ("cauchy_", ()),
         ("log_normal_", ()), ("bernoulli_", (0.3,)), ("geometric_", (0.4,))]
FILL_LAYOUTS = [([ap.Shard(0)], [4]), ([ap.Shard(1)], [4]), ([ap.Partial()], [4]), ([ap.Shard(0), ap.Shard(1)], [2, 2])]


def _one_process_fill(op, args):
    paddle.seed(7)
    t = paddle.zeros([6, 5])
    getattr(t, op)(*args)
    return t.numpy()


@pytest.mark.parametrize("op, args", FILLS, ids=[f[0] for f in FILLS])
def test_in_place_random_fills_equal_the_single_process_draw(op, args):
    """``x.uniform_(...)`` & co. on a distributed activation (they were refused): one draw at the global shape
    [6, 5] (6 rows over 4 ranks: 2, 2, 2, 0), so the values equal one process's under the same seed; the tensor
    itself is returned, split as it was (a Partial one becomes R). Negative control: another seed differs."""
    want = _one_process_fill(op, args)
    for pl, shape in FILL_LAYOUTS:
        with ap.simulate(world_size=4):
            mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
            x = ap.shard_tensor(paddle.zeros([6, 5]), mesh, pl)
            paddle.seed(7)
            assert getattr(x, op)(*args) is x
            assert np.allclose(x.full().numpy(), want), (op, pl)
            assert [str(p) for p in x.placements] == ["R" if p.is_partial() else str(p) for p in pl]
    with ap.simulate(world_size=4):
        x = ap.shard_tensor(paddle.zeros([6, 5]), ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"]), [ap.Shard(0)])
        paddle.seed(8)
        getattr(x, op)(*args)
        assert not np.allclose(x.full().numpy(), want)


def test_uniform_fill_on_a_leaf_that_requires_a_gradient_is_refused():
    with ap.simulate(world_size=2):
        x = ap.shard_tensor(paddle.zeros([4, 4]), ap.ProcessMesh([0, 1], dim_names=["a"]), [ap.Shard(0)])
        x.stop_gradient = False
        with pytest.raises(ValueError, match="leaf tensor"):
            x.uniform_()


_P = np.random.default_rng(0).random((6, 5)).astype("float32")             # probabilities
_LAM = (np.random.default_rng(1).random((6, 5)) * 3).astype("float32")     # rates, means
DRAWS = {   # name: (f, input arrays)
    "bernoulli": (lambda a: paddle.bernoulli(a), [_P]),
    "bernoulli_p": (lambda a: paddle.bernoulli(a, 0.3), [_P]),
    "poisson": (lambda a: paddle.poisson(a), [_LAM]),
    "standard_gamma": (lambda a: paddle.standard_gamma(a + 1), [_LAM]),
    "binomial": (lambda c, p: paddle.binomial(c, p), [np.full((6, 5), 5.0, "float32"), _P]),
    "normal_tensor_mean": (lambda m: paddle.normal(m, 2.0), [_LAM]),
    "normal_tensor_std": (lambda s: paddle.normal(0.0, s), [_LAM]),
    "log_normal": (lambda m, s: paddle.log_normal(m, s * 0.1), [_LAM, _P]),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
def test_draws_reading_a_distributed_tensor_equal_the_single_process_draw(name):
    """``paddle.bernoulli(probs)`` & co. with distributed arguments (they were refused as reading values): one draw
    from the whole value, laid out like the argument (Partial -> R), equal to one process's under seed 5 (a
    [6, 5] tensor, 6 rows over 4 ranks: 2, 2, 2, 0); negative control: seed 6 differs."""
    fn, xs = DRAWS[name]
    paddle.seed(5)
    want = fn(*[paddle.to_tensor(a) for a in xs]).numpy()
    for pl, shape in FILL_LAYOUTS:
        with ap.simulate(world_size=4):
            mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
            ins = [ap.shard_tensor(paddle.to_tensor(a), mesh, pl) for a in xs]
            paddle.seed(5)
            out = fn(*ins)
            assert np.array_equal(out.full().numpy(), want), (name, pl)
            assert [str(p) for p in out.placements] == ["R" if p.is_partial() else str(p) for p in pl]
            paddle.seed(6)
            assert not np.array_equal(fn(*ins).full().numpy(), want)
