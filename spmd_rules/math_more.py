"""Reductions with NaN handling, order statistics, cumulative scans, differences, ``trace`` and the
products ``dot`` / ``mv`` / ``inner`` / ``tensordot`` / ``kron``.

* ``nansum``: a sharded reduced axis gives P(sum) (NaNs count as 0 on every shard, exactly as whole);
  ``count_nonzero`` likewise (int64 P(sum)). ``nanmean``, ``median``, ``nanmedian`` need the reduced axes
  whole (the count of non-NaN values, or the order, is global).
* ``cumprod`` / ``cummax`` / ``cummin`` / ``logcumsumexp``: the scanned axis whole, other dims keep their
  sharding; ``axis=None`` flattens (everything whole).
* ``diff``: the differenced axis whole (``prepend``/``append`` share the other dims); ``trace``: the two
  diagonal axes whole.
* Products are einsum rules: a sharded contracted axis gives Partial(sum). ``kron`` keeps everything whole.
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec, normalize_dtype

from spmd_rules.einsum import ALL, einsum_result, labels_result
from spmd_rules.reduction import _reduction, reduce_labels, sum_dtype
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec, keep_but, norm_axes, norm_axis, promote

_L = "abcdefghijklmnopqrstuvwxyz"


# ---- reductions ------------------------------------------------------------------------------------------------------
@register_spmd_rule("nansum")
def nansum(x, axis=None, dtype=None, keepdim=False, name=None):
    return _reduction("nansum", x, axis, keepdim, reduce="sum", linear=None, dtype=sum_dtype(x, dtype))[0]


@register_spmd_rule("count_nonzero")
def count_nonzero(x, axis=None, keepdim=False, name=None):
    return _reduction("count_nonzero", x, axis, keepdim, reduce="sum", linear=None, dtype="int64")[0]


def _whole(op, x, axis, keepdim, dtype=None, n_out=1):
    check_spec(op, "x", x)
    axes = norm_axes(op, axis, x.ndim)
    xl, ol, shape = reduce_labels(x, axes, keepdim, reducible=False)
    metas = [(shape, dtype or x.dtype)] + [(shape, "int64")] * (n_out - 1)
    return labels_result(op, [x], [xl], [ol] * n_out, metas, linear=None)


@register_spmd_rule("nanmean")
def nanmean(x, axis=None, keepdim=False, name=None):
    return _whole("nanmean", x, axis, keepdim)


def _median(op):
    def rule(x, axis=None, keepdim=False, mode="avg", name=None):
        if mode not in ("avg", "min"):
            raise ValueError(f"{op}: mode must be 'avg' or 'min', got {mode!r}")
        dtype = x.dtype if mode == "min" or x.dtype in ("float32", "float64") else "float32"
        n_out = 2 if (mode == "min" and axis is not None) else 1
        if axis is not None and not isinstance(axis, int):
            raise TypeError(f"{op}: axis must be an int or None, got {axis!r}")
        return _whole(op, x, axis, keepdim, dtype, n_out)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_median("median")
_median("nanmedian")


# ---- scans -----------------------------------------------------------------------------------------------------------
def _scan(op, x, axis, dtype, n_out=1):
    check_spec(op, "x", x)
    dt = normalize_dtype(dtype) if dtype is not None else x.dtype
    if axis is None:
        n = 1
        for s in x.shape:
            n *= s
        metas = [((n,), dt)] + [((n,), "int64")] * (n_out - 1)
        return labels_result(op, [x], [(None,) * x.ndim], [(None,)] * n_out, metas, linear=None)
    lab = keep_but(x, {norm_axis(op, axis, x.ndim)})
    metas = [(x.shape, dt)] + [(x.shape, "int64")] * (n_out - 1)
    return labels_result(op, [x], [lab], [lab] * n_out, metas, linear=None)


@register_spmd_rule("cumprod")
def cumprod(x, dim=None, *, dtype=None, out=None, name=None):
    return _scan("cumprod", x, dim, dtype)


@register_spmd_rule("logcumsumexp")
def logcumsumexp(x, axis=None, dtype=None, name=None):
    return _scan("logcumsumexp", x, axis, dtype)


def _cum_extreme(op):
    def rule(x, axis=None, dtype="int64", name=None):
        res = _scan(op, x, axis, None, n_out=2)
        idx = normalize_dtype(dtype)
        if idx not in ("int32", "int64"):
            raise ValueError(f"{op}: dtype of the indices must be int32 or int64, got {dtype!r}")
        outs = (res.outputs[0], DistSpec(res.outputs[1].mesh, res.outputs[1].placements, res.outputs[1].shape, idx))
        return type(res)(res.inputs, outs)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_cum_extreme("cummax")
_cum_extreme("cummin")


@register_spmd_rule("diff")
def diff(x, n=1, axis=-1, prepend=None, append=None, name=None, *, out=None):
    check_spec("diff", "x", x)
    a = norm_axis("diff", axis, x.ndim)
    extra = 0
    for nm, t in (("prepend", prepend), ("append", append)):
        if t is None:
            continue
        check_spec("diff", nm, t)
        if t.ndim != x.ndim or any(t.shape[d] != x.shape[d] for d in range(x.ndim) if d != a):
            raise ValueError(f"diff: {nm} of shape {list(t.shape)} must match x {list(x.shape)} except on axis {a}")
        extra += t.shape[a]
    length = x.shape[a] + extra
    if n < 0:
        raise ValueError(f"diff: n must be >= 0, got {n}")
    lab = keep_but(x, {a})
    shape = tuple(max(length - n, 0) if d == a else s for d, s in enumerate(x.shape))
    specs = [x] + [t for t in (prepend, append) if t is not None]
    return labels_result("diff", specs, [lab] * len(specs), [lab], [(shape, promote(*[s.dtype for s in specs]))],
                         linear="additive")


@register_spmd_rule("trace")
def trace(x, offset=0, axis1=0, axis2=1, name=None):
    check_spec("trace", "x", x)
    a1, a2 = norm_axis("trace", axis1, x.ndim), norm_axis("trace", axis2, x.ndim)
    if a1 == a2:
        raise ValueError(f"trace: axis1 and axis2 must differ, got {axis1} and {axis2}")
    rest = tuple(d for d in range(x.ndim) if d not in (a1, a2))
    shape = tuple(x.shape[d] for d in rest)
    return labels_result("trace", [x], [keep_but(x, {a1, a2})], [rest], [(shape, x.dtype)], linear=ALL)


# ---- products --------------------------------------------------------------------------------------------------------
@register_spmd_rule("dot")
def dot(x, y, name=None, *, out=None):
    check_spec("dot", "x", x)
    check_spec("dot", "y", y)
    if x.ndim not in (1, 2) or x.shape != y.shape:
        raise ValueError(f"dot: x and y must be 1-D or 2-D of the same shape, got {list(x.shape)} and {list(y.shape)}")
    return einsum_result("dot", "i,i->" if x.ndim == 1 else "bi,bi->b", [x, y])


@register_spmd_rule("mv")
def mv(x, vec, name=None):
    check_spec("mv", "x", x)
    check_spec("mv", "vec", vec)
    if x.ndim != 2 or vec.ndim != 1 or x.shape[1] != vec.shape[0]:
        raise ValueError(f"mv: x must be [M, N] and vec [N], got {list(x.shape)} and {list(vec.shape)}")
    return einsum_result("mv", "ij,j->i", [x, vec])


def _letters(n, start=0):
    return _L[start:start + n]


@register_spmd_rule("inner")
def inner(x, y, name=None):
    check_spec("inner", "x", x)
    check_spec("inner", "y", y)
    if x.ndim == 0 or y.ndim == 0:
        return get_multiply()(x, y)
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"inner: last dims must match, got {list(x.shape)} and {list(y.shape)}")
    xs, ys = _letters(x.ndim - 1), _letters(y.ndim - 1, 12)
    return einsum_result("inner", f"{xs}z,{ys}z->{xs}{ys}", [x, y])


def get_multiply():
    from spmd_rules.registry import get_spmd_rule

    return get_spmd_rule("multiply").fn


def _tensordot_axes(x, y, axes):
    if isinstance(axes, DistSpec):
        raise NotImplementedError("tensordot: axes given as a tensor is not supported; pass ints or lists")
    if isinstance(axes, int):
        if axes < 0 or axes > min(x.ndim, y.ndim):
            raise ValueError(f"tensordot: axes={axes} is out of range for {x.ndim}-D and {y.ndim}-D operands")
        return list(range(x.ndim - axes, x.ndim)), list(range(axes))
    axes = list(axes)
    if len(axes) == 1:
        axes = axes * 2
    if len(axes) != 2:
        raise ValueError(f"tensordot: axes must be an int or a pair of axis lists, got {axes!r}")
    ax, ay = ([a] if isinstance(a, int) else list(a) for a in axes)
    n = min(len(ax), len(ay))             # paddle pairs the common prefix
    return [norm_axis("tensordot", a, x.ndim) for a in ax[:n]], [norm_axis("tensordot", a, y.ndim) for a in ay[:n]]


@register_spmd_rule("tensordot")
def tensordot(x, y, axes=2, name=None):
    check_spec("tensordot", "x", x)
    check_spec("tensordot", "y", y)
    ax, ay = _tensordot_axes(x, y, axes)
    for a, b in zip(ax, ay):
        if x.shape[a] != y.shape[b]:
            raise ValueError(f"tensordot: contracted dims differ: x dim {a} = {x.shape[a]}, y dim {b} = {y.shape[b]}")
    xs = list(_letters(x.ndim))
    ys = list(_letters(y.ndim, 13))
    for a, b in zip(ax, ay):
        ys[b] = xs[a]
    out = [xs[d] for d in range(x.ndim) if d not in ax] + [ys[d] for d in range(y.ndim) if d not in ay]
    return einsum_result("tensordot", f"{''.join(xs)},{''.join(ys)}->{''.join(out)}", [x, y])


@register_spmd_rule("kron")
def kron(x, y, name=None):
    check_spec("kron", "x", x)
    check_spec("kron", "y", y)
    nd = max(x.ndim, y.ndim)
    xs = (1,) * (nd - x.ndim) + tuple(x.shape)
    ys = (1,) * (nd - y.ndim) + tuple(y.shape)
    shape = tuple(a * b for a, b in zip(xs, ys))
    return labels_result("kron", [x, y], [(None,) * x.ndim, (None,) * y.ndim], [(None,) * nd],
                         [(shape, promote(x.dtype, y.dtype))], linear=ALL)


# ---- value-indexed gathers: everything whole, the output replicated --------------------------------------------------
def _gathered(op, x, index):
    from spmd_rules.routing import replicate_all

    check_spec(op, "x", x)
    check_spec(op, "index", index)
    return replicate_all(op, [x, index])


@register_spmd_rule("gather_nd")
def gather_nd(x, index, name=None):
    return _gathered("gather_nd", x, index)


@register_spmd_rule("index_sample")
def index_sample(x, index):
    return _gathered("index_sample", x, index)


@register_spmd_rule("take")
def take(x, index, mode="raise", name=None):
    if mode not in ("raise", "wrap", "clip"):
        raise ValueError(f"take: mode must be 'raise', 'wrap' or 'clip', got {mode!r}")
    return _gathered("take", x, index)


@register_spmd_rule("cross")
def cross(x, y, axis=9, name=None):
    """The cross product along ``axis`` (paddle's default 9: the first dim of size 3): that dim R in both, every
    other dim shared by ``x`` and ``y`` (same shapes) keeps its sharding."""
    check_spec("cross", "x", x)
    check_spec("cross", "y", y)
    if list(x.shape) != list(y.shape):
        raise ValueError(f"cross: x and y must have the same shape, got {list(x.shape)} and {list(y.shape)}")
    a = next((d for d, n in enumerate(x.shape) if n == 3), None) if axis == 9 else norm_axis("cross", axis, x.ndim)
    if a is None or x.shape[a] != 3:
        raise ValueError(f"cross: the dim along axis={axis} must have size 3, got shape {list(x.shape)}")
    lab = tuple(None if d == a else d for d in range(x.ndim))
    return labels_result("cross", [x, y], [lab, lab], [lab], [(x.shape, promote(x.dtype, y.dtype))], linear=None)


@register_spmd_rule("renorm")
def renorm(x, p, axis, max_norm):
    """Each slice along ``axis`` rescaled to norm <= ``max_norm`` (its norm taken over every other dim): ``axis``
    keeps its sharding, every other dim R."""
    check_spec("renorm", "x", x)
    a = norm_axis("renorm", axis, x.ndim)
    lab = tuple(d if d == a else None for d in range(x.ndim))
    return labels_result("renorm", [x], [lab], [lab], [(x.shape, x.dtype)], linear=None)


@register_spmd_rule("trapezoid")
def trapezoid(y, x=None, dx=None, axis=-1, name=None):
    """The trapezoidal integral along ``axis`` (sample points ``x`` of ``y``'s shape or 1-D along the axis, or
    spacing ``dx``): ``axis`` R in ``y`` and ``x``, the other dims keep their sharding (shared with a full ``x``)."""
    check_spec("trapezoid", "y", y)
    a = norm_axis("trapezoid", axis, y.ndim)
    yl = tuple(None if d == a else d for d in range(y.ndim))
    out = yl[:a] + yl[a + 1:]
    shape = tuple(n for d, n in enumerate(y.shape) if d != a)
    if x is None:
        return labels_result("trapezoid", [y], [yl], [out], [(shape, y.dtype)], linear=None)
    check_spec("trapezoid", "x", x)
    xl = yl if list(x.shape) == list(y.shape) else (None,) * x.ndim
    return labels_result("trapezoid", [y, x], [yl, xl], [out], [(shape, promote(y.dtype, x.dtype))], linear=None)


@register_spmd_rule("cumulative_trapezoid")
def cumulative_trapezoid(y, x=None, dx=None, axis=-1, name=None):
    """The running trapezoidal integral along ``axis`` (one value fewer): laid out as ``trapezoid``, the axis kept
    (whole) in the output."""
    op = "cumulative_trapezoid"
    check_spec(op, "y", y)
    a = norm_axis(op, axis, y.ndim)
    yl = tuple(None if d == a else d for d in range(y.ndim))
    shape = tuple(n - 1 if d == a else n for d, n in enumerate(y.shape))
    if x is None:
        return labels_result(op, [y], [yl], [yl], [(shape, y.dtype)], linear=None)
    check_spec(op, "x", x)
    xl = yl if list(x.shape) == list(y.shape) else (None,) * x.ndim
    return labels_result(op, [y, x], [yl, xl], [yl], [(shape, promote(y.dtype, x.dtype))], linear=None)


@register_spmd_rule("vander")
def vander(x, n=None, increasing=False, name=None):
    """Powers of each element of the vector x in a row: x's dim keeps its sharding, the powers are whole."""
    check_spec("vander", "x", x)
    if x.ndim != 1:
        raise ValueError(f"vander: x must be 1-D, got shape {list(x.shape)}")
    n = x.shape[0] if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"vander: n must be a non-negative int, got {n!r}")
    return labels_result("vander", [x], [(0,)], [(0, None)], [((x.shape[0], n), x.dtype)], linear=None,
                         local_op="vander")


@register_spmd_rule("cdist")
def cdist(x, y, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary", name=None):
    """Pairwise p-norm distances ``[..., P, M] x [..., R, M] -> [..., P, R]``: the feature dim M R, the rows P and
    R keep their sharding, batch dims of equal size shared."""
    check_spec("cdist", "x", x)
    check_spec("cdist", "y", y)
    if x.ndim < 2 or y.ndim != x.ndim or x.shape[-1] != y.shape[-1]:
        raise ValueError(f"cdist: expects [..., P, M] and [..., R, M] of one rank, got {list(x.shape)} and "
                         f"{list(y.shape)}")
    nb = x.ndim - 2
    batch = tuple(f"b{d}" if x.shape[d] == y.shape[d] else None for d in range(nb))
    xl, yl = batch + ("p", None), batch + ("r", None)
    shape = tuple(max(x.shape[d], y.shape[d]) for d in range(nb)) + (x.shape[-2], y.shape[-2])
    return labels_result("cdist", [x, y], [xl, yl], [batch + ("p", "r")], [(shape, promote(x.dtype, y.dtype))],
                         linear=None, local_op="cdist")
