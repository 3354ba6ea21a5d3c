"""Ops of mixture-of-experts routing: selection, sorting and scans along an axis, gathers and scatters
by index, and ops whose output size depends on the values.

Along-an-axis ops (``topk``, ``argsort``, ``sort``, ``cumsum``, ``take_along_axis``, ``put_along_axis``,
``index_add``, ``index_select``, ``scatter``, ``gather``): the axis they select, sort, scan or index must be
whole (R); every other dim keeps its sharding, shared between the operands that have it. Index tensors
are never Partial (they are integers); values are not treated as linear (Partials are reduced first).

Data-dependent output sizes (one-argument ``where``, ``nonzero``, ``masked_select``, ``bincount``,
``unique``, ``getitem`` with several advanced indices or a mask): the inputs are gathered to R on every mesh
dim and the output is replicated, its shape read from the local result (``LocalShaped``). This is the
"replicate the routing" choice: every rank computes the same routing decision for all tokens, the expert
compute that follows is replicated too, and the next op with a sharded operand slices it again (a local
slice, no communication). Graph tracing cannot follow a value-dependent shape: there these ops raise
``DataDependentShapeError`` naming the op.
"""
from __future__ import annotations

import dataclasses
import inspect

from autoparallel.core.placement import Replicate
from autoparallel.core.spec import DistSpec, normalize_dtype

from spmd_rules.einsum import labels_result
from spmd_rules.layout import transpose
from spmd_rules.registry import flatten_specs, register_spmd_rule
from spmd_rules.result import LocalShaped, SpmdResult
from spmd_rules.utils import check_spec, norm_axis


def _along(x: DistSpec, axis) -> tuple:
    """Labels of ``x`` with ``axis`` (None: every dim) forced R."""
    if axis is None:
        return (None,) * x.ndim
    a = norm_axis("axis", axis, x.ndim) if x.ndim else None
    return tuple(None if d == a else d for d in range(x.ndim))


def _shared(a: DistSpec, b: DistSpec, labels) -> tuple:
    """``b``'s labels: a dim keeps ``a``'s label only where both have the same size there."""
    return tuple(lab if lab is not None and d < b.ndim and b.shape[d] == a.shape[d] else None
                 for d, lab in enumerate(labels[:b.ndim])) + (None,) * max(0, b.ndim - len(labels))


def _replicated(specs) -> list:
    return [s.with_placements(tuple(Replicate() for _ in s.placements)) for s in specs]


def replicate_all(op: str, specs, n_outputs: int = 1) -> SpmdResult:
    """Every input R, every output replicated with a value-dependent shape (see the module docstring)."""
    specs = [s for s in specs if isinstance(s, DistSpec)]
    if not specs:
        raise ValueError(f"{op}: expects at least one tensor")
    return SpmdResult(_replicated(specs), tuple(LocalShaped(specs[0].mesh) for _ in range(n_outputs)))


@register_spmd_rule("topk")
def topk(x, k, axis=None, largest=True, sorted=True, name=None):
    check_spec("topk", "x", x)
    axis = -1 if axis is None else axis
    lab = _along(x, axis)
    a = norm_axis("topk", axis, x.ndim)
    k = int(k)
    if not 0 <= k <= x.shape[a]:
        raise ValueError(f"topk: k={k} is out of range for dim {a} of size {x.shape[a]}")
    shape = tuple(k if d == a else n for d, n in enumerate(x.shape))
    return labels_result("topk", [x], [lab], [lab, lab], [(shape, x.dtype), (shape, "int64")], linear=None)


def _sort_like(op, out_index: bool, values: bool):
    def rule(x, axis=-1, descending=False, stable=False, name=None):
        check_spec(op, "x", x)
        lab = _along(x, axis)
        metas = ([(x.shape, x.dtype)] if values else []) + ([(x.shape, "int64")] if out_index else [])
        return labels_result(op, [x], [lab], [lab] * len(metas), metas, linear=None)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_sort_like("argsort", True, False)
_sort_like("sort", False, True)


