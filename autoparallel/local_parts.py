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
            t = _rows(t, list(s), d)
        elif s.start != 0 or s.stop != spec.shape[d]:
            t = paddle.slice(t, axes=[d], starts=[s.start], ends=[s.stop])
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial) and p.reduce_type == "sum" and coords[i] != 0:
            return paddle.zeros_like(t)
    return t.clone()              # never a view: replicas must not share storage


def _rows(t: paddle.Tensor, index: list, d: int) -> paddle.Tensor:
    """``t``'s rows ``index`` along dim ``d``: one slice per contiguous run, joined. Not index_select, which has
    no CPU kernel for float16 / int8 / uint8 / int16 (a float16 model's fused projection failed to shard)."""
    runs = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    parts = [paddle.slice(t, axes=[d], starts=[a], ends=[b]) for a, b in runs] or \
        [paddle.slice(t, axes=[d], starts=[0], ends=[0])]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=d)
