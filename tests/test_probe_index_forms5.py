"""Python's call forms on distributed tensors against the same expression on plain paddle tensors (values of
``.full()``, dtypes and every float input's gradient), with the inputs laid out on a 4-rank mesh (R, S(0),
S(1) with an empty shard, Partial) and on a 2 x 2 mesh. Each was wrong or crashed before:

* ``y[1] = v`` with ``v`` a 0-d (or broadcast) tensor requiring a gradient and ``y`` split so that a rank holds
  no columns: paddle's backward of a write into an empty region leaves the value's gradient uninitialized,
  so ``v.grad`` was garbage (1e30) summed over ranks;
* ``y[1] = np_array`` into a split dim (the whole array reached every shard: paddle's shape error);
* numpy operands of Python's operators: ``x + array``, ``array + x``, ``x * np.float32(2)``, ``np.float64(2) * x``,
  ``x @ array``, ``x != array`` (refused by the rules, or an AttributeError from numpy's own operator);
* ``3 // x``, ``3 % x`` (no reflected method) and ``+x``;
* result dtypes paddle gives that the rules declared otherwise (a ValueError after the local op):
  ``(x > 0) + 1`` is int64, ``2 ** i`` keeps i's integers, ``(x > 0) ** 2`` is int64, ``(x > 0) / True`` is bool,
  and a 0-d tensor beside a tensor of rank >= 1 is a number to the arithmetic ops (``f32[n] * f64[]`` is
  float32, ``i32[n] * i64[]`` is int32);
* an axis given as a tensor (``x.mean(axis=paddle.to_tensor(1))``), which paddle reads as its value;
* ``w.T`` / ``w.mT`` of a distributed parameter (paddle's property transposed the local shard, a plain tensor);
* ``fill_`` / ``zero_`` through a view (the base kept its values), ``x[None]`` views (refused as not invertible),
  ``as_strided`` (not known as a view: its base read silently unchanged after a write through it), and writes
  through views of a distributed parameter under ``no_grad`` (its views were not tracked: the parameter kept
  its values).

paddle's own bugs, where ours is checked against numpy instead: an in-place op on a view (``y[:, 1].scale_(3)``)
loses the view's share of the gradient in paddle (x's gradient is 4x where it is 6x); paddle's C operator
truncates ``int_tensor + np.float32(0.5)`` to integers (here: ``int_tensor + 0.5``, float32)."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.dist_tensor import as_dist

RNG = np.random.default_rng(0)
A = RNG.standard_normal((7, 6)).astype("float32")
ROW = RNG.standard_normal((6,)).astype("float32")
COL = RNG.standard_normal((7, 1)).astype("float32")
B = RNG.standard_normal((6, 5)).astype("float32")
I64 = RNG.integers(-3, 4, (7, 6)).astype("int64")
I32 = RNG.integers(1, 4, (7, 6)).astype("int32")
KINDS = {"R": ([4], "R"), "S0": ([4], "S(0)"), "S1": ([4], "S(1)"), "P": ([4], "P"),
         "S0,S1": ([2, 2], "S(0),S(1)"), "P,S0": ([2, 2], "P,S(0)"), "S1,P": ([2, 2], "S(1),P"),
         "S0,S0": ([2, 2], "S(0),S(0)")}


def _full(t):
    return None if t is None else t.full().numpy() if hasattr(t, "full") else t.numpy()


def _placements(kind, a):
    out = []
    for p in KINDS[kind][1].split(","):
        if p == "P":
            out.append(ap.Partial() if a.dtype.kind == "f" else ap.Replicate())
        elif p.startswith("S") and int(p[2]) < a.ndim:
            out.append(ap.Shard(int(p[2])))
        else:
            out.append(ap.Replicate())
    return out


def _call(fn, arrays, kind=None):
    """fn's output and every float input's gradient under a fixed output weighting."""
    ins = [paddle.to_tensor(a, stop_gradient=a.dtype.kind != "f") for a in arrays]
    if kind is not None:
        shape = KINDS[kind][0]
        mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
        ins = [ap.shard_tensor(t, mesh, _placements(kind, a)) for t, a in zip(ins, arrays)]
    out = fn(*ins)
    if out.dtype in (paddle.float32, paddle.float64) and not out.stop_gradient:
        w = np.random.default_rng(3).standard_normal(out.shape).astype("float32")
        (out * paddle.to_tensor(w).astype(out.dtype)).sum().backward()
    return _full(out), [None if t.grad is None else _full(t.grad) for t in ins]


def _mismatches(fn, arrays, ref=None, kinds=KINDS):
    want, want_g = _call(ref or fn, arrays)
    bad = []
    for kind in kinds:
        with ap.simulate(world_size=4):
            got, got_g = _call(fn, arrays, kind)
        if got.dtype != want.dtype or got.shape != want.shape or \
                not np.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True):
            bad.append(f"{kind}: value {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
        for i, (g, w) in enumerate(zip(got_g, want_g)):
            if (g is None) != (w is None) or (w is not None and not np.allclose(g, w, rtol=1e-4, atol=1e-5)):
                bad.append(f"{kind}: grad {i}")
    return bad


def _write(key, value_at=None, value=None):
    def fn(x, *vs):
        y = x * 1.0
        y[key] = vs[value_at] if value_at is not None else value
        return y * x
    return fn


SETITEM = {
    "0-d value into a row": (_write(1, 0), (A, np.array(2.5, "float32"))),
    "[1, 1] value into a block": (_write(slice(1, 3), 0), (A, np.full((1, 1), 0.5, "float32"))),
    "row value broadcast over rows": (_write(slice(2, 5), 0), (A, ROW)),
    "column value into a column block": (_write((slice(None), slice(2, 3)), 0), (A, COL)),
    "0-d value into a column": (_write((Ellipsis, 4), 0), (A, np.array(-1.0, "float32"))),
    "numpy row into a row": (_write(1, value=ROW), (A,)),
    "numpy float64 block, broadcast": (_write(slice(0, 7, 3), value=ROW.astype("float64")), (A,)),
    "numpy 0-d": (_write((slice(None), 0), value=np.array(3.0)), (A,)),
}


@pytest.mark.parametrize("name", list(SETITEM))
def test_setitem_forms_equal_the_whole_tensor(name):
    fn, arrays = SETITEM[name]
    assert _mismatches(fn, arrays) == []


def test_setitem_into_an_empty_shard_gives_the_value_its_gradient():
    """6 columns over 4 ranks: the last holds none; the 0-d value's gradient is the weighted sum of row 1."""
    w = np.random.default_rng(3).standard_normal(A.shape).astype("float32")
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        x = ap.shard_tensor(paddle.to_tensor(A), mesh, [ap.Shard(1)])
        v = ap.shard_tensor(paddle.to_tensor(np.array(2.5, "float32"), stop_gradient=False), mesh, [ap.Replicate()])
        y = x * 1.0
        y[1] = v
        assert list(y.locals[3].shape) == [7, 0]
        (y * paddle.to_tensor(w)).sum().backward()
        np.testing.assert_allclose(v.grad.numpy(), w[1].sum(), rtol=1e-5)


