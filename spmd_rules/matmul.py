"""matmul, linear, bmm, einsum: all from einsum notation (einsum.py).

A sharded contraction axis makes the output Partial(sum). ``linear``'s bias follows the output: sharded
with the output's last dim, Partial when the output is Partial (each rank adds its term of the bias; the
runtime turns a replicated bias into a Partial one by keeping it on one rank and zeros elsewhere), R
otherwise.
"""
from __future__ import annotations

from autoparallel.core.placement import BlockShard, Partial, Shard

from spmd_rules.blocks import block_aware
from spmd_rules.einsum import einsum_result, label_reverse, label_rule
from spmd_rules.expand import expand, expand_reverse, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, promote, numel


def matmul_labels(op, xs, ys, transpose_x=False, transpose_y=False):
    """Labels and output shape of ``matmul(x, y)`` for shapes ``xs`` and ``ys`` (paddle semantics)."""
    if len(xs) == 0 or len(ys) == 0:
        raise ValueError(f"{op}: operands must have rank >= 1, got shapes {list(xs)} and {list(ys)}")
    if len(xs) == 1:
        x_core, xk, xb = ("k",), xs[0], ()
    else:
        m, k = (xs[-1], xs[-2]) if transpose_x else (xs[-2], xs[-1])
        x_core, xk, xb = (("k", "m") if transpose_x else ("m", "k")), k, tuple(xs[:-2])
    if len(ys) == 1:
        y_core, yk, yb = ("k",), ys[0], ()
    else:
        k, n = (ys[-1], ys[-2]) if transpose_y else (ys[-2], ys[-1])
        y_core, yk, yb = (("n", "k") if transpose_y else ("k", "n")), k, tuple(ys[:-2])
    if xk != yk:
        raise ValueError(f"{op}: shapes {list(xs)} and {list(ys)} do not match for matrix multiplication "
                         f"(transpose_x={transpose_x}, transpose_y={transpose_y}): contraction sizes {xk} != {yk}")
    nb = max(len(xb), len(yb))
    out_b = []
    for j in range(nb):
        a = xb[len(xb) - nb + j] if len(xb) - nb + j >= 0 else 1
        b = yb[len(yb) - nb + j] if len(yb) - nb + j >= 0 else 1
        if a != b and 1 not in (a, b):
            raise ValueError(f"{op}: batch dims of {list(xs)} and {list(ys)} cannot be broadcast together")
        out_b.append(max(a, b) if 1 in (a, b) else a)

    def batch_labels(bs):
        off = nb - len(bs)
        return tuple(f"b{off + j}" if bs[j] == out_b[off + j] else None for j in range(len(bs)))

    x_labels = batch_labels(xb) + x_core
    y_labels = batch_labels(yb) + y_core
    out_labels = tuple(f"b{j}" for j in range(nb))
    out_shape = list(out_b)
    if len(xs) > 1:
        out_labels += ("m",)
        out_shape.append(xs[-1] if transpose_x else xs[-2])
    if len(ys) > 1:
        out_labels += ("n",)
        out_shape.append(ys[-2] if transpose_y else ys[-1])
    return x_labels, y_labels, out_labels, tuple(out_shape)


def _matmul(x, y, transpose_x=False, transpose_y=False, name=None, *, out=None, op="matmul"):
    check_spec(op, "x", x)
    check_spec(op, "y", y)
    xl, yl, ol, shape = matmul_labels(op, x.shape, y.shape, transpose_x, transpose_y)
    rule = label_rule([xl, yl], [ol], [numel(x), numel(y)])
    required, outputs = expand(op, [x, y], [(shape, promote(x.dtype, y.dtype))], rule, nested=True)
    return SpmdResult(required, outputs)


def _matmul_reverse(outputs, x, y, transpose_x=False, transpose_y=False, name=None, *, out=None):
    xl, yl, ol, _ = matmul_labels("matmul", x.shape, y.shape, transpose_x, transpose_y)
    return SpmdResult(expand_reverse("matmul", [x, y], outputs, label_reverse([xl, yl], [ol])), outputs)


