"""reshape, view, flatten — through dim transformations (dimtrans.py).

A sharded input dim keeps its sharding only where it is the outermost dim of its reshape group and its
chunks line up (see dimtrans.py); otherwise it is required R. Linear Partials pass. The local target
shape of reshape/view is rank-dependent with uneven shards: ``local_attrs(coords)`` gives it. A
block-sharded dim (``S(d,blocks=..)``) is kept only where the reshape leaves it untouched (``same_axis``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from autoparallel.core.placement import BlockShard, Shard
from autoparallel.core.spec import DistSpec, dtype_bytes, normalize_dtype

from spmd_rules.blocks import block_aware
from spmd_rules.dimtrans import infer_shape, reshape_transforms, shard_map
from spmd_rules.expand import expand, expand_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, is_linear_partial, norm_axis


def _rule_1d(in_shape, out_shape):
    transforms = reshape_transforms(in_shape, out_shape) if math.prod(in_shape) else None
    maps: dict = {}

    def rule(pl, dim):
        p = pl[0]
        if is_linear_partial(p):
            return (p,), (p,)
        if isinstance(p, Shard) and transforms is not None:
            m = maps.setdefault(dim.size, shard_map(in_shape, out_shape, transforms, dim.size))
            if p.dim in m:
                return (p,), (Shard(m[p.dim]),)
        if isinstance(p, BlockShard):
            e = same_axis(in_shape, out_shape, p.dim)
            if e is not None:
                return (p,), (BlockShard(e, p.blocks),)
        return (R,), (R,)

    def reverse(outs, dim):
        p = outs[0]
        if is_linear_partial(p):
            return (p,)
        if isinstance(p, Shard) and transforms is not None:
            m = maps.setdefault(dim.size, shard_map(in_shape, out_shape, transforms, dim.size))
            for i, o in m.items():
                if o == p.dim:
                    return (Shard(i),)
        return (R,)

    return rule, reverse


def same_axis(in_shape, out_shape, d: int):
    """The output dim that is input dim ``d`` unchanged (same size, same elements before it), or None: a
    block-sharded dim survives a reshape only untouched (not merged, not split)."""
    before = math.prod(in_shape[:d])
    for e in range(len(out_shape)):
        if math.prod(out_shape[:e]) == before and out_shape[e] == in_shape[d]:
            return e
    return None


def reshape_result(op, x, out_shape, shape_kw: str | None) -> SpmdResult:
    rule, _ = _rule_1d(tuple(x.shape), tuple(out_shape))
    required, outputs = expand(op, [x], [(out_shape, x.dtype)], rule)
    out = outputs[0]
    if shape_kw is None or not any(isinstance(p, (Shard, BlockShard)) for p in out.placements):
        return SpmdResult(required, outputs)
    return SpmdResult(required, outputs, None, lambda coords: {shape_kw: list(out.local_shape(coords))})


def _reshape_reverse(outputs, x, shape, name=None):
    _, rev = _rule_1d(tuple(x.shape), infer_shape("reshape", x.shape, shape))
    return SpmdResult(expand_reverse("reshape", [x], outputs, rev), outputs)


@register_spmd_rule("reshape", reverse=_reshape_reverse)
@block_aware
def reshape(x, shape, name=None):
    check_spec("reshape", "x", x)
    if isinstance(shape, DistSpec):
        raise NotImplementedError("reshape: a shape given as a tensor is not supported; pass python ints")
    return reshape_result("reshape", x, infer_shape("reshape", x.shape, shape), "shape")


@register_spmd_rule("view")
def view(x, shape_or_dtype, name=None):
    check_spec("view", "x", x)
    if isinstance(shape_or_dtype, (list, tuple)):
        res = reshape_result("view", x, infer_shape("view", x.shape, shape_or_dtype), "shape_or_dtype")
        # an uneven split can leave a rank an empty shard, which paddle's view kernel refuses
        return dataclasses.replace(res, local_op="view_shape") if res.local_attrs is not None else res
    dtype = normalize_dtype(shape_or_dtype)
    if dtype_bytes(dtype) != dtype_bytes(x.dtype):
        raise NotImplementedError(f"view: reinterpreting {x.dtype} as {dtype} changes the last dim; only "
                                  f"same-size dtypes are supported")
    plain = tuple(R if p.is_partial() else p for p in x.placements)
    req = x.with_placements(plain)
    return SpmdResult((req,), (DistSpec(x.mesh, plain, x.shape, dtype),))


def _flatten_shape(op, x, start_axis, stop_axis):
    if x.ndim == 0:
        return (1,)
    s = norm_axis(op, start_axis, x.ndim)
    e = norm_axis(op, stop_axis, x.ndim)
    if s > e:
        raise ValueError(f"{op}: start_axis {start_axis} must not be after stop_axis {stop_axis}")
    return tuple(x.shape[:s]) + (math.prod(x.shape[s:e + 1]),) + tuple(x.shape[e + 1:])


def _flatten_reverse(outputs, x, start_axis=0, stop_axis=-1, name=None):
    _, rev = _rule_1d(tuple(x.shape), _flatten_shape("flatten", x, start_axis, stop_axis))
    return SpmdResult(expand_reverse("flatten", [x], outputs, rev), outputs)


@register_spmd_rule("flatten", reverse=_flatten_reverse)
@block_aware
def flatten(x, start_axis=0, stop_axis=-1, name=None):
    check_spec("flatten", "x", x)
    res = reshape_result("flatten", x, _flatten_shape("flatten", x, start_axis, stop_axis), None)
    out, req = res.outputs[0], res.inputs[0]
    if x.ndim == 0 or all(_local_flatten(req.local_shape(c), x.ndim, start_axis, stop_axis) == out.local_shape(c)
                          for c in itertools.product(*[range(k) for k in x.mesh.shape])):
        return res
    # a sharded size-1 dim may stay a dim of its own in the layout while paddle's flatten merges it locally
    return SpmdResult(res.inputs, res.outputs, "reshape_to", lambda coords: {"shape": list(out.local_shape(coords))})


def _local_flatten(shape, ndim, start_axis, stop_axis) -> tuple:
    s, e = norm_axis("flatten", start_axis, ndim), norm_axis("flatten", stop_axis, ndim)
    return tuple(shape[:s]) + (math.prod(shape[s:e + 1]),) + tuple(shape[e + 1:])
