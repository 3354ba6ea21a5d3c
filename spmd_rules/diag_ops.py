"""Diagonals, sliding windows and scatters into a slice: ``Tensor.unfold`` (``paddle.unfold``: windows along one
axis), ``fill_diagonal_``, ``fill_diagonal_tensor`` (and its in-place form), ``diagonal_scatter``,
``select_scatter``, ``slice_scatter``, ``diag_embed``, ``diag``, ``diagflat`` and ``as_strided``.

What each needs whole, and why (every other dim keeps its sharding):

* ``unfold(x, axis, size, step)``: the windowed axis (a window straddles shards); the window count and the
  window dims of the output are whole. A copy of elements: a Partial input is kept.
* ``fill_diagonal_tensor(x, y, offset, dim1, dim2)`` / ``diagonal_scatter``: the two diagonal dims of ``x`` and
  the last dim of ``y`` (the diagonal's position in a shard depends on the shard's offsets in both dims); the
  other dims of ``x`` are the leading dims of ``y``, split alike. Linear in ``(x, y)`` jointly: kept Partial
  when both have the same linear Partial.
* ``select_scatter(x, values, axis, index)``: ``axis`` of x whole; x's other dims are values' dims.
  ``slice_scatter(x, value, axes, ...)``: the sliced axes whole in both. Both jointly linear like the above.
* ``fill_diagonal_(value, offset, wrap)``: everything whole. paddle's kernel fills flat positions of the whole
  tensor (for a tall matrix with a negative offset it fills fewer cells than ``j - i == offset``, and ``wrap``
  restarts by flat index), so only the whole tensor gives its cells. Not linear (a constant is written).
* ``diag_embed(x, offset, dim1, dim2)``: x's last dim whole (it becomes the two diagonal dims, whole); x's
  other dims map to the output's remaining dims in order, split alike. Linear.
* ``diag``, ``diagflat``, ``as_strided``: everything whole (``diag`` of a vector and ``diagflat`` place each
  element by its global index; ``as_strided`` reads the row-major storage of the whole tensor, its ``offset``
  in bytes as paddle 3.3 reads it). ``diag`` with a
  non-zero ``padding_value`` is not linear (the padding would be summed once per rank).
"""
from __future__ import annotations

from autoparallel.core.spec import DistSpec, dtype_bytes

from spmd_rules.einsum import ALL, labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec, int_arg, int_list, keep_but, norm_axis, numel, promote


def _whole(x) -> tuple:
    return (None,) * x.ndim


# ---- sliding windows -----------------------------------------------------------------------------------------
@register_spmd_rule("unfold_windows")
def unfold_windows(x, axis, size, step, name=None):
    """``x.unfold(axis, size, step)``: ``axis`` becomes the window count, a last dim of ``size`` is added."""
    op = "unfold_windows"
    check_spec(op, "x", x)
    a = norm_axis(op, int_arg(op, "axis", axis), max(x.ndim, 1))
    size, step = int_arg(op, "size", size), int_arg(op, "step", step)
    n = x.shape[a] if x.ndim else 1
    if not 0 < size <= n or step <= 0:
        raise ValueError(f"Tensor.unfold: expects 0 < size <= {n} (the size of axis {a}) and step > 0, got "
                         f"size={size}, step={step}")
    count = (n - size) // step + 1
    shape = tuple(count if d == a else s for d, s in enumerate(x.shape)) + (size,)
    lab = keep_but(x, {a})
    return labels_result(op, [x], [lab], [lab + (None,)], [(shape, x.dtype)], linear=ALL, local_op="unfold_windows")


# ---- diagonals -----------------------------------------------------------------------------------------------
def _diag_len(n1: int, n2: int, offset: int) -> int:
    """Length of the diagonal ``offset`` of an ``n1 x n2`` matrix (paddle.diagonal's)."""
    return max(0, min(n1, n2 - offset) if offset >= 0 else min(n1 + offset, n2))