@register_spmd_rule("cumsum")
def cumsum(x, axis=None, dtype=None, name=None):
    check_spec("cumsum", "x", x)
    dt = normalize_dtype(dtype) if dtype is not None else x.dtype
    if axis is None:                     # paddle flattens first
        n = 1
        for s in x.shape:
            n *= s
        return labels_result("cumsum", [x], [(None,) * x.ndim], [(None,)], [((n,), dt)], linear=None)
    lab = _along(x, axis)
    return labels_result("cumsum", [x], [lab], [lab], [(x.shape, dt)], linear=None)


@register_spmd_rule("take_along_axis")
def take_along_axis(arr, indices, axis, broadcast=True):
    check_spec("take_along_axis", "arr", arr)
    check_spec("take_along_axis", "indices", indices)
    if indices.ndim != arr.ndim:
        raise ValueError(f"take_along_axis: indices of rank {indices.ndim} for arr of rank {arr.ndim}")
    if broadcast:
        return _take_broadcast(arr, indices, norm_axis("take_along_axis", axis, arr.ndim))
    lab = _along(arr, axis)
    il = _shared(arr, indices, lab)
    al = tuple(lab[d] if il[d] is not None else None for d in range(arr.ndim))
    return labels_result("take_along_axis", [arr, indices], [al, il], [il], [(indices.shape, arr.dtype)],
                         linear=None)


def _take_broadcast(arr, indices, axis):
    """paddle's ``broadcast=True`` (its default): every dim but ``axis`` is the larger of the two sizes (a size 1
    broadcasts, a size 0 gives 0), ``axis`` is the index's; a broadcast dim keeps the larger operand's sharding."""
    shape, al, il, ol = [], [], [], []
    for d, (n, m) in enumerate(zip(arr.shape, indices.shape)):
        if d == axis:
            size, labs = m, (None, d, d)
        elif n == 0 or m == 0:
            size, labs = 0, (None, None, None)
        elif n == m or m == 1 or n == 1:
            size = max(n, m)
            labs = (d if n == size else None, d if m == size else None, d)
        else:
            raise ValueError(f"take_along_axis: indices of shape {list(indices.shape)} do not broadcast to arr of "
                             f"shape {list(arr.shape)} at dim {d} (sizes {m} and {n}; axis {axis})")
        shape.append(size)
        for out, lab in zip((al, il, ol), labs):
            out.append(lab)
    return labels_result("take_along_axis", [arr, indices], [tuple(al), tuple(il)], [tuple(ol)],
                         [(tuple(shape), arr.dtype)], linear=None)


@register_spmd_rule("put_along_axis")
def put_along_axis(arr, indices, values, axis, reduce="assign", include_self=True, broadcast=True):
    check_spec("put_along_axis", "arr", arr)
    check_spec("put_along_axis", "indices", indices)
    lab = _along(arr, axis)
    il = _shared(arr, indices, lab)
    al = tuple(lab[d] if il[d] is not None else None for d in range(arr.ndim))
    specs, labels = [arr, indices], [al, il]
    if isinstance(values, DistSpec):
        vl = _shared(indices, values, il)
        specs.append(values)
        labels.append(vl)
    return labels_result("put_along_axis", specs, labels, [al], [(arr.shape, arr.dtype)], linear=None)


@register_spmd_rule("index_add")
def index_add(x, index, axis, value, alpha=1, name=None):
    check_spec("index_add", "x", x)
    check_spec("index_add", "index", index)
    check_spec("index_add", "value", value)
    lab = _along(x, axis)
    vl = _shared(x, value, lab)
    xl = tuple(lab[d] if d < len(vl) and vl[d] is not None else None for d in range(x.ndim))
    return labels_result("index_add", [x, index, value], [xl, (None,) * index.ndim, vl], [xl],
                         [(x.shape, x.dtype)], linear=None)


