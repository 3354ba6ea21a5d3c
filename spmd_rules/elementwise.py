"""Elementwise ops: unary, binary with broadcasting, where, comparisons.

Built on einsum notation (einsum.py): output dims are labels, an operand's dim that broadcasts (size 1
against a larger output) is unlabelled and stays whole. Partial inputs: see einsum.py; the linear cases
are add/subtract of two equal linear Partials, multiply (in either operand, one Partial kept), divide (in
the numerator), neg, scale without bias, float casts. add(P, R) requires R.
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec, normalize_dtype

from spmd_rules.blocks import block_aware
from spmd_rules.einsum import ALL, label_reverse, labels_result
from spmd_rules.expand import expand_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import REAL_OF, broadcast_shapes, check_spec, is_float, promote


def broadcast_labels(shapes, out_shape):
    """Labels of each operand (right-aligned; broadcast size-1 dims get None) and of the output."""
    nd = len(out_shape)
    labels = []
    for s in shapes:
        off = nd - len(s)
        labels.append(tuple(off + j if s[j] == out_shape[off + j] else None for j in range(len(s))))
    return labels, tuple(range(nd))


def elementwise_result(op: str, operands, *, linear=None, out_dtype=None) -> SpmdResult:
    """Rule body for a broadcasting elementwise op; ``operands`` may hold python scalars (ignored)."""
    specs = [a for a in operands if isinstance(a, DistSpec)]
    if not specs:
        raise TypeError(f"{op}: needs at least one DistSpec operand, got {operands!r}")
    out_shape = broadcast_shapes(op, *[s.shape for s in specs])
    labels, out = broadcast_labels([s.shape for s in specs], out_shape)
    dtype = out_dtype or promote(*[s.dtype for s in specs])
    return labels_result(op, specs, labels, [out], [(out_shape, dtype)], linear=linear)


def elementwise_reverse(op: str, outputs, operands, *, linear=None) -> SpmdResult:
    specs = [a for a in operands if isinstance(a, DistSpec)]
    out_shape = broadcast_shapes(op, *[s.shape for s in specs])
    labels, out = broadcast_labels([s.shape for s in specs], out_shape)
    return SpmdResult(expand_reverse(op, specs, outputs, label_reverse(labels, [out], linear=linear)), outputs)


# ---- unary ------------------------------------------------------------------------------------------------------
def _unary(op, x, *, linear=False, to_float=False, dtype=None):
    check_spec(op, "x", x)
    out_dtype = dtype or ("float32" if to_float and not is_float(x.dtype) else x.dtype)
    return elementwise_result(op, [x], linear=ALL if linear else None, out_dtype=out_dtype)


def _unary_reverse(op, linear=False):
    def rev(outputs, x, *args, **kwargs):
        return elementwise_reverse(op, outputs, [x], linear=ALL if linear else None)
    return rev


def _simple(op, *, to_float=False, linear=False):
    def rule(x, name=None):
        return _unary(op, x, linear=linear, to_float=to_float)
    rule.__name__ = op
    block_aware(rule)
    register_spmd_rule(op, rule, reverse=_unary_reverse(op, linear))


for _op in ("exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "erf", "sin", "cos", "log1p"):
    _simple(_op, to_float=True)
for _op in ("relu", "square", "floor", "sign"):
    _simple(_op)


@register_spmd_rule("logical_not", reverse=_unary_reverse("logical_not"))
@block_aware
def logical_not(x, out=None, name=None):
    """``not x`` elementwise: bool whatever the input's dtype (an integer is true where non-zero)."""
    if out is not None:
        raise NotImplementedError("logical_not: out= is not supported on distributed tensors; use the result")
    return _unary("logical_not", x, dtype="bool")


@register_spmd_rule("abs", reverse=_unary_reverse("abs"))
@block_aware
def abs_(x, name=None):
    """|x|; of a complex tensor, its real modulus (complex64 -> float32)."""
    check_spec("abs", "x", x)
    return _unary("abs", x, dtype=REAL_OF.get(str(x.dtype)))