def _fill_diag_tensor(op, x, y, offset, dim1, dim2):
    check_spec(op, "x", x)
    check_spec(op, "y", y)
    offset = int_arg(op, "offset", offset)
    d1, d2 = norm_axis(op, int_arg(op, "dim1", dim1), x.ndim), norm_axis(op, int_arg(op, "dim2", dim2), x.ndim)
    if d1 == d2:
        raise ValueError(f"{op}: dim1 and dim2 must differ, got {dim1} and {dim2} for a tensor of rank {x.ndim}")
    rest = [d for d in range(x.ndim) if d not in (d1, d2)]
    want = tuple(x.shape[d] for d in rest) + (_diag_len(x.shape[d1], x.shape[d2], offset),)
    if tuple(y.shape) != want:
        raise ValueError(f"{op}: y must have shape {list(want)} (x's other dims, then the diagonal's length) for x "
                         f"of shape {list(x.shape)}, offset {offset}, dims ({d1}, {d2}); got {list(y.shape)}")
    xl = keep_but(x, {d1, d2})
    yl = tuple(rest) + (None,)
    return labels_result(op, [x, y], [xl, yl], [xl], [(x.shape, promote(x.dtype, y.dtype))], linear="additive",
                         local_op="fill_diagonal_tensor_shard")


@register_spmd_rule("fill_diagonal_tensor")
def fill_diagonal_tensor(x, y, offset=0, dim1=0, dim2=1, name=None):
    return _fill_diag_tensor("fill_diagonal_tensor", x, y, offset, dim1, dim2)


@register_spmd_rule("diagonal_scatter")
def diagonal_scatter(x, y, offset=0, axis1=0, axis2=1, name=None):
    return _fill_diag_tensor("diagonal_scatter", x, y, offset, axis1, axis2)


@register_spmd_rule("fill_diagonal_")
def fill_diagonal_(x, value, offset=0, wrap=False, name=None):
    """``x.fill_diagonal_(value, offset, wrap)`` (paddle's in-place form; run locally as a copy: ``local_op``)."""
    op = "fill_diagonal_"
    check_spec(op, "x", x)
    if isinstance(value, DistSpec):
        raise TypeError(f"{op}: value must be a python number, got a tensor (use fill_diagonal_tensor_)")
    int_arg(op, "offset", offset)
    if x.ndim < 2:
        raise ValueError(f"{op}: expects a tensor of rank >= 2, got shape {list(x.shape)}")
    if x.ndim > 2 and len(set(x.shape)) != 1:
        raise ValueError(f"{op}: a tensor of rank > 2 must have all dims equal, got shape {list(x.shape)}")
    return labels_result(op, [x], [_whole(x)], [_whole(x)], [(x.shape, x.dtype)], linear=None,
                         local_op="fill_diagonal")


@register_spmd_rule("diag_embed")
def diag_embed(input, offset=0, dim1=-2, dim2=-1):
    op = "diag_embed"
    check_spec(op, "input", input)
    offset = int_arg(op, "offset", offset)
    nd = input.ndim + 1
    d1, d2 = norm_axis(op, int_arg(op, "dim1", dim1), nd), norm_axis(op, int_arg(op, "dim2", dim2), nd)
    if d1 == d2 or input.ndim < 1:
        raise ValueError(f"{op}: dim1 and dim2 must differ and input must have rank >= 1, got dims ({dim1}, "
                         f"{dim2}) and shape {list(input.shape)}")
    side = input.shape[-1] + abs(offset)
    rest = iter(range(input.ndim - 1))
    out_lab = tuple(None if d in (d1, d2) else next(rest) for d in range(nd))
    rest = iter(input.shape[:-1])
    shape = tuple(side if d in (d1, d2) else next(rest) for d in range(nd))
    in_lab = tuple(range(input.ndim - 1)) + (None,)
    return labels_result(op, [input], [in_lab], [out_lab], [(shape, input.dtype)], linear=ALL)


@register_spmd_rule("diag")
def diag(x, offset=0, padding_value=0, name=None):
    op = "diag"
    check_spec(op, "x", x)
    offset = int_arg(op, "offset", offset)
    if x.ndim == 1:
        side = x.shape[0] + abs(offset)
        shape, linear = (side, side), (ALL if padding_value == 0 else None)
    elif x.ndim == 2:
        shape, linear = (_diag_len(x.shape[0], x.shape[1], offset),), ALL
    else:
        raise ValueError(f"{op}: expects a tensor of rank 1 or 2, got shape {list(x.shape)}")
    return labels_result(op, [x], [_whole(x)], [(None,) * len(shape)], [(shape, x.dtype)], linear=linear)


