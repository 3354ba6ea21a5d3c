"""Reductions: sum, mean, max, min (axis, keepdim), argmax, argmin.

A reduced axis that is sharded gives a Partial output: sum -> P(sum); mean -> P(sum) with the local op
``global_mean`` (local sum divided by the GLOBAL element count of the reduced axes, from
``local_attrs``); max -> P(max); min -> P(min) (the runtime's all_reduce(max/min) backward passes the
gradient to the rank holding the extreme value). Linear Partial inputs pass through sum and mean;
max/min/argmax need R. max/min never shard a reduced axis whose shards would be empty on some rank
(paddle cannot reduce an empty axis); argmax/argmin need the reduced axis whole.
"""
from __future__ import annotations

import itertools
import math

from autoparallel.core.placement import chunk_sizes
from autoparallel.core.spec import normalize_dtype

from spmd_rules.blocks import block_aware
from spmd_rules.einsum import ALL, label_reverse, labels_result
from spmd_rules.expand import expand_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec, norm_axes


def reduce_labels(x, axes, keepdim, *, reducible=True):
    """x labels (a reduced axis is unlabelled when ``reducible`` is False) and output labels/shape."""
    xl = tuple(d if (reducible or d not in axes) else None for d in range(x.ndim))
    out_l, out_s = [], []
    for d in range(x.ndim):
        if d in axes:
            if keepdim:
                out_l.append(None)
                out_s.append(1)
        else:
            out_l.append(d)
            out_s.append(x.shape[d])
    return xl, tuple(out_l), tuple(out_s)


def _reduction(op, x, axis, keepdim, *, reduce, linear, dtype=None):
    check_spec(op, "x", x)
    axes = norm_axes(op, axis, x.ndim)
    xl, ol, shape = reduce_labels(x, axes, keepdim)
    if reduce in ("max", "min"):
        # never shard an axis whose shards would be empty on some rank (one mesh dim or several nested)
        xl = tuple(None if (d in axes and _may_be_empty(x.shape[d], x.mesh.shape)) else lab
                   for d, lab in enumerate(xl))
    return labels_result(op, [x], [xl], [ol], [(shape, dtype or x.dtype)], linear=linear, reduce=reduce), axes


def _may_be_empty(n, mesh_shape) -> bool:
    """Whether sharding ``n`` items over any ordered subset of the mesh dims (S(d) on several mesh dims
    splits each chunk again) leaves some rank an empty chunk: [2] over 2x2 -> [1, 1] -> [1, 0, 1, 0]."""
    for r in range(1, len(mesh_shape) + 1):
        for dims in itertools.combinations(mesh_shape, r):
            sizes = [n]
            for k in dims:
                sizes = [c for s in sizes for c in chunk_sizes(s, k)]
            if 0 in sizes:
                return True
    return False


def _reverse(op, outputs, x, axis, keepdim, *, reduce, linear) -> SpmdResult:
    xl, ol, _ = reduce_labels(x, norm_axes(op, axis, x.ndim), keepdim)
    rule = label_reverse([xl], [ol], linear=linear, reduce=reduce)
    return SpmdResult(expand_reverse(op, [x], outputs, rule), outputs)


def _sum_reverse(outputs, x, axis=None, dtype=None, keepdim=False, name=None):
    return _reverse("sum", outputs, x, axis, keepdim, reduce="sum", linear=ALL)


@register_spmd_rule("sum", reverse=_sum_reverse)
@block_aware
def reduce_sum(x, axis=None, dtype=None, keepdim=False, name=None):
    return _reduction("sum", x, axis, keepdim, reduce="sum", linear=ALL, dtype=sum_dtype(x, dtype))[0]


def sum_dtype(x, dtype):
    """paddle's output dtype of a sum: ``dtype`` if given, else int64 for bool and small ints, else x's."""
    if dtype is not None:
        return normalize_dtype(dtype)
    return "int64" if x.dtype in ("bool", "int32", "int16", "int8", "uint8") else x.dtype


def _mean_reverse(outputs, x, axis=None, keepdim=False, name=None, *, dtype=None):
    return _reverse("mean", outputs, x, axis, keepdim, reduce="sum", linear=ALL)


@register_spmd_rule("mean", reverse=_mean_reverse)
@block_aware
def reduce_mean(x, axis=None, keepdim=False, name=None, *, dtype=None):
    out = normalize_dtype(dtype) if dtype is not None else None
    res, axes = _reduction("mean", x, axis, keepdim, reduce="sum", linear=ALL, dtype=out)
    req = res.inputs[0]
    if not any(req.shard_mesh_dims(a) or req.block_mesh_dim(a) is not None for a in axes):
        return res
    count = math.prod(x.shape[a] for a in axes)
    return SpmdResult(res.inputs, res.outputs, "global_mean", lambda coords: {"global_count": count})


def _extreme(op):
    def rule(x, axis=None, keepdim=False, name=None):
        return _reduction(op, x, axis, keepdim, reduce=op, linear=None)[0]

    def rev(outputs, x, axis=None, keepdim=False, name=None):
        return _reverse(op, outputs, x, axis, keepdim, reduce=op, linear=None)

    rule.__name__ = op
    block_aware(rule)                  # max/min of any split of the rows: the blocks' order does not matter
    register_spmd_rule(op, rule, reverse=rev)


_extreme("max")
_extreme("min")


def _arg(op):
    def rule(x, axis=None, keepdim=False, dtype="int64", name=None):
        check_spec(op, "x", x)
        axes = norm_axes(op, axis, x.ndim)
        xl, ol, shape = reduce_labels(x, axes, keepdim, reducible=False)
        if axis is None:
            shape = (1,) * x.ndim if keepdim else ()
            ol = (None,) * x.ndim if keepdim else ()
        return labels_result(op, [x], [xl], [ol], [(shape, normalize_dtype(dtype))], linear=None)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_arg("argmax")
_arg("argmin")
