"""A rank's part of a full tensor under a DistSpec (shard_tensor's slicing; Partial(sum) on coordinate 0)."""
from __future__ import annotations

import paddle

from autoparallel.placement import Partial
from autoparallel.spec import DistSpec


def _local_from_full(full: paddle.Tensor, spec: DistSpec, rank: int) -> paddle.Tensor:
    coords = spec.mesh.coords_of(rank)
    sl = spec.local_slices(coords)
    t = full
    for d, s in enumerate(sl):
        if not isinstance(s, slice):                    # a block-sharded dim: its rows by index
            t = paddle.index_select(t, paddle.to_tensor(s, dtype="int64"), axis=d)
        elif s.start != 0 or s.stop != spec.shape[d]:
            t = paddle.slice(t, axes=[d], starts=[s.start], ends=[s.stop])
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_type == "sum" and coords[i] != 0:
            return paddle.zeros_like(t)
    return t.clone()              # never a view: replicas must not share storage
