"""Ops a vision-language model uses to place image tokens among text tokens.

``argwhere(x)``: the indices of the nonzero elements, a value-dependent size: like ``nonzero``, x is gathered
and the result replicated, its shape read from the local result (graph tracing raises
``DataDependentShapeError``).

``masked_scatter(x, mask, value)``: the positions where ``mask`` (broadcast to x) is True take the elements
of ``value`` in row-major order -- a vision-language model writing image features into the text embeddings
at the image-token positions.

Which element of ``value`` lands on a rank's shard of x depends on how many True values the mask holds
before that shard (a data-dependent offset). With x split over its dim 0 on one mesh dim (the batch, data
parallel) and a mask of x's shape, x and the mask keep that split, the values are R, and the runtime's
``sharded_masked_scatter`` finds each rank's offset with one tiny all_reduce of the per-rank counts
(``local_attrs()['row_mesh_dim']``); other mesh dims are gathered. Otherwise (a broadcast mask, dim 0
replicated or split over several mesh dims) every input is gathered to R and the output is replicated with x's
shape; the next op with a sharded operand slices it again locally. A Partial x or value is reduced first (the
op is not linear in x: the scattered positions would be summed once per rank).
"""
from __future__ import annotations

from autoparallel.core.placement import Replicate, Shard
from autoparallel.core.spec import DistSpec

from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.routing import replicate_all
from spmd_rules.utils import broadcast_shapes, check_spec


def _rep(s: DistSpec) -> DistSpec:
    return s.with_placements(tuple(Replicate() for _ in s.placements))


@register_spmd_rule("masked_scatter")
def masked_scatter(x, mask, value, name=None):
    for arg, v in (("x", x), ("mask", mask), ("value", value)):
        check_spec("masked_scatter", arg, v)
    if mask.dtype != "bool":
        raise TypeError(f"masked_scatter: mask must be bool, got {mask.dtype}")
    if value.dtype != x.dtype:
        raise TypeError(f"masked_scatter: value must have x's dtype {x.dtype}, got {value.dtype}")
    if broadcast_shapes("masked_scatter", x.shape, mask.shape) != tuple(x.shape):
        raise ValueError(f"masked_scatter: mask {list(mask.shape)} must broadcast to x {list(x.shape)}")
    rows = [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(rows) != 1 or tuple(mask.shape) != tuple(x.shape):
        return SpmdResult((_rep(x), _rep(mask), _rep(value)), (_rep(x),))
    split = x.with_placements(tuple(Shard(0) if m == rows[0] else Replicate() for m in range(len(x.placements))))
    return SpmdResult((split, mask.with_placements(split.placements), _rep(value)), (split,),
                      "sharded_masked_scatter", lambda coords: {"row_mesh_dim": rows[0]})


@register_spmd_rule("argwhere")
def argwhere(input):
    check_spec("argwhere", "input", input)
    return replicate_all("argwhere", [input])
