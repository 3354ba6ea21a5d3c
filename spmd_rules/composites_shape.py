"""Composite ops (see composites.py): stacking and splitting helpers, views, slices, ``addmm`` / ``baddbmm``,
``linalg.vector_norm`` / ``matrix_norm`` / ``multi_dot`` — decomposed into routed ops (concat, reshape,
transpose, getitem, unbind, broadcast_to, matmul, sums and maxima)."""
from __future__ import annotations

import math
import numbers

from spmd_rules.composites import _p, _p_norm, gshape


def _axis(op, axis, nd):
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise NotImplementedError(f"{op}: axis must be a python int on distributed tensors, got "
                                  f"{type(axis).__name__}")
    if not -nd <= axis < max(nd, 1):
        raise ValueError(f"{op}: axis {axis} is out of range for a {nd}-D tensor")
    return int(axis) % max(nd, 1)


def _int_tensor(v) -> bool:
    """An integer tensor standing for numbers (paddle reads a start / length / list of them from its value)."""
    return _p().is_tensor(v) and "int" in str(v.dtype)


def _int(op, name, v):
    if _int_tensor(v) and math.prod(gshape(v)) == 1:
        v = int(v.item())
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise NotImplementedError(f"{op}: {name} must be a python int on distributed tensors, got "
                                  f"{type(v).__name__} {v!r}")
    return int(v)


# ---- at least n dims, stacks -----------------------------------------------------------------------------------------
def _at_least(t, n):
    s = gshape(t)
    if len(s) >= n:
        return t
    if n == 3 and len(s) == 1:
        return t.reshape([1, s[0], 1])
    if n == 3 and len(s) == 2:
        return t.reshape(s + [1])
    return t.reshape([1] * (n - len(s)) + s)


def _atleast(n):
    def fn(*inputs, name=None):
        outs = [_at_least(t, n) for t in inputs]
        return outs[0] if len(outs) == 1 else outs

    fn.__name__ = f"atleast_{n}d"
    return fn


atleast_1d, atleast_2d, atleast_3d = _atleast(1), _atleast(2), _atleast(3)


def _seq(op, x):
    if not isinstance(x, (list, tuple)) or not x:
        raise TypeError(f"{op}: x must be a non-empty list of tensors, got {type(x).__name__}")
    return list(x)


def hstack(x, name=None):
    x = [_at_least(t, 1) for t in _seq("hstack", x)]
    return _p().concat(x, axis=0 if len(gshape(x[0])) == 1 else 1)


def vstack(x, name=None):
    return _p().concat([_at_least(t, 2) for t in _seq("vstack", x)], axis=0)


row_stack = vstack


def dstack(x, name=None):
    return _p().concat([_at_least(t, 3) for t in _seq("dstack", x)], axis=2)


def column_stack(x, name=None):
    cols = []
    for t in _seq("column_stack", x):
        s = gshape(t)
        cols.append(t.reshape([max(1, math.prod(s)), 1]) if len(s) <= 1 else t)
    return _p().concat(cols, axis=1)


# ---- views -----------------------------------------------------------------------------------------------------------
def unstack(x, axis=0, num=None):
    s = gshape(x)
    a = _axis("unstack", axis, len(s))
    if num is not None and num != s[a]:
        raise ValueError(f"unstack: num={num} does not match the size {s[a]} of axis {axis}")
    return _p().unbind(x, axis=a)


def unflatten(x, axis, shape, name=None):
    s = gshape(x)
    a = _axis("unflatten", axis, len(s))
    if not isinstance(shape, (list, tuple)) or not shape:
        raise NotImplementedError(f"unflatten: shape must be a non-empty list/tuple of python ints on distributed "
                                  f"tensors, got {shape!r}")
    new = [_int("unflatten", "shape", v) for v in shape]
    if -1 in new:
        known = math.prod(v for v in new if v != -1)
        new[new.index(-1)] = s[a] // known if known else 0
    if math.prod(new) != s[a]:
        raise ValueError(f"unflatten: shape {list(shape)} does not multiply to the size {s[a]} of axis {axis}")
    return x.reshape(s[:a] + new + s[a + 1:])