@register_spmd_rule("index_select")
def index_select(x, index, axis=0, name=None):
    check_spec("index_select", "x", x)
    check_spec("index_select", "index", index)
    lab = _along(x, axis)
    a = norm_axis("index_select", axis, x.ndim)
    shape = tuple(index.shape[0] if d == a else n for d, n in enumerate(x.shape))
    return labels_result("index_select", [x, index], [lab, (None,) * index.ndim], [lab], [(shape, x.dtype)],
                         linear=None)


def _along_axis_form(args, kwargs) -> bool:
    """True when ``paddle.gather`` / ``paddle.scatter`` take their torch form ``(input, dim, index, ...)``
    (they run ``take_along_axis`` / ``put_along_axis`` then): the test paddle's overloads make -- an int in the
    second position (an index is never an int), or ``dim`` among the keywords."""
    return isinstance(args[1], int) if len(args) >= 2 else "dim" in kwargs


def _bind_form(op, fn, args, kwargs):
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{op}: {e}") from None
    if bound.arguments.get("out") is not None:
        raise NotImplementedError(f"{op}(..., out=...) on distributed tensors: use the returned tensor")
    return bound.arguments


def _in_call_order(res: SpmdResult, rule_order, args, kwargs) -> SpmdResult:
    """``res`` with its required inputs in the order the call holds the specs (a ``*args`` rule's order)."""
    specs = [v for v in rule_order if isinstance(v, DistSpec)]
    pos, used = [], set()
    for c in flatten_specs(args, kwargs):     # by identity, each rule operand once (one tensor may come twice)
        i = next(i for i, s in enumerate(specs) if s is c and i not in used)
        used.add(i)
        pos.append(i)
    return dataclasses.replace(res, inputs=tuple(res.inputs[i] for i in pos))


def _torch_gather(input, dim, index, out=None):
    """The parameters of paddle's torch-form gather (used to bind a call, never run)."""


def _torch_scatter(input, dim, index, src=None, reduce=None, out=None, value=None):
    """The parameters of paddle's torch-form scatter (used to bind a call, never run)."""


@register_spmd_rule("gather")
def gather(*args, **kwargs):
    """``gather(x, index, axis=None)``, or paddle's torch form ``gather(input, dim, index)`` (take_along_axis
    without broadcasting)."""
    if _along_axis_form(args, kwargs):
        a = _bind_form("gather", _torch_gather, args, kwargs)
        res = take_along_axis(a["input"], a["index"], a["dim"], broadcast=False)
        return _in_call_order(res, [a["input"], a["index"]], args, kwargs)
    return _gather(*args, **kwargs)


def _gather(x, index, axis=None, name=None, out=None):
    if out is not None:
        raise NotImplementedError("gather(..., out=...) on distributed tensors: use the returned tensor")
    check_spec("gather", "x", x)
    check_spec("gather", "index", index)
    if index.ndim > 1:
        return replicate_all("gather", [x, index])
    if index.ndim == 0:           # a 0-d index picks one slice: paddle drops the axis (x[i] along it)
        lab = _along(x, 0 if axis is None else axis)
        a = norm_axis("gather", 0 if axis is None else axis, x.ndim)
        return labels_result("gather", [x, index], [lab, ()], [lab[:a] + lab[a + 1:]],
                             [(x.shape[:a] + x.shape[a + 1:], x.dtype)], linear=None, local_op="gather_slice")
    return index_select(x, index, 0 if axis is None else axis)


@register_spmd_rule("scatter")
def scatter(*args, **kwargs):
    """``scatter(x, index, updates, overwrite=True)``, or paddle's torch form ``scatter(input, dim, index,
    src | value, reduce=None)`` (put_along_axis without broadcasting)."""
    if _along_axis_form(args, kwargs):
        a = _bind_form("scatter", _torch_scatter, args, kwargs)
        src = a.get("src") if a.get("src") is not None else a.get("value")
        if src is None:
            raise TypeError("scatter(input, dim, index, ...): expects src (or value)")
        res = put_along_axis(a["input"], a["index"], src, a["dim"], a.get("reduce") or "assign", broadcast=False)
        return _in_call_order(res, [a["input"], a["index"], src], args, kwargs)
    return _scatter(*args, **kwargs)


