"""Local calls made safe for a rank's empty shard (6 rows over 4 ranks are 2, 2, 2, 0): paddle 3.3's CPU kernels
that misbehave on an empty operand, and the equivalent calls run instead (see ``dispatch._execute``)."""
from __future__ import annotations

import paddle


# ops whose paddle 3.3 CPU kernel leaves the output uninitialised when the contracted dim is empty (this rank's
# empty shard of it: 6 rows over 4 ranks are 2, 2, 2, 0; bmm of [4, 8, 0] x [4, 0, 8] returned 1e+24's where
# its Partial term must be zeros), and the equivalent call whose kernel writes the zeros
def _stack_by_concat(x, axis=0, name=None):
    """``paddle.stack`` as a concat of the unsqueezed operands: the same value and gradient. paddle 3.3's stack
    backward segfaults (StackGradKernel) when an empty operand needs no gradient and another needs one (this rank's
    empty shard of a constant stacked with an activation: ``stack([c[:, 6:6], z[:, 6:6]], 2)`` with c a
    stop_gradient tensor crashes one process too)."""
    return paddle.concat([t.unsqueeze(axis) for t in x], axis=axis)


def _sum_in_dtype(fn):
    """``fn`` (paddle.sum / nansum) with its result cast to ``dtype``: paddle 3.3 ignores a float ``dtype`` on an
    empty input (``paddle.sum(zeros([7, 0]), axis=1, dtype="float64")`` is float32), so this rank's empty shard
    gave a result of another dtype than the other ranks'."""
    def call(x, axis=None, dtype=None, keepdim=False, name=None):
        out = fn(x, axis=axis, dtype=dtype, keepdim=keepdim)
        return out if dtype is None or out.dtype == paddle.empty([0], dtype=dtype).dtype else out.astype(dtype)

    return call


_EMPTY_SAFE = {"bmm": paddle.matmul, "stack": _stack_by_concat, "sum": _sum_in_dtype(paddle.sum),
               "nansum": _sum_in_dtype(paddle.nansum)}


def empty_safe(op, fn, args):
    """``fn``, or its equivalent from _EMPTY_SAFE when one of this rank's operands (or of a list operand) has no
    elements."""
    alt = _EMPTY_SAFE.get(op)
    if alt is None or not any(_has_empty(a) for a in args):
        return fn
    return alt


def _has_empty(a) -> bool:
    if isinstance(a, (list, tuple)):
        return any(isinstance(t, paddle.Tensor) and 0 in t.shape for t in a)
    return isinstance(a, paddle.Tensor) and 0 in a.shape


def empty_operands(args) -> tuple:
    """paddle 3.3's matmul backward fails ("Required tensor shall not be nullptr") when an empty operand (this
    rank's empty shard of the contracted dim: 6 rows over 4 ranks are 2, 2, 2, 0) needs no gradient while
    the other operand does: that operand runs as a detached copy that does (its gradient has no elements
    and goes nowhere)."""
    ts = [a for a in args if isinstance(a, paddle.Tensor)]
    if not any(0 in a.shape for a in ts) or all(a.stop_gradient for a in ts):
        return args
    return tuple(_with_grad(a) if isinstance(a, paddle.Tensor) and a.stop_gradient and 0 in a.shape else a
                 for a in args)


def _with_grad(t):
    c = t.detach()
    c.stop_gradient = False
    return c
