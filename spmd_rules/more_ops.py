"""More of paddle's everyday ops: unary elementwise functions, reductions that need their axis whole, and
axis-wise layout ops (flip, roll, tile, unbind, diagonal, repeat_interleave, expand_as), plus ``mm``,
``mul``, ``outer`` and ``swiglu``.

Unary functions keep any sharding (a Partial input is reduced first: none of them is linear). ``amax`` /
``amin`` reduce a sharded axis with Partial(max/min); ``prod``, ``any``, ``all``, ``logsumexp``, ``norm``,
``var`` and ``std`` need their reduced axes whole (R). The layout ops need whole the axes they reorder,
repeat or take apart; other dims keep their sharding.
"""
from __future__ import annotations

from autoparallel.core.placement import Replicate
from autoparallel.core.spec import DistSpec

from spmd_rules.einsum import ALL, einsum_result, labels_result
from spmd_rules.elementwise import _unary, broadcast_labels, elementwise_result
from spmd_rules.matmul import matmul
from spmd_rules.reduction import _reduction, reduce_labels
from spmd_rules.registry import get_spmd_rule, register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import broadcast_shapes, check_spec, int_list, keep_but, norm_axes, norm_axis, promote

_TO_FLOAT = ("reciprocal", "log2", "log10", "expm1", "relu6", "hardswish", "mish", "softsign", "tanhshrink",
             "log_sigmoid", "tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh")
_SAME = ("ceil",)
_BOOL = ("isnan", "isinf", "isfinite")


def _unary_any(op, dtype=None, to_float=False):
    def rule(x, name=None):
        return _unary(op, x, to_float=to_float, dtype=dtype)

    rule.__name__ = op
    register_spmd_rule(op, rule)


for _op in _TO_FLOAT:
    _unary_any(_op, to_float=True)
for _op in _SAME:
    _unary_any(_op)
for _op in _BOOL:
    _unary_any(_op, dtype="bool")


# unary functions with parameters: the rule mirrors paddle's parameter names
@register_spmd_rule("softplus")
def softplus(x, beta=1, threshold=20, name=None):
    return _unary("softplus", x, to_float=True)


@register_spmd_rule("elu")
def elu(x, alpha=1.0, name=None):
    return _unary("elu", x, to_float=True)


@register_spmd_rule("selu")
def selu(x, scale=1.0507009873554805, alpha=1.6732632423543772, name=None):
    return _unary("selu", x, to_float=True)


@register_spmd_rule("hardsigmoid")
def hardsigmoid(x, slope=0.1666667, offset=0.5, name=None):
    return _unary("hardsigmoid", x, to_float=True)


@register_spmd_rule("round")
def round_(x, decimals=0, name=None):
    return _unary("round", x)


@register_spmd_rule("trunc")
def trunc(input, name=None):
    return _unary("trunc", input)


@register_spmd_rule("nan_to_num")
def nan_to_num(x, nan=0.0, posinf=None, neginf=None, name=None):
    return _unary("nan_to_num", x)


def _extreme(op, reduce):
    def rule(x, axis=None, keepdim=False, name=None):
        return _reduction(op, x, axis, keepdim, reduce=reduce, linear=None)[0]

    rule.__name__ = op
    register_spmd_rule(op, rule)


_extreme("amax", "max")
_extreme("amin", "min")


def _whole_axes(op, x, axis, keepdim, dtype=None):
    """A reduction over ``axis`` that needs those axes whole."""
    check_spec(op, "x", x)
    axes = norm_axes(op, axis, x.ndim)
    xl, ol, shape = reduce_labels(x, axes, keepdim, reducible=False)
    return labels_result(op, [x], [xl], [ol], [(shape, dtype or x.dtype)], linear=None)


@register_spmd_rule("prod")
def prod(x, axis=None, keepdim=False, dtype=None, out=None, name=None):
    from autoparallel.core.spec import normalize_dtype

    return _whole_axes("prod", x, axis, keepdim, normalize_dtype(dtype) if dtype is not None else None)


for _op, _dt in (("any", "bool"), ("all", "bool"), ("logsumexp", None)):
    def _rule(x, axis=None, keepdim=False, name=None, __op=_op, __dt=_dt):
        return _whole_axes(__op, x, axis, keepdim, __dt)

    _rule.__name__ = _op
    register_spmd_rule(_op, _rule)


@register_spmd_rule("norm")
def norm(x, p=None, axis=None, keepdim=False, out=None, dtype=None, name=None):
    return _whole_axes("norm", x, axis, keepdim)


@register_spmd_rule("var")
def var(x, axis=None, unbiased=None, keepdim=False, name=None, *, correction=1):
    return _whole_axes("var", x, axis, keepdim)


@register_spmd_rule("std")
def std(x, axis=None, unbiased=True, keepdim=False, name=None, *, correction=1):
    return _whole_axes("std", x, axis, keepdim)


@register_spmd_rule("mm")
def mm(input, mat2, name=None):
    return matmul(input, mat2)


@register_spmd_rule("mul")
def mul(x, y, name=None):
    return get_spmd_rule("multiply").fn(x, y)


