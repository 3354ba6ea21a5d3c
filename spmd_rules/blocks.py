"""Block-sharded inputs (``S(d,blocks=(..))``, placement.BlockShard) and the rules that understand them.

A rule marked ``@block_aware`` sees BlockShard placements and decides for them (label-based rules pass one
through like a Shard when every operand agrees; chunk/split and slicing along the blocked dim at block
boundaries keep the pieces local). Every other rule never sees one: the registry presents a block-sharded
input to it as replicated on that mesh dim, so the runtime gathers it (all_gather + reorder) before the op
— always correct, never a wrong value from a rule that assumes contiguous shards.
"""
from __future__ import annotations

from autoparallel.core.placement import BlockShard, Replicate, Shard
from autoparallel.core.spec import DistSpec


def block_aware(fn):
    """Mark a rule function as handling BlockShard placements itself."""
    fn._ap_block_aware = True
    return fn


def is_block_aware(fn) -> bool:
    return bool(getattr(fn, "_ap_block_aware", False))


def has_blocks(specs) -> bool:
    return any(isinstance(p, BlockShard) for s in specs if isinstance(s, DistSpec) for p in s.placements)


def unblock(spec: DistSpec) -> DistSpec:
    """``spec`` with every BlockShard replaced by Replicate."""
    if not has_blocks([spec]):
        return spec
    return spec.with_placements(tuple(Replicate() if isinstance(p, BlockShard) else p for p in spec.placements))


def aligned_pieces(blocks, starts_stops):
    """For pieces ``[(start, stop), ..]`` of a dim made of ``blocks``: per piece the blocks it covers
    (a tuple of sizes), or None when some piece does not start and end on block boundaries."""
    bounds, acc = [0], 0
    for b in blocks:
        acc += b
        bounds.append(acc)
    out = []
    for a, b in starts_stops:
        if a not in bounds or b not in bounds or b <= a:
            return None
        out.append(tuple(blocks[bounds.index(a):bounds.index(b)]))
    return out


def piece_placement(dim: int, sub_blocks) -> object:
    """A piece made of one whole block is an ordinary Shard; of several, a BlockShard of those blocks."""
    return Shard(dim) if len(sub_blocks) == 1 else BlockShard(dim, tuple(sub_blocks))


def local_bounds(blocks, n: int, sub_range) -> tuple:
    """(start, stop) in a member's local rows of the blocks ``sub_range`` (a range of block indices)."""
    start = sum(b // n for b in blocks[:sub_range.start])
    return start, start + sum(b // n for b in blocks[sub_range.start:sub_range.stop])