@register_spmd_rule("matmul", reverse=_matmul_reverse)
@block_aware
def matmul(x, y, transpose_x=False, transpose_y=False, name=None, *, out=None):
    return _matmul(x, y, transpose_x, transpose_y)


def _bmm_check(x, y):
    check_spec("bmm", "x", x)
    check_spec("bmm", "y", y)
    if x.ndim != 3 or y.ndim != 3 or x.shape[0] != y.shape[0]:
        raise ValueError(f"bmm: expects [b, m, k] and [b, k, n] with equal b, got shapes {list(x.shape)} "
                         f"and {list(y.shape)}")


def _bmm_reverse(outputs, x, y, name=None, *, out=None):
    _bmm_check(x, y)
    return _matmul_reverse(outputs, x, y)


@register_spmd_rule("bmm", reverse=_bmm_reverse)
@block_aware
def bmm(x, y, name=None, *, out=None):
    _bmm_check(x, y)
    return _matmul(x, y, op="bmm")


# ---- linear --------------------------------------------------------------------------------------------------
def _linear_labels(x, weight, bias):
    op = "linear"
    check_spec(op, "x", x)
    check_spec(op, "weight", weight)
    check_spec(op, "bias", bias, optional=True)
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D [in_features, out_features], got shape {list(weight.shape)}")
    if x.ndim < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"linear: x shape {list(x.shape)} does not match weight shape {list(weight.shape)}: "
                         f"x's last dim must equal weight's in_features {weight.shape[0]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[1],):
        raise ValueError(f"linear: bias must have shape [{weight.shape[1]}], got {list(bias.shape)}")
    xl = tuple(f"b{j}" for j in range(x.ndim - 1)) + ("k",)
    ol = xl[:-1] + ("n",)
    return xl, ("k", "n"), ol, tuple(x.shape[:-1]) + (weight.shape[1],)


@block_aware
def linear(x, weight, bias=None, name=None):
    xl, wl, ol, shape = _linear_labels(x, weight, bias)
    inner = label_rule([xl, wl], [ol], [numel(x), numel(weight)])
    last = len(ol) - 1

    def rule(pl, dim):
        (rx, rw), (o,) = inner(pl[:2], dim)
        if pl[2] is None:
            rb = None
        elif isinstance(o, Shard):
            rb = Shard(0) if o.dim == last else R
        elif isinstance(o, BlockShard):          # a fused projection: the bias splits block by block too
            rb = BlockShard(0, o.blocks) if o.dim == last else R
        else:
            rb = o if isinstance(o, Partial) else R
        return (rx, rw, rb), (o,)

    dtype = promote(*[s.dtype for s in (x, weight, bias) if s is not None])
    required, outputs = expand("linear", [x, weight, bias], [(shape, dtype)], rule, nested=True)
    return SpmdResult(present(required), outputs)


def _linear_reverse(outputs, x, weight, bias=None, name=None):
    xl, wl, ol, _ = _linear_labels(x, weight, bias)
    inner = label_reverse([xl, wl], [ol])
    last = len(ol) - 1

    def rule(outs, dim):
        rx, rw = inner(outs, dim)
        o = outs[0]
        rb = Shard(0) if isinstance(o, Shard) and o.dim == last else (o if isinstance(o, Partial) else R)
        return rx, rw, rb

    required = expand_reverse("linear", [x, weight, bias], outputs, rule)
    return SpmdResult(present(required), outputs)


register_spmd_rule("linear", linear, reverse=_linear_reverse)   # defined above its reverse; registered here


# ---- einsum ----------------------------------------------------------------------------------------------------
def _einsum_reverse(outputs, equation, *operands):
    from spmd_rules.einsum import parse_equation

    labels, out, _ = parse_equation("einsum", equation, [s.shape for s in operands])
    return SpmdResult(expand_reverse("einsum", list(operands), outputs, label_reverse(labels, [out])), outputs)


@register_spmd_rule("einsum", reverse=_einsum_reverse)
def einsum(equation, *operands):
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        raise TypeError("einsum: pass operands as separate arguments: einsum(equation, a, b)")
    return einsum_result("einsum", equation, list(operands))