@register_spmd_rule("outer")
def outer(x, y, name=None):
    return einsum_result("outer", "i,j->ij", [x, y])


@register_spmd_rule("swiglu")
def swiglu(x, y=None, name=None):
    check_spec("swiglu", "x", x)
    if y is not None:
        return elementwise_result("swiglu", [x, y])
    lab = tuple(range(x.ndim - 1)) + (None,)
    shape = tuple(x.shape[:-1]) + (x.shape[-1] // 2,)
    return labels_result("swiglu", [x], [lab], [lab], [(shape, x.dtype)], linear=None)


@register_spmd_rule("flip")
def flip(x, axis, name=None):
    check_spec("flip", "x", x)
    lab = keep_but(x, norm_axes("flip", axis, x.ndim))
    return labels_result("flip", [x], [lab], [lab], [(x.shape, x.dtype)], linear=ALL)


@register_spmd_rule("roll")
def roll(x, shifts, axis=None, name=None):
    check_spec("roll", "x", x)
    lab = (None,) * x.ndim if axis is None else keep_but(x, norm_axes("roll", axis, x.ndim))
    return labels_result("roll", [x], [lab], [lab], [(x.shape, x.dtype)], linear=ALL)


@register_spmd_rule("tile")
def tile(x, repeat_times, name=None):
    check_spec("tile", "x", x)
    reps = int_list("tile", "repeat_times", repeat_times)
    nd = max(x.ndim, len(reps))
    reps = [1] * (nd - len(reps)) + reps
    off = nd - x.ndim
    xl = tuple(d + off if reps[d + off] == 1 else None for d in range(x.ndim))
    ol = tuple(d if d >= off and reps[d] == 1 else None for d in range(nd))
    shape = tuple(([1] * off + list(x.shape))[d] * reps[d] for d in range(nd))
    return labels_result("tile", [x], [xl], [ol], [(shape, x.dtype)], linear=ALL)


@register_spmd_rule("unbind")
def unbind(input, axis=0):
    x = input
    check_spec("unbind", "input", x)
    a = norm_axis("unbind", axis, x.ndim)
    xl = keep_but(x, {a})
    ol = tuple(d for d in range(x.ndim) if d != a)
    shape = tuple(s for d, s in enumerate(x.shape) if d != a)
    return labels_result("unbind", [x], [xl], [ol] * x.shape[a], [(shape, x.dtype)] * x.shape[a], linear=ALL)


@register_spmd_rule("diagonal")
def diagonal(x, offset=0, axis1=0, axis2=1, name=None):
    check_spec("diagonal", "x", x)
    a1, a2 = norm_axis("diagonal", axis1, x.ndim), norm_axis("diagonal", axis2, x.ndim)
    rest = [d for d in range(x.ndim) if d not in (a1, a2)]
    n1, n2 = x.shape[a1], x.shape[a2]
    n = max(0, min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2))
    xl = keep_but(x, {a1, a2})
    shape = tuple(x.shape[d] for d in rest) + (n,)
    return labels_result("diagonal", [x], [xl], [tuple(rest) + (None,)], [(shape, x.dtype)], linear=ALL)


@register_spmd_rule("repeat_interleave")
def repeat_interleave(x, repeats, axis=None, name=None, *, output_size=None):
    check_spec("repeat_interleave", "x", x)
    if isinstance(repeats, DistSpec) or axis is None:
        from spmd_rules.routing import replicate_all

        return replicate_all("repeat_interleave", [x, repeats])
    a = norm_axis("repeat_interleave", axis, x.ndim)
    lab = keep_but(x, {a})
    shape = tuple(s * int(repeats) if d == a else s for d, s in enumerate(x.shape))
    return labels_result("repeat_interleave", [x], [lab], [lab], [(shape, x.dtype)], linear=ALL)


@register_spmd_rule("expand_as")
def expand_as(x, y, name=None):
    check_spec("expand_as", "x", x)
    check_spec("expand_as", "y", y)
    out_shape = broadcast_shapes("expand_as", x.shape, y.shape)
    if tuple(out_shape) != tuple(y.shape):
        raise ValueError(f"expand_as: x of shape {list(x.shape)} cannot expand to {list(y.shape)}")
    (xl,), ol = broadcast_labels([x.shape], out_shape)
    return labels_result("expand_as", [x, y], [xl, ol], [ol], [(out_shape, x.dtype)], linear={0})


def _all_close(op):
    def rule(x, y, rtol=1e-05, atol=1e-08, equal_nan=False, name=None):
        specs = [s for s in (x, y) if isinstance(s, DistSpec)]
        rep = [s.with_placements(tuple(Replicate() for _ in s.placements)) for s in specs]
        out = DistSpec(specs[0].mesh, tuple(Replicate() for _ in specs[0].placements), (), "bool")
        promote(*[s.dtype for s in specs])
        return SpmdResult(rep, (out,))

    rule.__name__ = op
    register_spmd_rule(op, rule)


_all_close("equal_all")
_all_close("allclose")


@register_spmd_rule("masked_fill")
def masked_fill(x, mask, value, name=None):
    check_spec("masked_fill", "x", x)
    return elementwise_result("masked_fill", [x, mask, value], out_dtype=x.dtype)
