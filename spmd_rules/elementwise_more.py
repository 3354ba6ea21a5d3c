"""More elementwise math: unary functions with parameters, binary functions of two tensors (broadcasting),
``lerp`` (ternary), ``add_n`` (n-ary) and the comparison spellings ``gt`` / ``greater`` / ``logical_xor`` /
``isclose``.

All keep any sharding of a broadcast-matching dim. Partial inputs: only the linear ones keep P(sum) —
``negative``, ``positive`` (ALL), ``true_divide`` (numerator), ``add_n`` (every operand the same linear
Partial, like add); every other function here is nonlinear, so a Partial input is reduced first.
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec

from spmd_rules.elementwise import _binary_body, _unary, _unary_reverse, elementwise_result, elementwise_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec, is_float, promote

# ---- unary -----------------------------------------------------------------------------------------------------------
_TO_FLOAT = ("sinc", "i0", "lgamma", "digamma", "erfinv", "deg2rad", "rad2deg", "swish")
_SAME = ("frac", "sgn")


def _register_unary(op, *, to_float=False, linear=False, dtype=None):
    def rule(x, name=None):
        return _unary(op, x, linear=linear, to_float=to_float, dtype=dtype)

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=_unary_reverse(op, linear))


for _op in _TO_FLOAT:
    _register_unary(_op, to_float=True)
for _op in _SAME:
    _register_unary(_op)
_register_unary("signbit", dtype="bool")
_register_unary("negative", linear=True)
_register_unary("positive", linear=True)


@register_spmd_rule("logit", reverse=_unary_reverse("logit"))
def logit(x, eps=None, name=None):
    return _unary("logit", x, to_float=True)


@register_spmd_rule("stanh", reverse=_unary_reverse("stanh"))
def stanh(x, scale_a=0.67, scale_b=1.7159, name=None):
    return _unary("stanh", x, to_float=True)


@register_spmd_rule("hardtanh", reverse=_unary_reverse("hardtanh"))
def hardtanh(x, min=-1.0, max=1.0, name=None):
    return _unary("hardtanh", x)


@register_spmd_rule("celu", reverse=_unary_reverse("celu"))
def celu(x, alpha=1.0, name=None):
    if alpha == 0:
        raise ValueError("celu: alpha must not be 0 (paddle divides by it), got 0")
    return _unary("celu", x, to_float=True)


def _threshold_unary(op):
    def rule(x, threshold=0.5, name=None):
        return _unary(op, x)

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=_unary_reverse(op))


_threshold_unary("softshrink")
_threshold_unary("hardshrink")


@register_spmd_rule("thresholded_relu", reverse=_unary_reverse("thresholded_relu"))
def thresholded_relu(x, threshold=1.0, value=0.0, name=None):
    return _unary("thresholded_relu", x)


# ---- binary ----------------------------------------------------------------------------------------------------------
def _register_binary(op, *, compare=False, to_float=False):
    def rule(x, y, name=None):
        if to_float:
            specs = [a for a in (x, y) if isinstance(a, DistSpec)]
            dtype = promote(*[s.dtype for s in specs])
            return elementwise_result(op, [x, y], out_dtype=dtype if is_float(dtype) else "float32")
        return _binary_body(op, x, y, compare)

    def rev(outputs, x, y, name=None, **kw):
        return elementwise_reverse(op, outputs, [x, y])

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=rev)


for _op in ("fmax", "fmin", "copysign", "heaviside"):
    _register_binary(_op)
for _op in ("atan2", "hypot", "logaddexp"):
    _register_binary(_op, to_float=True)


def _gamma_inc(op):
    """``gammainc`` / ``gammaincc``: elementwise over two tensors of one shape. paddle 3.3's kernel broadcasts
    wrongly (``gammainc(a [5, 6], b [6])`` differs from ``gammainc(a, b.expand([5, 6]))``), so differing shapes
    are refused rather than computed per shard."""
    def rule(x, y, name=None):
        check_spec(op, "x", x)
        check_spec(op, "y", y)
        if tuple(x.shape) != tuple(y.shape):
            raise NotImplementedError(f"{op}: x and y must have the same shape on distributed tensors (paddle's kernel "
                                      f"broadcasts wrongly), got {list(x.shape)} and {list(y.shape)}; expand them "
                                      f"first")
        dtype = promote(x.dtype, y.dtype)
        return elementwise_result(op, [x, y], out_dtype=dtype if is_float(dtype) else "float32")

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=lambda outputs, x, y, name=None: elementwise_reverse(op, outputs, [x, y]))


_gamma_inc("gammainc")
_gamma_inc("gammaincc")
for _op in ("gt", "logical_xor"):
    _register_binary(_op, compare=True)


@register_spmd_rule("true_divide")
def true_divide(input, other):
    return _binary_body("divide", input, other, False)


@register_spmd_rule("isclose")
def isclose(x, y, rtol=1e-05, atol=1e-08, equal_nan=False, name=None):
    check_spec("isclose", "x", x)
    check_spec("isclose", "y", y)
    return elementwise_result("isclose", [x, y], out_dtype="bool")


@register_spmd_rule("lerp")
def lerp(x, y, weight, name=None):
    """x + weight * (y - x); ``weight`` a python number or a broadcasting tensor."""
    check_spec("lerp", "x", x)
    check_spec("lerp", "y", y)
    return elementwise_result("lerp", [x, y, weight])


@register_spmd_rule("add_n")
def add_n(inputs, name=None):
    """The sum of a list of same-shaped tensors: linear like add (equal linear Partials pass)."""
    specs = [inputs] if isinstance(inputs, DistSpec) else list(inputs)
    if not specs or not all(isinstance(s, DistSpec) for s in specs):
        raise TypeError(f"add_n: inputs must be a tensor or a non-empty list of tensors, got {inputs!r}")
    shapes = {tuple(s.shape) for s in specs}
    if len(shapes) != 1:
        raise ValueError(f"add_n: every input must have the same shape, got {sorted(map(list, shapes))}")
    return elementwise_result("add_n", specs, linear="additive")


# ---- special functions, integer and bitwise ops ----------------------------------------------------------------------
for _op in ("i0e", "i1", "i1e", "gammaln"):
    _register_unary(_op, to_float=True)
for _op in ("isneginf", "isposinf", "isreal"):
    _register_unary(_op, dtype="bool")
for _op in ("gcd", "lcm", "nextafter"):
    _register_binary(_op)


@register_spmd_rule("polygamma")
def polygamma(x, n, name=None):
    return _unary("polygamma", x, to_float=True)




def _bitwise(op):
    """``bitwise_and / or / xor``: integers bit by bit, bools as logic (the dtype kept, unlike logical_*)."""
    def rule(x, y, out=None, name=None):
        if out is not None:
            raise NotImplementedError(f"{op}: out= is not supported on distributed tensors; use the result")
        return _binary_body(op, x, y, False)

    rule.__name__ = op
    register_spmd_rule(op, rule)


for _op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    _bitwise(_op)


def _shift(op):
    def rule(x, y, is_arithmetic=True, out=None, name=None):
        if out is not None:
            raise NotImplementedError(f"{op}: out= is not supported on distributed tensors; use the result")
        return _binary_body(op, x, y, False)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_shift("bitwise_left_shift")
_shift("bitwise_right_shift")


def _bitwise_unary(op):
    def rule(x, out=None, name=None):
        if out is not None:
            raise NotImplementedError(f"{op}: out= is not supported on distributed tensors; use the result")
        return _unary(op, x)

    rule.__name__ = op
    register_spmd_rule(op, rule)


for _op in ("bitwise_invert", "bitwise_not"):
    _bitwise_unary(_op)