def _scatter(x, index, updates, overwrite=True, name=None, out=None):
    if out is not None:
        raise NotImplementedError("scatter(..., out=...) on distributed tensors: use the returned tensor")
    check_spec("scatter", "x", x)
    check_spec("scatter", "index", index)
    check_spec("scatter", "updates", updates)
    lab = _along(x, 0)
    ul = _shared(x, updates, lab)
    xl = tuple(lab[d] if d < len(ul) and ul[d] is not None else None for d in range(x.ndim))
    return labels_result("scatter", [x, index, updates], [xl, (None,) * index.ndim, ul], [xl],
                         [(x.shape, x.dtype)], linear=None)


@register_spmd_rule("scatter_nd_add")
def scatter_nd_add(x, index, updates, name=None):
    """``x`` plus ``updates`` added at the first ``k = index.shape[-1]`` coordinates of each index row: the indexed
    dims of ``x`` and the index are R; ``x``'s trailing dims keep their sharding, shared with ``updates``' trailing
    dims of the same size (each rank adds its slice of every update row)."""
    check_spec("scatter_nd_add", "x", x)
    check_spec("scatter_nd_add", "index", index)
    check_spec("scatter_nd_add", "updates", updates)
    k = index.shape[-1] if index.ndim else 0
    if index.ndim < 1 or k > x.ndim or list(updates.shape) != list(index.shape[:-1]) + list(x.shape[k:]):
        raise ValueError(f"scatter_nd_add: updates must have shape index.shape[:-1] + x.shape[index.shape[-1]:] "
                         f"= {list(index.shape[:-1]) + list(x.shape[k:])}, got x {list(x.shape)}, index "
                         f"{list(index.shape)}, updates {list(updates.shape)}")
    xl = tuple(None if d < k else d for d in range(x.ndim))
    ul = (None,) * (index.ndim - 1) + xl[k:]
    return labels_result("scatter_nd_add", [x, index, updates], [xl, (None,) * index.ndim, ul], [xl],
                         [(x.shape, x.dtype)], linear=None)


@register_spmd_rule("index_fill")
def index_fill(x, index, axis, value, name=None):
    """``x`` with the slices at ``index`` along ``axis`` set to ``value``: that dim and the index R, the other dims
    keep their sharding."""
    check_spec("index_fill", "x", x)
    check_spec("index_fill", "index", index)
    xl = _along(x, axis)
    specs, labels = [x, index], [xl, (None,) * index.ndim]
    if isinstance(value, DistSpec):      # a 0-d tensor value, whole on every rank (its gradient summed)
        specs.append(value)
        labels.append((None,) * value.ndim)
    return labels_result("index_fill", specs, labels, [xl], [(x.shape, x.dtype)], linear=None)


@register_spmd_rule("permute")
def permute(input, dims):
    return transpose(input, dims)


@register_spmd_rule("index_put")
def index_put(x, indices, value, accumulate=False, name=None):
    check_spec("index_put", "x", x)
    specs = [x] + [s for s in indices] + ([value] if isinstance(value, DistSpec) else [])
    return SpmdResult(_replicated([s for s in specs if isinstance(s, DistSpec)]),
                      (DistSpec(x.mesh, tuple(Replicate() for _ in x.placements), x.shape, x.dtype),))


@register_spmd_rule("nonzero")
def nonzero(x, as_tuple=False):
    check_spec("nonzero", "x", x)
    return replicate_all("nonzero", [x], x.ndim if as_tuple else 1)


@register_spmd_rule("masked_select")
def masked_select(x, mask, name=None):
    return replicate_all("masked_select", [x, mask])


@register_spmd_rule("bincount")
def bincount(x, weights=None, minlength=0, name=None):
    return replicate_all("bincount", [x, weights])


@register_spmd_rule("unique")
def unique(x, return_index=False, return_inverse=False, return_counts=False, axis=None, dtype="int64",
           sorted=True, name=None):
    check_spec("unique", "x", x)
    return replicate_all("unique", [x], 1 + bool(return_index) + bool(return_inverse) + bool(return_counts))