def moveaxis(x, source, destination, name=None):
    nd = len(gshape(x))
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    if len(src) != len(dst):
        raise ValueError(f"moveaxis: source {source} and destination {destination} differ in length")
    src = [_axis("moveaxis", a, nd) for a in src]
    dst = [_axis("moveaxis", a, nd) for a in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ValueError(f"moveaxis: repeated axes in source {source} or destination {destination}")
    rest = [d for d in range(nd) if d not in src]
    perm = [None] * nd
    for s, d in zip(src, dst):
        perm[d] = s
    it = iter(rest)
    perm = [p if p is not None else next(it) for p in perm]
    return _p().transpose(x, perm)


def ravel(input):
    return input.reshape([-1])


def view_as(x, other, name=None):
    return x.reshape(gshape(other))


def matrix_transpose(x, name=None):
    nd = len(gshape(x))
    if nd < 2:
        raise ValueError(f"matrix_transpose: x must have at least 2 dims, got {gshape(x)}")
    return _p().transpose(x, list(range(nd - 2)) + [nd - 1, nd - 2])


# ---- slices and splits -----------------------------------------------------------------------------------------------
def _take(x, axis, start, stop, step=1):
    return x[(slice(None),) * axis + (slice(start, stop, step),)]


def narrow(input, dim, start, length):
    s = gshape(input)
    a = _axis("narrow", dim, len(s))
    start, length = _int("narrow", "start", start), _int("narrow", "length", length)
    if start < 0:
        start += s[a]
    if not 0 <= start <= s[a] or length < 0 or start + length > s[a]:
        raise ValueError(f"narrow: start {start} and length {length} are out of range for dim {dim} of size {s[a]}")
    return _take(input, a, start, start + length)


def _bounds(n, num_or_indices, op):
    if isinstance(num_or_indices, numbers.Integral) and not isinstance(num_or_indices, bool):
        k = int(num_or_indices)
        if k <= 0:
            raise ValueError(f"{op}: the number of sections must be positive, got {k}")
        q, r = divmod(n, k)
        sizes = [q + 1] * r + [q] * (k - r)
        cuts = [sum(sizes[:i]) for i in range(k + 1)]
        return list(zip(cuts[:-1], cuts[1:]))
    if not isinstance(num_or_indices, (list, tuple)):
        raise NotImplementedError(f"{op}: num_or_indices must be an int or a list of python ints on distributed "
                                  f"tensors, got {type(num_or_indices).__name__}")
    idx = [_int(op, "index", i) for i in num_or_indices]
    idx = [min(max(i + n if i < 0 else i, 0), n) for i in idx]
    cuts = [0] + idx + [n]
    return [(a, max(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]


def tensor_split(x, num_or_indices, axis=0, name=None):
    s = gshape(x)
    a = _axis("tensor_split", axis, len(s))
    return [_take(x, a, lo, hi) for lo, hi in _bounds(s[a], num_or_indices, "tensor_split")]


def _split_along(op, min_nd, axis_of):
    def fn(x, num_or_indices, name=None):
        nd = len(gshape(x))
        if nd < min_nd:
            raise ValueError(f"{op}: x must have at least {min_nd} dims, got {gshape(x)}")
        a = axis_of(nd)
        if isinstance(num_or_indices, numbers.Integral) and gshape(x)[a] % int(num_or_indices):
            raise ValueError(f"{op}: dim {a} of size {gshape(x)[a]} does not split into {num_or_indices} equal parts")
        return tensor_split(x, num_or_indices, axis=a)

    fn.__name__ = op
    return fn


hsplit = _split_along("hsplit", 1, lambda nd: 1 if nd > 1 else 0)
vsplit = _split_along("vsplit", 2, lambda nd: 0)
dsplit = _split_along("dsplit", 3, lambda nd: 2)


def _ints(op, name, v):
    if _int_tensor(v) and len(gshape(v)) == 1:
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise NotImplementedError(f"{op}: {name} must be a list of python ints on distributed tensors, got "
                                  f"{type(v).__name__}")
    return [_int(op, name, i) for i in v]


def strided_slice(x, axes, starts, ends, strides, name=None):
    s = gshape(x)
    axes, starts, ends, strides = (_ints("strided_slice", n, v) for n, v in
                                   (("axes", axes), ("starts", starts), ("ends", ends), ("strides", strides)))
    if not len(axes) == len(starts) == len(ends) == len(strides):
        raise ValueError("strided_slice: axes, starts, ends and strides must have the same length")
    index = [slice(None)] * len(s)
    for a, b, e, st in zip(axes, starts, ends, strides):
        if st == 0:
            raise ValueError(f"strided_slice: strides must be non-zero, got {strides}")
        index[_axis("strided_slice", a, len(s))] = slice(b, e, st)
    return x[tuple(index)]


def slice_op(input, axes, starts, ends):
    n = len(_ints("slice", "axes", axes))
    return strided_slice(input, axes, starts, ends, [1] * n)


def broadcast_tensors(input, name=None):
    paddle = _p()
    shapes = [gshape(t) for t in _seq("broadcast_tensors", input)]
    out = paddle.broadcast_shape(shapes[0], shapes[0])
    for s in shapes[1:]:
        out = paddle.broadcast_shape(out, s)
    return [paddle.broadcast_to(t, out) for t in input]


def empty_like(x, dtype=None, name=None, *, device=None, requires_grad=False, pin_memory=False):
    if device is not None or pin_memory:
        raise NotImplementedError("empty_like: device= and pin_memory= are not supported on distributed tensors")
    out = _p().zeros_like(x, dtype=dtype)
    if requires_grad:
        out.stop_gradient = False
    return out


# ---- products and norms ----------------------------------------------------------------------------------------------
def addmm(input, x, y, beta=1.0, alpha=1.0, name=None):
    if len(gshape(x)) != 2 or len(gshape(y)) != 2:
        raise ValueError(f"addmm: x and y must be 2-D, got {gshape(x)} and {gshape(y)}")
    return _affine(input, _p().matmul(x, y), beta, alpha)


def baddbmm(input, x, y, beta=1.0, alpha=1.0, name=None):
    if len(gshape(x)) != 3 or len(gshape(y)) != 3:
        raise ValueError(f"baddbmm: x and y must be 3-D, got {gshape(x)} and {gshape(y)}")
    return _affine(input, _p().bmm(x, y), beta, alpha)


def _affine(input, prod, beta, alpha):
    a = prod if alpha == 1.0 else prod * alpha
    b = input if beta == 1.0 else input * beta
    return b + a


def vector_norm(x, p=2.0, axis=None, keepdim=False, name=None, *, dtype=None, out=None):
    if out is not None:
        raise NotImplementedError("vector_norm: out= is not supported on distributed tensors; use the result")
    if dtype is not None:
        x = _p().cast(x, dtype)
    if isinstance(axis, (list, tuple)) and len(axis) == 0:
        axis = None
    return _p_norm(x, p, axis, keepdim)


def matrix_norm(x, p="fro", axis=[-2, -1], keepdim=False, name=None):     # noqa: B006  (paddle's default)
    paddle = _p()
    nd = len(gshape(x))
    if not isinstance(axis, (list, tuple)) or len(axis) != 2:
        raise ValueError(f"matrix_norm: axis must be two ints, got {axis!r}")
    a0, a1 = (_axis("matrix_norm", a, nd) for a in axis)
    if p == "fro":
        return paddle.sqrt(paddle.sum(x * x, axis=[a0, a1], keepdim=keepdim))
    if p in (1, -1, math.inf, -math.inf):
        inner, outer = (a0, a1) if p in (1, -1) else (a1, a0)
        ext = paddle.amax if p > 0 else paddle.amin
        out = ext(paddle.sum(paddle.abs(x), axis=inner, keepdim=True), axis=outer, keepdim=True)
        return out if keepdim else out.squeeze([a0, a1])
    raise NotImplementedError(f"matrix_norm: p={p!r} needs singular values (svd), which has no spmd rule; "
                              f"supported: 'fro', 1, -1, inf, -inf")


def multi_dot(x, name=None):
    x = _seq("multi_dot", x)
    if len(x) < 2:
        raise ValueError(f"multi_dot: expects at least 2 tensors, got {len(x)}")
    out = x[0]
    for t in x[1:]:
        out = _p().matmul(out, t)
    return out


# ---- dtype predicates: the answer depends on the dtype only, which every shard shares ------------------------------------
def _dtype_predicate(name):
    def predicate(x, name=None):
        return getattr(_p(), pred)(_p().empty([0], dtype=x.dtype))

    pred = name
    predicate.__name__ = name
    return predicate


is_floating_point, is_complex, is_integer = (_dtype_predicate(n) for n in ("is_floating_point", "is_complex",
                                                                           "is_integer"))


_P_NAMES = ("atleast_1d", "atleast_2d", "atleast_3d", "hstack", "vstack", "row_stack", "dstack", "column_stack",
            "unstack", "unflatten", "moveaxis", "ravel", "view_as", "matrix_transpose", "narrow", "tensor_split",
            "hsplit", "vsplit", "dsplit", "strided_slice", "broadcast_tensors", "empty_like", "addmm",
            "baddbmm", "is_floating_point", "is_complex", "is_integer")
COMPOSITES: dict = {f"paddle.{n}": globals()[n] for n in _P_NAMES}
COMPOSITES["paddle.slice"] = slice_op
COMPOSITES.update({f"paddle.linalg.{n}": globals()[n] for n in ("vector_norm", "matrix_norm", "multi_dot",
                                                                  "matrix_transpose")})
