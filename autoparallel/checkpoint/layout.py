"""Shard geometry: which rank owns which box of a tensor, and how boxes intersect.

A box is ``(offsets, shape)`` in global indices. Ownership de-duplicates replicas: among the ranks holding
the same box (they differ only in their coordinates on Replicate mesh dims), the one with coordinate 0 on
every such dim owns it. Shard mesh dims (nested or not) give disjoint boxes, so the owned boxes of a
tensor tile it exactly once. Partial placements are reduced to Replicate before saving (see save.py).
Empty boxes (uneven shards: 5 rows over 4 ranks gives 2, 2, 1, 0) own nothing. A block-sharded dim
(``S(d,blocks=..)``) gives each rank one box per block (its piece of that block): ``local_pieces`` pairs each
global box with the rows of the local tensor holding it, so files always hold the global (un-permuted) tensor.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from autoparallel.placement import BlockShard, Partial, Shard


def local_box(spec, rank: int) -> tuple:
    """The box of ``spec``'s tensor that ``rank`` holds."""
    coords = spec.mesh.coords_of(rank)
    ranges = [spec.local_range(coords, d) for d in range(spec.ndim)]
    return tuple(a for a, _ in ranges), tuple(b - a for a, b in ranges)


def local_pieces(spec, rank: int) -> list:
    """[(global offsets, shape, slices into the local tensor)] of what ``rank`` holds: one box, or one per
    block of a block-sharded dim."""
    coords = spec.mesh.coords_of(rank)
    d = next((p.dim for p in spec.placements if isinstance(p, BlockShard)), None)
    if d is None:
        off, shape = local_box(spec, rank)
        return [(off, shape, tuple(slice(0, n) for n in shape))]
    i = spec.block_mesh_dim(d)
    p, n = spec.placements[i], spec.mesh.shape[i]
    ranges = [(0, 0) if e == d else spec.local_range(coords, e) for e in range(spec.ndim)]
    out, start, lo = [], 0, 0
    for b in p.blocks:
        c = b // n
        rs = list(ranges)
        rs[d] = (start + coords[i] * c, start + (coords[i] + 1) * c)
        sl = [slice(0, bb - a) for a, bb in rs]
        sl[d] = slice(lo, lo + c)
        out.append((tuple(a for a, _ in rs), tuple(bb - a for a, bb in rs), tuple(sl)))
        start, lo = start + b, lo + c
    return out


def owned_pieces(spec) -> list:
    """[(rank, offsets, shape, local slices)] of the non-empty boxes each owner writes, in mesh order."""
    out = []
    for rank in spec.mesh.process_ids:
        if is_owner(spec, rank):
            out += [(rank, off, shape, sl) for off, shape, sl in local_pieces(spec, rank) if numel(shape)]
    return out


def is_owner(spec, rank: int) -> bool:
    if any(isinstance(p, Partial) for p in spec.placements):
        raise ValueError(f"ownership of a Partial tensor is undefined; reduce {spec} to Replicate first")
    coords = spec.mesh.coords_of(rank)
    return all(coords[i] == 0 for i, p in enumerate(spec.placements) if not isinstance(p, (Shard, BlockShard)))


def owned_boxes(spec) -> list:
    """[(rank, offsets, shape)] of the non-empty boxes each owner writes, in mesh order."""
    out = []
    for rank in spec.mesh.process_ids:
        if not is_owner(spec, rank):
            continue
        offsets, shape = local_box(spec, rank)
        if numel(shape) == 0:
            continue
        out.append((rank, offsets, shape))
    return out


def numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def intersect(a_off, a_shape, b_off, b_shape) -> Optional[tuple]:
    """The box common to two boxes, or None when they do not overlap."""
    off, shape = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def relative_slices(inner_off, inner_shape, outer_off) -> tuple:
    """Slices selecting box ``inner`` inside an array holding box ``outer``."""
    return tuple(slice(i - o, i - o + n) for i, n, o in zip(inner_off, inner_shape, outer_off))


def flat_range_boxes(shape, start: int, stop: int) -> list:
    """The elements ``[start, stop)`` of a C-order array of ``shape`` as boxes: [(offsets, shape, flat start)].

    A contiguous range of a flattened array is a partial first row, whole rows and a partial last row,
    recursively: at most ``2 * ndim - 1`` boxes, in flat order. (ZeRO keeps such ranges of a parameter's
    local data; as boxes they are stored and read like any shard.)
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= numel(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside an array of shape {list(shape)}")
    if start == stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = numel(shape[1:])
    row0, rem0 = divmod(start, inner)
    row1, rem1 = divmod(stop, inner)
    if row0 == row1:                                  # inside one row
        return [((row0,) + o, (1,) + s, row0 * inner + f)
                for o, s, f in flat_range_boxes(shape[1:], rem0, rem1)]
    out = []
    if rem0:
        out += [((row0,) + o, (1,) + s, row0 * inner + f)
                for o, s, f in flat_range_boxes(shape[1:], rem0, inner)]
        row0 += 1
    if row1 > row0:
        out.append(((row0,) + (0,) * (len(shape) - 1), (row1 - row0,) + shape[1:], row0 * inner))
    if rem1:
        out += [((row1,) + o, (1,) + s, row1 * inner + f)
                for o, s, f in flat_range_boxes(shape[1:], 0, rem1)]
    return out
