"""Composite ops (see composites.py) paddle writes in python over ops that have rules: ``scatter_add`` /
``scatter_add_`` / ``scatter_reduce`` (``put_along_axis``), ``scatter_nd`` (``scatter_nd_add`` into zeros),
``block_diag`` (zeros and ``concat``), ``meshgrid`` and ``cartesian_prod`` (reshape, ``expand``, ``stack``), and
the in-place forms ``addmm_`` / ``baddbmm_`` / ``ldexp_`` of composites (the result written with ``x[...] = out``).
They mirror paddle 3.3's own bodies (``paddle/tensor/manipulation.py``, ``creation.py``), with each op routed."""
from __future__ import annotations

import numbers

from spmd_rules.composites import _p, gshape

_REDUCE = {"sum": "add", "prod": "multiply", "mean": "mean", "amin": "amin", "amax": "amax"}   # paddle's mapping


def _dim(op, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"{op}: dim must be a python int, got {type(dim).__name__} {dim!r}")
    return int(dim)


def scatter_add(input, dim, index, src):
    return _p().put_along_axis(input, index, src, _dim("scatter_add", dim), "add", include_self=True,
                               broadcast=False)


def scatter_add_(input, dim, index, src):
    return input.put_along_axis_(index, src, _dim("scatter_add_", dim), "add", include_self=True, broadcast=False)


def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    if reduce not in _REDUCE:
        raise ValueError(f"scatter_reduce: reduce must be one of {sorted(_REDUCE)}, got {reduce!r}")
    return _p().put_along_axis(input, index, src, _dim("scatter_reduce", dim), _REDUCE[reduce],
                               include_self=include_self, broadcast=False)


def scatter_nd(index, updates, shape, name=None):
    paddle = _p()
    return paddle.scatter_nd_add(paddle.zeros(shape, updates.dtype), index, updates)


def _as_2d(op, t):
    """paddle's block_diag: a 0-d tensor is 1 x 1, a vector one row; more dims are refused."""
    n = len(gshape(t))
    if n == 0:
        return t.reshape([1, 1])
    if n == 1:
        return t.reshape([1, -1])
    if n == 2:
        return t
    raise ValueError(f"{op}: every input must have 0, 1 or 2 dims, got {n}")


def block_diag(inputs, name=None):
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise TypeError(f"block_diag: inputs must be a non-empty list of tensors, got {type(inputs).__name__}")
    paddle = _p()
    mats = [_as_2d("block_diag", t) for t in inputs]
    rows = [gshape(m)[0] for m in mats]
    cols = []
    for i, m in enumerate(mats):
        parts = [m if j == i else paddle.zeros([rows[j], gshape(m)[1]], dtype=m.dtype) for j in range(len(mats))]
        cols.append(paddle.concat(parts, axis=0))
    return paddle.concat(cols, axis=1)


def meshgrid(*args, **kwargs):
    """paddle.meshgrid (``ij`` indexing): input k, a vector, varies along output dim k."""
    tensors = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    sizes = []
    for i, t in enumerate(tensors):
        s = gshape(t)
        if len(s) > 1:
            raise ValueError(f"meshgrid: input {i} must have 0 or 1 dims, got shape {list(s)}")
        sizes.append(s[0] if s else 1)
    out = []
    for k, t in enumerate(tensors):
        shape = [-1 if j == k else 1 for j in range(len(tensors))]
        out.append(t.reshape(shape).expand(sizes))
    return out


def cartesian_prod(x, name=None):
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"cartesian_prod: x must be a non-empty list of tensors, got {type(x).__name__}")
    for t in x:
        if len(gshape(t)) != 1:
            raise ValueError(f"cartesian_prod: expects 1-D vectors, got shape {list(gshape(t))}")
    if len(x) == 1:
        return x[0]
    paddle = _p()
    return paddle.stack(meshgrid(list(x)), axis=-1).reshape([-1, len(x)])


def _write_back(op, target, out):
    """The in-place form of a composite: ``target[...] = out`` (routed: paddle's refusal of a leaf that requires a
    gradient holds, the gradient flows as through paddle's in-place op), then ``target``."""
    if list(gshape(out)) != list(gshape(target)):
        raise ValueError(f"{op}: the result's shape {list(gshape(out))} differs from the input's "
                         f"{list(gshape(target))}, so it cannot be written in place")
    target[...] = out
    return target


def addmm_(input, x, y, beta=1.0, alpha=1.0, name=None):
    from spmd_rules.composites_shape import addmm

    return _write_back("addmm_", input, addmm(input, x, y, beta, alpha))


def baddbmm_(input, x, y, beta=1.0, alpha=1.0, name=None):
    from spmd_rules.composites_shape import baddbmm

    return _write_back("baddbmm_", input, baddbmm(input, x, y, beta, alpha))


def ldexp_(x, y, name=None):
    from spmd_rules.composites_more import ldexp

    return _write_back("ldexp_", x, ldexp(x, y))


COMPOSITES: dict = {f"paddle.{n}": globals()[n] for n in ("scatter_add", "scatter_add_", "scatter_reduce",
                                                          "scatter_nd", "block_diag", "meshgrid", "cartesian_prod",
                                                          "addmm_", "baddbmm_", "ldexp_")}