_simple("neg", linear=True)
_simple("clone", linear=True)


@register_spmd_rule("silu", reverse=_unary_reverse("silu"))
@block_aware
def silu(x, inplace=False, name=None):
    return _unary("silu", x, to_float=True)


@register_spmd_rule("gelu", reverse=_unary_reverse("gelu"))
@block_aware
def gelu(x, approximate=False, name=None):
    return _unary("gelu", x, to_float=True)


@register_spmd_rule("leaky_relu", reverse=_unary_reverse("leaky_relu"))
@block_aware
def leaky_relu(x, negative_slope=0.01, name=None):
    return _unary("leaky_relu", x)


@register_spmd_rule("clip", reverse=_unary_reverse("clip"))
@block_aware
def clip(x, min=None, max=None, name=None):
    if isinstance(min, DistSpec) or isinstance(max, DistSpec):
        return elementwise_result("clip", [x, min, max])
    return _unary("clip", x)


def _cast_linear(x, dtype):
    return is_float(x.dtype) and is_float(dtype)


@register_spmd_rule("cast")
@block_aware
def cast(x, dtype):
    check_spec("cast", "x", x)
    dtype = normalize_dtype(dtype)
    return _unary("cast", x, linear=_cast_linear(x, dtype), dtype=dtype)


@register_spmd_rule("scale")
@block_aware
def scale(x, scale=1.0, bias=0.0, bias_after_scale=True, act=None, name=None):
    """paddle.scale: x * scale + bias (or (x + bias) * scale). Linear (Partial passes) when bias == 0."""
    check_spec("scale", "x", x)
    linear = (bias == 0 or bias is None) and act is None
    if isinstance(scale, DistSpec):
        if scale.numel != 1:
            raise ValueError(f"scale: a tensor scale must have one element, got shape {list(scale.shape)}")
        res = _unary("scale", x, linear=linear)
        from spmd_rules.utils import R

        req_scale = scale.with_placements(tuple(R for _ in scale.placements))
        return SpmdResult((res.inputs[0], req_scale), res.outputs)
    return _unary("scale", x, linear=linear)


@register_spmd_rule("pow")
@block_aware
def pow_rule(x, y, name=None):
    """paddle.pow: a python exponent is a unary (nonlinear) op; a tensor exponent broadcasts."""
    if isinstance(y, DistSpec):
        if not isinstance(x, DistSpec):          # 2 ** i: an integer base keeps i's integers (int64 for bool)
            dtype = y.dtype if is_float(y.dtype) else "float32" if isinstance(x, float) else \
                y.dtype if y.dtype != "bool" else "float32" if isinstance(x, bool) else "int64"
            return elementwise_result("pow", [x, y], out_dtype=dtype)
        return elementwise_result("pow", [x, y], out_dtype=_promote_pair("pow", x, y))
    check_spec("pow", "x", x)
    return _unary("pow", x, dtype=_binary_dtype("pow", x, y))


# ---- binary --------------------------------------------------------------------------------------------------------
def _binary_dtype(op, x, y, *, true_div=False):
    """paddle's result dtype: a python float makes an integer or bool tensor float32, a python int (not a bool)
    makes a bool tensor int64 (``(x > 0) + 1``); a true division is float, except of bool by bool."""
    dtype = _promote_pair(op, x, y)
    scalars = [a for a in (x, y) if not isinstance(a, DistSpec)]
    if dtype == "bool" and true_div and scalars and all(isinstance(s, bool) for s in scalars):
        return dtype
    if not is_float(dtype) and (true_div or any(isinstance(s, float) for s in scalars)):
        return "float32"
    if dtype == "bool" and any(not isinstance(s, bool) for s in scalars):
        return "int64"
    return dtype


