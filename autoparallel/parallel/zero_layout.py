"""Flat bucket layout of ZeRO: every parameter's local data flattened and cut into ceil-division chunks
over a shard group of ``g`` members; member k's buffer is the concatenation of its chunk of every
parameter of the bucket, padded to the longest member buffer ``width`` so that collectives see equal
sizes (rank-major layout: [member 0 | member 1 | ...], each ``width`` long).
"""
from __future__ import annotations

import math

import paddle

from autoparallel.placement import chunk_sizes


class BucketLayout:
    def __init__(self, numels, group_size: int):
        if group_size < 1:
            raise ValueError(f"shard group size must be >= 1, got {group_size}")
        self.numels = [int(n) for n in numels]
        self.g = group_size
        self.sizes = [chunk_sizes(n, group_size) for n in self.numels]          # [param][member]
        self.starts = [[sum(s[:k]) for k in range(group_size)] for s in self.sizes]
        self.lengths = [sum(s[k] for s in self.sizes) for k in range(group_size)]
        self.width = max(self.lengths) if self.lengths else 0
        self.offsets = [[sum(s[k] for s in self.sizes[:j]) for j in range(len(self.numels))]
                        for k in range(group_size)]                              # [member][param]

    def chunk(self, flat, j: int, k: int):
        """Member k's chunk of parameter j's flat data."""
        a = self.starts[j][k]
        return flat[a:a + self.sizes[j][k]]

    def _pad(self, parts, k, dtype):
        pad = self.width - self.lengths[k]
        if pad:
            parts = parts + [paddle.zeros([pad], dtype=dtype)]
        return paddle.concat(parts) if parts else paddle.zeros([0], dtype=dtype)

    def pack_member(self, chunks, k: int):
        """Member k's buffer (``width`` long) from its chunks of every parameter."""
        dtype = chunks[0].dtype if chunks else "float32"
        return self._pad(list(chunks), k, dtype)

    def pack_full(self, flats):
        """Every member's block (rank-major, ``g * width`` long) from full flat tensors."""
        dtype = flats[0].dtype
        blocks = [self._pad([self.chunk(f, j, k) for j, f in enumerate(flats)], k, dtype) for k in range(self.g)]
        return paddle.concat(blocks)

    def unpack_member(self, buf, k: int) -> list:
        return [buf[self.offsets[k][j]:self.offsets[k][j] + self.sizes[j][k]] for j in range(len(self.numels))]

    def unpack_full(self, buf) -> list:
        """Full flat tensors of every parameter from a rank-major buffer."""
        out = []
        for j in range(len(self.numels)):
            parts = [buf[k * self.width + self.offsets[k][j]:k * self.width + self.offsets[k][j] + self.sizes[j][k]]
                     for k in range(self.g) if self.sizes[j][k]]
            out.append(paddle.concat(parts) if parts else paddle.zeros([0], dtype=buf.dtype))
        return out


def split_buckets(params, limit_bytes: int):
    """Consecutive parameters (same dtype) in buckets of at most ``limit_bytes`` (one oversize param alone)."""
    buckets, cur, size, dtype = [], [], 0, None
    for p in params:
        nbytes = math.prod(p.shape) * p.element_size()
        if cur and (size + nbytes > limit_bytes or p.dtype != dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
        dtype = p.dtype
    if cur:
        buckets.append(cur)
    return buckets
