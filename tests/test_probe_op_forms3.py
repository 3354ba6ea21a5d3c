"""Less common call forms on distributed tensors, against paddle on the whole tensor (values, every input's
gradient and, for in-place forms, the written tensor) over the layouts of tests/layout_sweep_helpers.py. Each
was wrong or crashed before:

* ``take_along_axis`` with its default ``broadcast=True`` and an index of size 1 on a non-axis dim (the declared
  output shape was the index's);
* ``paddle.sum`` / ``nansum`` with ``dtype`` where a rank's shard is empty (paddle ignores a float dtype on an
  empty input);
* ``F.embedding`` with ``max_norm`` (vocab-parallel: never renormed; ids sharded: paddle's renorm crashed on an
  empty shard; a sharded weight: the renorm rescaled a gathered copy) and with ``scale_grad_by_freq`` (rows
  counted per rank);
* an in-place op under ``paddle.no_grad()`` on a tensor that requires a gradient (the tensor lost its gradient),
  and an input read under ``no_grad`` then by an op recording gradients (the copy made without a graph for the
  first read was reused: no gradient);
* ``paddle.where_(cond, x, y)`` (it wrote the condition; paddle writes ``x``);
* ``i & j`` / ``i | j`` / ``~i`` on integers and ``paddle.bitwise_and`` / ``bitwise_or`` (routed to the logical
  rules: bool declared, integers made), ``paddle.logical_not`` of integers, ``i ^ j``, ``3 & i``, ``i << 1``
  (no such DistTensor method);
* ``paddle.quantile(x, [q])`` (paddle gives one q no leading dim) and ``q`` as a tensor (refused);
* ``paddle.strided_slice`` with a negative stride (refused), ``paddle.roll(..., dims=)`` and
  ``argmax(..., keepdims=)`` (aliases paddle's C parser takes for these ops only: refused as unexpected);
* ``x.size(0)`` / ``x.size()`` (paddle's ``size`` is a callable int; a DistTensor's was a plain int);
* ``x[mask]`` with the mask a python list or numpy array of bools (refused: only integer lists);
* ``index_fill`` with a 0-d tensor value (the rule counted two tensor operands of three)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from layout_sweep_helpers import LAYOUTS, placements, x as _x

IDS = np.array([[0, 2, 9, 2], [2, 5, 1, 2]], "int64")
_RNG = np.random.default_rng(1)
TAKE_IDX = {"row": np.array([[0, 2, 5]], "int64"), "col": np.array([[0], [2], [5], [6]], "int64"),
            "full": _RNG.integers(0, 6, (7, 3)), "wide": _RNG.integers(0, 6, (7, 8))}


def _full(t):
    return t.full().numpy() if hasattr(t, "full") else t.numpy()


def _outs(o):
    return list(o) if isinstance(o, (list, tuple)) else [o]


def _call(fn, xs, kind=None, only=None):
    """fn's outputs and every float input's gradient (None where it has none), on plain tensors (kind None)
    or with the inputs (those in ``only``, default all) laid out as ``kind``."""
    ins = [paddle.to_tensor(a, stop_gradient=a.dtype.kind != "f") for a in xs]
    if kind is not None:
        shape = LAYOUTS[kind]
        mesh = ap.ProcessMesh(np.arange(4).reshape(shape).tolist(), dim_names=["a", "b"][:len(shape)])
        ins = [ap.shard_tensor(t, mesh, _legal(placements(kind, a.ndim), a)) if only is None or i in only else t
               for i, (t, a) in enumerate(zip(ins, xs))]
    outs = _outs(fn(*ins))
    rng = np.random.default_rng(9)
    loss = sum((o * paddle.to_tensor(rng.standard_normal(o.shape).astype("float32")).astype(o.dtype)).sum()
               for o in outs if o.dtype in (paddle.float32, paddle.float64) and not o.stop_gradient)
    if not isinstance(loss, int):
        loss.backward()
    return [_full(o) for o in outs], [None if t.grad is None else _full(t.grad) for t in ins]


def _legal(pl, a):
    """Integer tensors are never Partial, a 0-d tensor is never split: those placements become Replicate."""
    return [ap.Replicate() if (a.dtype.kind != "f" and isinstance(p, ap.Partial))
            or (isinstance(p, ap.Shard) and p.dim >= a.ndim) else p for p in pl]


def _mismatches(fn, xs, kind, only=None):
    want, want_g = _call(fn, xs)
    with ap.simulate(world_size=4):
        got, got_g = _call(fn, xs, kind, only)
    bad = [f"value {i}" for i, (g, w) in enumerate(zip(got, want))
           if g.dtype != w.dtype or g.shape != w.shape or not np.allclose(g, w, rtol=1e-4, atol=1e-5)]
    for i, (g, w) in enumerate(zip(got_g, want_g)):
        if w is None or g is None:
            bad += [f"grad {i} missing"] if (g is None) != (w is None) else []
        elif g.shape != w.shape or not np.allclose(g, w, rtol=1e-4, atol=1e-5):
            bad.append(f"grad {i}")
    return bad


def _copy(a):
    return a * 1.0


def _where_(a, b):
    c = _copy(a)
    r = paddle.where_(c > 0, c, b)
    return [c, r]


def _where_method(a, b):
    c = _copy(a)
    (c > 0).where_(c, b)
    return c


def _no_grad_write(op):
    def fn(a, b):
        h = a * 2
        with paddle.no_grad():
            op(h, b)
        return h * a
    return fn


def _no_grad_leaf(a, b):
    with paddle.no_grad():
        a[0] = 0.0
        a.scale_(2.0)
    return a * b


def _read_without_grad(a, b):
    with paddle.no_grad():
        (a * b).sum()
    return (a + b) * a


def _no_grad_then_grad(a, b):
    h = a * 2
    with paddle.no_grad():
        h.mul_(b)
    h.add_(b)
    return h * a


def _renorm_lookup(norm_type):
    def fn(i, w):
        out = F.embedding(i, w, max_norm=1.0, norm_type=norm_type)
        return [out, w * 1.0]          # the weight after its in-place renorm
    return fn


CASES = {
    **{f"take_along_axis {k}": (lambda a, i: paddle.take_along_axis(a, i, axis=1), [_x(7, 6), v])
       for k, v in TAKE_IDX.items() if k != "col"},
    "take_along_axis axis 0": (lambda a, i: paddle.take_along_axis(a, i, 0), [_x(7, 6), TAKE_IDX["col"]]),
    "take_along_axis arr broadcast": (lambda a, i: paddle.take_along_axis(a, i, 1), [_x(1, 6), TAKE_IDX["full"]]),
    "take_along_axis 3-d": (lambda a, i: paddle.take_along_axis(a, i, axis=2),
                            [_x(7, 6, 5), _RNG.integers(0, 5, (1, 6, 3))]),
    "sum dtype axis 0": (lambda a: paddle.sum(a, axis=0, dtype="float64"), [_x(7, 6)]),
    "sum dtype axis 1": (lambda a: a.sum(axis=[1], keepdim=True, dtype="float64"), [_x(7, 6)]),
    "sum dtype all": (lambda a: paddle.sum(a, dtype="float64"), [_x(7, 6)]),
    "sum bool int32": (lambda a: paddle.sum(a > 0, axis=1, dtype="int32"), [_x(7, 6)]),
    "nansum dtype": (lambda a: paddle.nansum(a, axis=1, dtype="float64"), [_x(7, 6)]),
    "embedding max_norm": (_renorm_lookup(2.0), [IDS, _x(10, 6)]),
    "embedding max_norm p1": (_renorm_lookup(1.0), [IDS, _x(10, 6)]),
    "embedding scale_grad_by_freq": (lambda i, w: F.embedding(i, w, scale_grad_by_freq=True), [IDS, _x(10, 6)]),
    "embedding freq padding_idx": (lambda i, w: F.embedding(i, w, padding_idx=2, scale_grad_by_freq=True),
                                   [IDS, _x(10, 6)]),
    "where_": (_where_, [_x(7, 6), _x(7, 6, seed=2)]),
    "Tensor.where_": (_where_method, [_x(7, 6), _x(7, 6, seed=2)]),
    "no_grad masked_fill_": (_no_grad_write(lambda h, b: h.masked_fill_(h > b, 1.0)), [_x(7, 6), _x(6)]),
    "no_grad add_": (_no_grad_write(lambda h, b: h.add_(b)), [_x(7, 6), _x(6)]),
    "no_grad clip_": (_no_grad_write(lambda h, b: h.clip_(-0.3, 0.3)), [_x(7, 6), _x(6)]),
    "no_grad setitem leaf": (_no_grad_leaf, [_x(7, 6), _x(7, 6, seed=3)]),
    "no_grad read, then grad": (_read_without_grad, [_x(7, 6), _x(6)]),
    "no_grad write, then grad": (_no_grad_then_grad, [_x(7, 6), _x(6)]),
}
_I, _J = (np.random.default_rng(s).integers(-5, 5, (7, 6)) for s in (2, 3))
CASES.update({
    "int & | ^ ~": (lambda i, j: [i & j, i | j, i ^ j, ~i, paddle.bitwise_and(i, j), paddle.bitwise_not(j)], [_I, _J]),
    "int reflected and shifts": (lambda i: [3 & i, 3 | i, 5 ^ i, i << 1, i >> 1, 1 << i.abs().clip(0, 3)], [_I]),
    "bool & | ~": (lambda a: ((a > 0) & (a < 1) | ~(a > -1)).astype("float32") * a, [_x(7, 6)]),
    "logical_not int": (lambda i: paddle.logical_not(i), [_I]),
    "quantile [q]": (lambda a: [paddle.quantile(a, [0.25], axis=0), paddle.nanquantile(a, (0.7,), 1, True)],
                     [_x(7, 6)]),
    "quantile tensor q": (lambda a: [paddle.quantile(a, paddle.to_tensor([0.2, 0.9]), axis=0),
                                     a.quantile(paddle.to_tensor(0.3))], [_x(7, 6)]),
    "strided_slice negative": (lambda a: [paddle.strided_slice(a, [0], [6], [0], [-2]),
                                          paddle.strided_slice(a, [1, 0], [5, -1], [-7, -100], [-2, -1])],
                               [_x(7, 6)]),
    "roll dims, argmax keepdims": (lambda a: [paddle.roll(a, shifts=1, dims=0), a.roll([1, -2], dims=[0, 1]),
                                              paddle.argmax(a, axis=0, keepdims=True), a.argmin(dim=1, keepdims=True)],
                                   [_x(7, 6)]),
    "size(dim)": (lambda a: [a.reshape([a.size(0) * 2, -1]), a.reshape(list(a.size())[::-1]), a * (a.size + 0.0)],
                  [_x(7, 6)]),
    "index_fill tensor value": (lambda a, v: [paddle.index_fill(a, paddle.to_tensor([2, 5]), 1, v * 2),
                                          (a * 1).index_fill_(paddle.to_tensor([0, 6]), 0, paddle.to_tensor(9.0))],
                                [_x(7, 6), np.array(3.0, "float32")]),
    "x[bool list]": (lambda a: [a[[True, False, True, False, False, True, True]], a[:, np.arange(6) % 4 == 1],
                                a.reshape([7, 3, 2])[np.arange(7) > 2, 1:]], [_x(7, 6)]),
})


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_call_forms_equal_the_whole_tensor(kind):
    bad = {name: m for name, (fn, xs) in CASES.items() if (m := _mismatches(fn, xs, kind))}
    assert bad == {}


@pytest.mark.parametrize("name", ["embedding max_norm", "embedding scale_grad_by_freq"])
@pytest.mark.parametrize("only", [0, 1])
def test_embedding_forms_with_one_operand_distributed(name, only):
    fn, xs = CASES[name]
    assert _mismatches(fn, xs, "S0", only=[only]) == [] and _mismatches(fn, xs, "S0,S0", only=[only]) == []


def test_embedding_layer_with_max_norm_renorms_its_distributed_weight():
    w = _x(10, 6) * 2
    emb = paddle.nn.Embedding(10, 6, max_norm=1.0)
    emb.weight.set_value(w)
    want = emb(paddle.to_tensor(IDS)).numpy()
    want_w = emb.weight.numpy()
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        layer = paddle.nn.Embedding(10, 6, max_norm=1.0)
        layer.weight.set_value(w)
        ap.shard_layer(layer, mesh, lambda n, sub, m: setattr(sub, "weight", ap.shard_tensor(
            sub.weight, m, [ap.Shard(0)])) if n == "" else None)
        got = layer(paddle.to_tensor(IDS)).full().numpy()
        got_w = layer.weight.full().numpy()
    assert np.allclose(got, want, atol=1e-6) and np.allclose(got_w, want_w, atol=1e-6)
    assert not np.allclose(got_w, w)                       # rows 0, 1, 2, 5, 9 were rescaled


def test_take_along_axis_names_shapes_that_do_not_broadcast():
    with ap.simulate(world_size=4):
        mesh = ap.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        a = ap.shard_tensor(paddle.to_tensor(_x(7, 6)), mesh, [ap.Shard(0)])
        with pytest.raises(ValueError, match=r"take_along_axis: indices of shape \[3, 2\] do not broadcast to arr "
                                             r"of shape \[7, 6\] at dim 0"):
            paddle.take_along_axis(a, paddle.zeros([3, 2], dtype="int64"), axis=1)


def test_strided_slice_names_a_zero_stride():
    with ap.simulate(world_size=4):
        a = ap.shard_tensor(paddle.to_tensor(_x(7, 6)), ap.ProcessMesh([0, 1, 2, 3]), [ap.Shard(0)])
        with pytest.raises(ValueError, match=r"strided_slice: strides must be non-zero, got \[0\]"):
            paddle.strided_slice(a, [0], [0], [3], [0])
