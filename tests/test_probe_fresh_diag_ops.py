"""Diagonal, window and slice-scatter ops on distributed tensors, against paddle on the whole tensor (values and
every input's gradient under a random output weighting), with the inputs split along each of their dims on a
4-rank mesh (uneven shards: 6 and 5 rows over 4 ranks), Partial, and on a 2 x 2 mesh (two dims split, a dim split
twice, Partial beside a split). They were refused: einsum with a label repeated inside one operand ("ii->i",
"bii->bi", "iij->ij", "...ii->...i", "ii,i->i", mixed with contractions), ``Tensor.unfold`` /
``paddle.unfold`` (windows along an axis), ``fill_diagonal_`` (offsets, ``wrap``, 3-d), ``fill_diagonal_tensor``
and its in-place form, ``diagonal_scatter``, ``select_scatter``, ``slice_scatter``, ``diag_embed`` (also ``F.diag_embed``), ``diag``
(vector and matrix, a padding value), ``diagflat``, ``as_strided``. Hand-computed values pin the forms whose
reference is not paddle's own call (paddle 3.3's einsum fails on "iij->ij")."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel.local_ops import einsum_diagonals
from layout_sweep_helpers import LAYOUTS, failures, x as _x


def _filled(value, offset=0, wrap=False):
    def fn(a):
        c = a * 1.0
        c.fill_diagonal_(value, offset, wrap)
        return c
    return fn


def _filled_tensor(offset, dim1, dim2):
    def fn(a, y):
        c = a * 1.0
        c.fill_diagonal_tensor_(y, offset, dim1, dim2)
        return c
    return fn


CASES = {   # name: (f, input arrays, reference f or None for f itself on plain tensors)
    "einsum_ii_i": (lambda a: paddle.einsum("ii->i", a), [_x(6, 6)], None),
    "einsum_trace": (lambda a: paddle.einsum("ii->", a)[None], [_x(6, 6)], None),
    "einsum_implicit_trace": (lambda a: paddle.einsum("ii", a)[None], [_x(5, 5)], None),
    "einsum_bii_bi": (lambda a: paddle.einsum("bii->bi", a), [_x(4, 6, 6)], None),
    "einsum_iij_ij": (lambda a: paddle.einsum("iij->ij", a), [_x(6, 6, 4)],
                      lambda a: einsum_diagonals("iij->ij", a)),
    "einsum_ii_i_i": (lambda a, b: paddle.einsum("ii,i->i", a, b), [_x(6, 6), _x(6)], None),
    "einsum_contract_diag": (lambda a, b: paddle.einsum("bij,bjj->bi", a, b), [_x(4, 6, 5), _x(4, 5, 5)], None),
    "einsum_diag_outer": (lambda a, b: paddle.einsum("bii,bj->bij", a, b), [_x(4, 5, 5), _x(4, 6)], None),
    "einsum_ellipsis_diag": (lambda a: paddle.einsum("...ii->...i", a), [_x(4, 5, 5)], None),
    "unfold": (lambda a: a.unfold(1, 2, 2), [_x(4, 6, 5)], None),
    "unfold_overlap": (lambda a: paddle.unfold(a, 2, 3, 1), [_x(4, 6, 5)], None),
    "unfold_rows": (lambda a: a.unfold(0, 3, 1), [_x(6, 5)], None),
    "fill_diagonal_": (_filled(2.0), [_x(6, 6)], None),
    "fill_diagonal_offset": (_filled(2.0, 1), [_x(6, 5)], None),
    "fill_diagonal_tall_wrap": (_filled(-1.0, 0, True), [_x(7, 3)], None),
    "fill_diagonal_tall_negative": (_filled(-1.0, -2), [_x(7, 3)], None),
    "fill_diagonal_3d": (_filled(5.0), [_x(4, 4, 4)], None),
    "fill_diagonal_tensor": (lambda a, y: a.fill_diagonal_tensor(y, 0, 1, 2), [_x(4, 6, 5), _x(4, 5)], None),
    "fill_diagonal_tensor_": (_filled_tensor(1, 0, 2), [_x(4, 6, 5), _x(6, 4)], None),
    "diagonal_scatter": (lambda a, y: paddle.diagonal_scatter(a, y, -1, 1, 2), [_x(4, 6, 5), _x(4, 5)], None),
    "select_scatter": (lambda a, v: paddle.select_scatter(a, v, 1, 2), [_x(4, 6, 5), _x(4, 5)], None),
    "slice_scatter": (lambda a, v: paddle.slice_scatter(a, v, [2], [0], [4], [2]), [_x(4, 6, 5), _x(4, 6, 2)],
                      None),
    "diag_embed": (lambda a: paddle.diag_embed(a), [_x(4, 6)], None),
    "diag_embed_F": (lambda a: F.diag_embed(a, 1, 0, 2), [_x(4, 6)], None),
    "diag_vector": (lambda a: paddle.diag(a, 1), [_x(5)], None),
    "diag_vector_padding": (lambda a: paddle.diag(a, -1, padding_value=2.0), [_x(5)], None),
    "diag_matrix": (lambda a: a.diag(1), [_x(6, 5)], None),
    "diagflat": (lambda a: paddle.diagflat(a), [_x(2, 3)], None),
    "as_strided": (lambda a: paddle.as_strided(a, [3, 4], [5, 1], 8), [_x(4, 6, 5)], None),
}


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_diagonal_window_and_scatter_ops_equal_the_whole_tensor(kind):
    assert failures(CASES, kind) == []
    assert len(CASES) == 29                  # every entry of the table ran


def _mesh_and(x, placements):
    mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
    return ap.shard_tensor(paddle.to_tensor(x), mesh, placements)


def test_hand_computed_values():
    """Figures written out: the diagonal of arange(16) as 4 x 4 is 0, 5, 10, 15 (trace 30); "iij->ij" of
    arange(8) as 2 x 2 x 2 takes rows x[0, 0] = [0, 1] and x[1, 1] = [6, 7]; windows of 0..5 of size 2, step 2 are
    [0, 1], [2, 3], [4, 5]; fill_diagonal_(2) of a 3 x 3 zero matrix puts 2 at (0, 0), (1, 1), (2, 2)."""
    with ap.simulate(world_size=4):
        m = _mesh_and(np.arange(16, dtype="float32").reshape(4, 4), [ap.Shard(1)])
        assert paddle.einsum("ii->i", m).full().numpy().tolist() == [0, 5, 10, 15]
        assert float(paddle.einsum("ii", m)) == 30.0
        c = _mesh_and(np.arange(8, dtype="float32").reshape(2, 2, 2), [ap.Shard(2)])
        assert paddle.einsum("iij->ij", c).full().numpy().tolist() == [[0, 1], [6, 7]]
        v = _mesh_and(np.arange(6, dtype="float32"), [ap.Shard(0)])
        assert v.unfold(0, 2, 2).full().numpy().tolist() == [[0, 1], [2, 3], [4, 5]]
        z = _mesh_and(np.zeros((3, 3), "float32"), [ap.Shard(0)])
        assert z.fill_diagonal_(2.0) is z                    # in place: the same tensor, its value changed
        assert z.full().numpy().tolist() == [[2, 0, 0], [0, 2, 0], [0, 0, 2]]


def test_fill_diagonal_on_a_sharded_parameter_keeps_its_layout():
    """Identity initialisation of a column-split weight under no_grad: the diagonal of the 4 x 4 weight is 1,
    the other 12 entries unchanged, the layout still S(1); with gradients recorded paddle's refusal holds."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["a"])
        w = ap.shard_tensor(paddle.create_parameter([4, 4], "float32"), mesh, [ap.Shard(1)])
        before = w.full().numpy()
        with paddle.no_grad():
            assert w.fill_diagonal_(1.0) is w
        after = w.full().numpy()
        assert [str(p) for p in w.placements] == ["S(1)"]
        assert np.diag(after).tolist() == [1.0] * 4
        off = ~np.eye(4, dtype=bool)
        assert np.array_equal(after[off], before[off])
        with pytest.raises(ValueError, match="fill_diagonal_: a leaf tensor"):
            w.fill_diagonal_(0.0)