def test_setitem_of_a_float_array_into_an_integer_tensor_casts_it_as_paddle():
    want = paddle.to_tensor(I64)
    want[2] = np.linspace(-2.7, 2.7, 6)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        x = ap.shard_tensor(paddle.to_tensor(I64), mesh, [ap.Shard(1)])
        x[2] = np.linspace(-2.7, 2.7, 6)
        assert x.dtype == paddle.int64
        np.testing.assert_array_equal(x.numpy(), want.numpy())


OPERATORS = {
    "x + array": (lambda x: x + ROW, (A,)),
    "array + x": (lambda x: ROW + x, (A,)),
    "column array - x": (lambda x: COL - x, (A,)),
    "x * whole array": (lambda x: x * A, (A,)),
    "x + float64 array": (lambda x: x + ROW.astype("float64"), (A,)),
    "0-d array * x": (lambda x: np.array(0.5) * x, (A,)),
    "x + np.float32": (lambda x: x + np.float32(2.0), (A,)),
    "np.float64 * x": (lambda x: np.float64(2.0) * x, (A,)),
    "np.int64 - x": (lambda x: np.int64(3) - x, (A,)),
    "x != array": (lambda x: x != ROW, (A,)),
    "array < x": (lambda x: ROW < x, (A,)),
    "x @ array": (lambda x: x @ B, (A,)),
    "3 // x": (lambda x: 3 // (x * x + 1), (A,)),
    "3 % x": (lambda x: 3 % (x * x + 1), (A,)),
    "3 // 0-d": (lambda x: 3 // (x.sum() * x.sum() + 1), (A,)),
    "+x": (lambda x: +x, (A,)),
    "(x > 0) + 1": (lambda x: (x > 0) + 1, (A,)),
    "(x > 0) * 3": (lambda x: (x > 0) * 3, (A,)),
    "(x > 0) ** 2": (lambda x: (x > 0) ** 2, (A,)),
    "2 ** (x > 0)": (lambda x: 2 ** (x > 0), (A,)),
    "(x > 0) / True": (lambda x: (x > 0) / True, (A,)),
    "2 ** i": (lambda i: 2 ** i.abs(), (I64,)),
    "True ** i": (lambda i: True ** i, (I32,)),
    "x * float64 0-d": (lambda x: x * paddle.to_tensor(np.array(0.5)), (A,)),
    "float64 0-d - x": (lambda x: paddle.to_tensor(np.array(0.5)) - x, (A,)),
    "i32 * int64 0-d": (lambda i, j: i * j.sum(), (I32, I64)),
    "i64 + float64 0-d": (lambda i: i + paddle.to_tensor(np.array(0.5)), (I64,)),
    "x.mean(axis=tensor)": (lambda x: x.mean(axis=paddle.to_tensor(1)), (A,)),
    "x.sum(axis=tensor list)": (lambda x: x.sum(axis=paddle.to_tensor([0, 1])), (A,)),
    "paddle.max(x, tensor, True)": (lambda x: paddle.max(x, paddle.to_tensor(-1), True), (A,)),
    "x.argmax(axis=tensor)": (lambda x: x.argmax(axis=paddle.to_tensor(1)), (A,)),
    "x.unsqueeze(tensor)": (lambda x: x.unsqueeze(paddle.to_tensor(1)), (A,)),
}


@pytest.mark.parametrize("name", list(OPERATORS))
def test_operator_forms_equal_the_whole_tensor(name):
    fn, arrays = OPERATORS[name]
    assert _mismatches(fn, arrays) == []


def test_an_integer_tensor_plus_a_numpy_float_scalar_is_float_as_in_numpy():
    """paddle's C operator truncates ``int_tensor + np.float32(0.5)`` to integers (its own bug); here the numpy
    scalar is the python number it holds."""
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        i = ap.shard_tensor(paddle.to_tensor(I64), mesh, [ap.Shard(0)])
        out = i + np.float32(0.5)
        assert out.dtype == paddle.float32
        np.testing.assert_allclose(out.numpy(), I64 + 0.5)


def _view_scale(x):
    y = x * 1.0
    y[:, 1].scale_(3.0)
    return y * x


def test_in_place_op_on_a_view_has_the_true_gradient():
    """paddle loses the view's share of the gradient of an in-place op on it (x.grad is 4x in column 1, where
    d(3x * x)/dx = 6x); ours is checked against the closed form."""
    w = np.random.default_rng(3).standard_normal(A.shape).astype("float32")
    want_grad = 2 * A * w
    want_grad[:, 1] *= 3
    want = A * A
    want[:, 1] *= 3
    for kind in KINDS:
        with ap.simulate(world_size=4):
            got, (g,) = _call(_view_scale, (A,), kind)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=kind)
        np.testing.assert_allclose(g, want_grad, rtol=1e-5, atol=1e-5, err_msg=kind)


GETITEM = {
    "x[-1]": lambda x: x[-1], "x[1, -2]": lambda x: x[1, -2], "x[None:5]": lambda x: x[None:5],
    "x[5:1:-2, :]": lambda x: x[5:1:-2, :], "x[:, 1::3]": lambda x: x[:, 1::3], "x[..., None]": lambda x: x[..., None],
    "x[:, None, 2:]": lambda x: x[:, None, 2:], "x[[-1, 0]]": lambda x: x[[-1, 0]],
    "x[0-d tensor]": lambda x: x[paddle.to_tensor(3)], "x[:, 0-d tensor]": lambda x: x[:, paddle.to_tensor(2)],
    "x[2-d int tensor]": lambda x: x[paddle.to_tensor(np.array([[0, 1], [2, 6]]))],
    "x[[0, 2], 1:4]": lambda x: x[[0, 2], 1:4], "x[[0, 2, 3], [1, 1, 5]]": lambda x: x[[0, 2, 3], [1, 1, 5]],
    "x[x > 0]": lambda x: x[x > 0], "x[np.int64(3)]": lambda x: x[np.int64(3)], "x[5:2]": lambda x: x[5:2],
}


def test_getitem_forms_equal_the_whole_tensor():
    bad = {name: _mismatches(fn, (A,), kinds=("S0", "S1", "P", "S0,S1", "S1,P")) for name, fn in GETITEM.items()}
    assert {k: v for k, v in bad.items() if v} == {}


def test_a_boolean_scalar_index_is_refused_by_name():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        x = ap.shard_tensor(paddle.to_tensor(A), mesh, [ap.Shard(0)])
        with pytest.raises(NotImplementedError, match="boolean scalar"):
            x[True]


PARAM_FORMS = {
    "x @ w.T": lambda x, w: x @ w.T,
    "paddle.matmul(x, w.mT)": lambda x, w: paddle.matmul(x, w.mT),
    "F.linear(x, w.T)": lambda x, w: paddle.nn.functional.linear(x, w.T),
    "w + array": lambda x, w: (w + ROW).sum(0) * x[:, :6].sum(),
    "array - w": lambda x, w: (ROW - w).sum(0) * x[:, :6].sum(),
    "3 // w": lambda x, w: (3 // (w * w + 1)).sum(0) * x[:, :6].sum(),
}


@pytest.mark.parametrize("name", list(PARAM_FORMS))
@pytest.mark.parametrize("wp", ["S(0)", "S(1)", "R"])
def test_distributed_parameter_forms_equal_one_process(name, wp):
    """``w.T`` / ``w.mT`` of a distributed parameter was paddle's property, the C transpose of the local shard (a
    plain [6, 2] tensor taken as the whole, replicated weight: a wrong shape or, where it broadcast, wrong values)."""
    fn = PARAM_FORMS[name]
    xs = RNG.standard_normal((5, 6)).astype("float32")
    w0 = RNG.standard_normal((7, 6)).astype("float32")
    weight = np.random.default_rng(5).standard_normal((5, 7)).astype("float32")

    def run(dist):
        x = paddle.to_tensor(xs, stop_gradient=False)
        w = paddle.create_parameter([7, 6], "float32", default_initializer=paddle.nn.initializer.Assign(w0))
        if dist:
            mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
            pl = {"S(0)": ap.Shard(0), "S(1)": ap.Shard(1), "R": ap.Replicate()}[wp]
            w = ap.shard_tensor(w, mesh, [pl])
            x = ap.shard_tensor(x, mesh, [ap.Replicate()])      # whole: a replicated w's gradient is complete
        out = fn(x, w)
        wt = paddle.to_tensor(weight[:, :out.shape[-1]] if len(out.shape) == 2 else weight[0, :out.shape[0]])
        (out * wt).sum().backward()
        return _full(out), _full(x.grad), _full(w.grad) if not dist else _param_grad(w)

    want = run(False)
    with ap.simulate(world_size=4):
        got = run(True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _param_grad(w):
    return _full(as_dist(w).grad)


VIEW_WRITES = {
    "x[1:3].fill_(0)": lambda x: x[1:3].fill_(0.0),
    "x.reshape([42]).zero_()": lambda x: x.reshape([42]).zero_(),
    "x.flatten().zero_()": lambda x: x.flatten().zero_(),
    "x[1:5][1:3].fill_(-1)": lambda x: x[1:5][1:3].fill_(-1.0),
    "x[None].squeeze(0).scale_(2)": lambda x: x[None].squeeze(0).scale_(2.0),
    "x[:, None][:, 0, 2:4].fill_(3)": lambda x: x[:, None][:, 0, 2:4].fill_(3.0),
}


@pytest.mark.parametrize("name", list(VIEW_WRITES))
@pytest.mark.parametrize("kind", ["R", "S0", "S1", "S0,S1"])
def test_a_write_through_a_view_reaches_the_base(name, kind):
    """``fill_`` / ``zero_`` (DistTensor's own methods) on a view wrote the view's shards only: the base kept its
    values wherever the view was not a local alias (a row slice of row-split x: silently stale); a view made by
    ``x[None]`` was taken as not invertible (its index, None, read as "no index"), so x was refused as stale."""
    want = paddle.to_tensor(A.copy())
    VIEW_WRITES[name](want)
    with ap.simulate(world_size=4):
        shape = KINDS[kind][0]
        mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
        x = ap.shard_tensor(paddle.to_tensor(A.copy()), mesh, _placements(kind, A))
        VIEW_WRITES[name](x)
        np.testing.assert_allclose(x.full().numpy(), want.numpy())


@pytest.mark.parametrize("form", ["unbind", "diagonal", "as_strided"])
def test_a_write_through_a_view_that_cannot_be_carried_back_makes_the_base_refuse_reads(form):
    """paddle's unbind, diagonal and as_strided give views: a write through them changes x in paddle; here x is
    then refused by name (as_strided was not known as a view: x read silently unchanged)."""
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        x = ap.shard_tensor(paddle.to_tensor(A.copy()), mesh, [ap.Shard(0)])
        view = {"unbind": lambda: x.unbind(0)[3], "diagonal": lambda: x.diagonal(),
                "as_strided": lambda: x.as_strided([3, 2], [6, 1])}[form]()
        view.fill_(8.0)
        with pytest.raises(NotImplementedError, match="shares storage"):
            x.full()


PARAM_VIEW_WRITES = {
    "p[1:3].fill_(0)": lambda p: p[1:3].fill_(0.0),
    "p[2].scale_(5)": lambda p: p[2].scale_(5.0),
    "p.reshape([42]).zero_()": lambda p: p.reshape([42]).zero_(),
    "p.T.add_(ones)": lambda p: p.T.add_(paddle.ones([6, 7])),
    "p[None].squeeze(0).fill_(2)": lambda p: p[None].squeeze(0).fill_(2.0),
}


@pytest.mark.parametrize("name", list(PARAM_VIEW_WRITES))
@pytest.mark.parametrize("wp", ["S(0)", "S(1)", "R"])
def test_a_write_through_a_view_of_a_distributed_parameter_under_no_grad_reaches_it(name, wp):
    """Views of a distributed parameter were not tracked: where the view was not a local alias by chance (a row
    slice of a row-split parameter) the parameter kept its values silently; reshape views of it were recorded
    with its shard's shape."""
    want = paddle.create_parameter([7, 6], "float32", default_initializer=paddle.nn.initializer.Assign(A))
    with paddle.no_grad():
        PARAM_VIEW_WRITES[name](want)
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        pl = {"S(0)": ap.Shard(0), "S(1)": ap.Shard(1), "R": ap.Replicate()}[wp]
        p = ap.shard_tensor(paddle.create_parameter([7, 6], "float32",
                                                    default_initializer=paddle.nn.initializer.Assign(A)), mesh, [pl])
        with paddle.no_grad():
            PARAM_VIEW_WRITES[name](p)
        assert isinstance(p, paddle.Tensor) and as_dist(p).placements == [pl]
        np.testing.assert_allclose(as_dist(p).full().numpy(), want.numpy())


def test_a_view_of_a_distributed_parameter_written_directly_is_refused_not_stale():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["a"])
        p = ap.shard_tensor(paddle.create_parameter([7, 6], "float32",
                                                    default_initializer=paddle.nn.initializer.Assign(A)), mesh,
                            [ap.Shard(0)])
        view = p[1:3]
        with paddle.no_grad():
            p.scale_(2.0)
        with pytest.raises(NotImplementedError, match="shares storage"):
            view * 1
