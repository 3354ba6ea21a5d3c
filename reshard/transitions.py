"""The edges of the reshard state graph.

A state is a tuple with one placement per mesh dim. Every transition changes ONE mesh dim ``i``:

    R     -> S(d)    slice           local, free. Only if no mesh dim j > i shards d: mesh dim i becomes the
                                     innermost splitter of d (nested sharding, see autoparallel/spec.py).
    S(d)  -> R       all_gather      only if no mesh dim j > i shards d (i is the innermost splitter of d).
    S(a)  -> S(b)    all_to_all      only if no mesh dim j > i shards a (i innermost for a) or b.
    P     -> R       all_reduce
    P     -> S(d)    reduce_scatter  only if no mesh dim j > i shards d.
    R     -> S(d,blocks=..)  slice   local, free; only to the destination's BlockShard on that mesh dim, and
                                     only if no other mesh dim splits d (a block-sharded dim is never nested).
    S(d,blocks=..) -> R  all_gather  all_gather + a local reorder of the blocks (priced as the all_gather).
    R     -> P(op)   local           free: the value becomes pending terms of a reduction (the runtime keeps it on
                                     coordinate 0 and zeros elsewhere for sum; avg/max/min keep it on every rank).

There is no S -> P and no P(a) -> P(b) edge: those paths go through R. R -> P(op) only targets the
destination's partial on that mesh dim (creating any other partial is never cheaper), and never creates a
state holding two different reduce types. Composite paths such as S(a) -> R -> S(b) (all_gather + slice)
arise from these edges; the search prices them against the direct all_to_all.

A mesh dim of size 1 follows the same rules; its steps cost 0 (the cost formulas price a group of one rank at 0)
and leave the local tensor unchanged.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from autoparallel.core.collective import Collective
from autoparallel.core.placement import BlockShard, Partial, Placement, Replicate, Shard

State = tuple  # tuple[Placement, ...], one per mesh dim

REPLICATE = Replicate()


def sharded_inside(state: State, i: int, d: int) -> bool:
    """Does a mesh dim after ``i`` shard tensor dim ``d``? (then ``i`` cannot slice or gather ``d``)."""
    return any(isinstance(p, Shard) and p.dim == d for p in state[i + 1:])


def partial_targets(dst: State) -> tuple:
    """Per mesh dim, the partial (or BlockShard) an R may turn into (the destination's there), or None."""
    return tuple(p if isinstance(p, (Partial, BlockShard)) else None for p in dst)


def split_elsewhere(state: State, i: int, d: int) -> bool:
    """Does a mesh dim other than ``i`` block-shard tensor dim ``d``? (then no other mesh dim may split d)"""
    return any(j != i and p.is_block_shard(d) for j, p in enumerate(state))


def reduce_types(state: State) -> set:
    return {p.reduce_type for p in state if isinstance(p, Partial)}


def _with(state: State, i: int, p: Placement) -> State:
    return state[:i] + (p,) + state[i + 1:]


def _may_add_partial(state: State, i: int, target: Optional[Partial]) -> bool:
    if not isinstance(target, Partial):
        return False
    others = reduce_types(state[:i] + state[i + 1:])
    return not others or others == {target.reduce_type}


def moves(state: State, mesh_shape: Sequence[int], ndim: int, targets: tuple) -> Iterator[tuple]:
    """Yield ``(Collective, mesh_dim, next_state)`` for every legal single-mesh-dim change of ``state``: the
    collective of a step is chosen here, once, and carried by the plan to the runtime."""
    for i, p in enumerate(state):
        if isinstance(p, Replicate):
            for d in range(ndim):
                if not sharded_inside(state, i, d) and not split_elsewhere(state, i, d):
                    yield Collective.SLICE, i, _with(state, i, Shard(d))
            b = targets[i]
            if isinstance(b, BlockShard) and not any(j != i and (q.is_shard(b.dim) or q.is_block_shard(b.dim))
                                                     for j, q in enumerate(state)):
                yield Collective.SLICE, i, _with(state, i, b)
            if _may_add_partial(state, i, targets[i]):
                yield Collective.LOCAL, i, _with(state, i, targets[i])
        elif isinstance(p, Shard):
            if sharded_inside(state, i, p.dim):
                continue
            yield Collective.ALL_GATHER, i, _with(state, i, REPLICATE)
            for d in range(ndim):
                if d != p.dim and not sharded_inside(state, i, d) and not split_elsewhere(state, i, d):
                    yield Collective.ALL_TO_ALL, i, _with(state, i, Shard(d))
        elif isinstance(p, BlockShard):
            yield Collective.ALL_GATHER, i, _with(state, i, REPLICATE)
        else:  # Partial
            yield Collective.ALL_REDUCE, i, _with(state, i, REPLICATE)
            for d in range(ndim):
                if not sharded_inside(state, i, d) and not split_elsewhere(state, i, d):
                    yield Collective.REDUCE_SCATTER, i, _with(state, i, Shard(d))