@pytest.mark.parametrize("call, error, match", [
    (lambda a: paddle.einsum("ii->i", a[:, :3]), ValueError, "size"),                  # a 4 x 3 "diagonal"
    (lambda a: a.unfold(1, 5, 1), ValueError, "size <= 4"),
    (lambda a: a.unfold(1, 2, 0), ValueError, "step > 0"),
    (lambda a: paddle.as_strided(a, [2, 2], [1, 1], 2), ValueError, "multiple of the 4 bytes"),
    (lambda a: paddle.select_scatter(a, a, 1, 0), ValueError, "values must have shape"),
    (lambda a: a.fill_diagonal_tensor(a[:, 0], 0, 0, 0), ValueError, "dim1 and dim2 must differ"),
])
def test_bad_arguments_get_a_typed_error(call, error, match):
    with ap.simulate(world_size=4):
        a = _mesh_and(_x(4, 4), [ap.Shard(0)])
        with pytest.raises(error, match=match):
            call(a)


def test_stack_with_an_empty_shard_of_a_constant_keeps_running():
    """paddle 3.3's stack backward segfaulted (StackGradKernel) when this rank's operand was an empty shard of a
    tensor needing no gradient (diag_embed's output, a constant) next to one that needs it: 6 rows over 4 ranks
    leave rank 3 none (the op-chain fuzzer found it, diag_embed then stack). The gradient of sum(stack) with
    respect to z is 1 everywhere (72 ones), with respect to the embedded input none (paddle's diag_embed has no
    gradient: its output has stop_gradient=True)."""
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        t = ap.shard_tensor(paddle.to_tensor(_x(2, 6), stop_gradient=False), mesh, [ap.Shard(1)])
        z = ap.shard_tensor(paddle.to_tensor(_x(2, 6, 6), stop_gradient=False), mesh, [ap.Shard(1)])
        s = paddle.stack([paddle.diag_embed(t), z], 2)
        assert [tuple(v.shape) for v in s.locals.values()][-1] == (2, 0, 2, 6)
        s.sum().backward()
        assert z.grad.full().numpy().tolist() == np.ones((2, 6, 6)).tolist()
        assert t.grad is None or not np.any(t.grad.full().numpy())