@register_spmd_rule("diagflat")
def diagflat(x, offset=0, name=None):
    op = "diagflat"
    check_spec(op, "x", x)
    offset = int_arg(op, "offset", offset)
    side = numel(x) + abs(offset)
    return labels_result(op, [x], [_whole(x)], [(None, None)], [((side, side), x.dtype)], linear=ALL)


# ---- scatters into a slice -----------------------------------------------------------------------------------
@register_spmd_rule("select_scatter")
def select_scatter(x, values, axis, index, name=None):
    op = "select_scatter"
    check_spec(op, "x", x)
    check_spec(op, "values", values)
    a = norm_axis(op, int_arg(op, "axis", axis), x.ndim)
    index = int_arg(op, "index", index)
    if not -x.shape[a] <= index < x.shape[a]:
        raise ValueError(f"{op}: index {index} is out of range for axis {a} of size {x.shape[a]}")
    rest = [d for d in range(x.ndim) if d != a]
    if tuple(values.shape) != tuple(x.shape[d] for d in rest):
        raise ValueError(f"{op}: values must have shape {[x.shape[d] for d in rest]} (x without axis {a}), got "
                         f"{list(values.shape)}")
    xl = keep_but(x, {a})
    return labels_result(op, [x, values], [xl, tuple(rest)], [xl], [(x.shape, x.dtype)], linear="additive")


@register_spmd_rule("slice_scatter")
def slice_scatter(x, value, axes, starts, ends, strides, name=None):
    op = "slice_scatter"
    check_spec(op, "x", x)
    check_spec(op, "value", value)
    axes = {norm_axis(op, a, x.ndim) for a in int_list(op, "axes", axes)}
    for what, v in (("starts", starts), ("ends", ends), ("strides", strides)):
        int_list(op, what, v)
    if value.ndim != x.ndim or any(value.shape[d] != x.shape[d] for d in range(x.ndim) if d not in axes):
        raise ValueError(f"{op}: value must match x's shape {list(x.shape)} outside the sliced axes "
                         f"{sorted(axes)}, got {list(value.shape)}")
    xl = keep_but(x, axes)
    return labels_result(op, [x, value], [xl, xl], [xl], [(x.shape, x.dtype)], linear="additive")


@register_spmd_rule("as_strided")
def as_strided(x, shape, stride, offset=0, name=None):
    """paddle 3.3 reads ``offset`` in bytes (``as_strided(float32 x, [2, 3], [5, 2], 4)`` starts at element 1; an
    offset of 1 reads across element boundaries and gives garbage such as 1e-39), ``stride`` in elements."""
    op = "as_strided"
    check_spec(op, "x", x)
    shape, stride = int_list(op, "shape", shape), int_list(op, "stride", stride)
    offset, item = int_arg(op, "offset", offset), dtype_bytes(x.dtype)
    if len(shape) != len(stride) or any(s < 0 for s in shape) or any(s < 0 for s in stride) or offset < 0:
        raise ValueError(f"{op}: expects shape and stride of one length, non-negative, and offset >= 0; got shape "
                         f"{shape}, stride {stride}, offset {offset}")
    if offset % item:
        raise ValueError(f"{op}: offset {offset} is not a multiple of the {item} bytes of a {x.dtype} element "
                         f"(paddle reads the offset in bytes; this one would read across element boundaries)")
    n = numel(x)
    last = offset // item + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else -1
    if last >= n:
        raise ValueError(f"{op}: shape {shape}, stride {stride}, offset {offset} bytes read element {last} of a "
                         f"tensor of {n} elements (shape {list(x.shape)})")
    return labels_result(op, [x], [_whole(x)], [(None,) * len(shape)], [(tuple(shape), x.dtype)], linear=ALL,
                         local_op="as_strided")