_ZERO_D_AS_NUMBER = ("add", "subtract", "multiply", "divide", "remainder", "pow")


def _kind(dtype) -> int:
    return 2 if is_float(dtype) else 0 if normalize_dtype(dtype) == "bool" else 1


def _promote_pair(op, x, y):
    """The promoted dtype of the tensor operands. To paddle's arithmetic ops a 0-d tensor beside a tensor of rank
    >= 1 is a number: of the same kind (bool, integer, float) the other's dtype wins (f32[n] + f64[] is f32,
    i32[n] * i64[] is i32), of a higher kind its own (i64[n] + f64[] is f64)."""
    specs = [a for a in (x, y) if isinstance(a, DistSpec)]
    if op in _ZERO_D_AS_NUMBER and len(specs) == 2 and (specs[0].ndim == 0) != (specs[1].ndim == 0):
        whole, zero = (specs[0], specs[1]) if specs[1].ndim == 0 else (specs[1], specs[0])
        return normalize_dtype(zero.dtype if _kind(zero.dtype) > _kind(whole.dtype) else whole.dtype)
    return promote(*[s.dtype for s in specs])


def _binary_linear(op, x, y, rounding_mode=None):
    xs, ys = isinstance(x, DistSpec), isinstance(y, DistSpec)
    if op in ("add", "subtract"):
        return "additive" if xs and ys else None       # x + alpha * y: alpha keeps it linear
    if op == "multiply":
        return ALL
    if op == "divide":
        return {0} if xs and rounding_mode is None else None   # linear in the numerator only
    return None


def _check_operands(op, x, y):
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, (DistSpec, int, float, bool)):
            raise TypeError(f"{op}: {name} must be a DistSpec or a python number, got {type(v).__name__} {v!r}")
    if not isinstance(x, DistSpec) and not isinstance(y, DistSpec):
        raise TypeError(f"{op}: needs at least one DistSpec operand")


def _binary_body(op, x, y, compare, rounding_mode=None):
    _check_operands(op, x, y)
    linear = None if compare else _binary_linear(op, x, y, rounding_mode)
    true_div = op == "divide" and rounding_mode is None
    dtype = "bool" if compare else _binary_dtype(op, x, y, true_div=true_div)
    return elementwise_result(op, [x, y], linear=linear, out_dtype=dtype)


def _binary(op, *, compare=False):
    if op in ("add", "subtract"):
        def rule(x, y, name=None, *, alpha=1):
            return _binary_body(op, x, y, compare)
    elif op == "divide":
        def rule(x, y, name=None, *, rounding_mode=None):
            return _binary_body(op, x, y, compare, rounding_mode)
    else:
        def rule(x, y, name=None):
            return _binary_body(op, x, y, compare)

    block_aware(rule)

    def rev(outputs, x, y, name=None, **kw):
        linear = None if compare else _binary_linear(op, x, y, kw.get("rounding_mode"))
        return elementwise_reverse(op, outputs, [x, y], linear=linear)

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=rev)


for _op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "floor_divide", "remainder"):
    _binary(_op)
for _op in ("equal", "not_equal", "less_than", "less_equal", "greater_than", "greater_equal",
            "logical_and", "logical_or"):
    _binary(_op, compare=True)


@register_spmd_rule("where")
@block_aware
def where(condition, x=None, y=None, name=None):
    check_spec("where", "condition", condition)
    if x is None and y is None:          # nonzero(condition, as_tuple=True): a data-dependent size
        from spmd_rules.routing import replicate_all

        return replicate_all("where", [condition], max(condition.ndim, 1))
    vals = [a for a in (x, y) if isinstance(a, DistSpec)]
    if vals:
        dtype = promote(*[s.dtype for s in vals])
    else:
        dtype = "float32" if any(isinstance(a, float) for a in (x, y)) else "int64"
    return elementwise_result("where", [condition, x, y], out_dtype=dtype)
