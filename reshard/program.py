"""What each step of a reshard plan runs on every communication group, compiled once per plan.

The planner chose each step's ``Collective``; this module adds what the runtime needs besides the data, from
the specs before and after the step: the ranks of every group of the step's mesh dim and the collective's
arguments for that group (tensor dims, every member's chunk size -- uneven shards included -- and the reduce
type). It checks that the placements fit the collective and never picks another one. Pure: no paddle.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from autoparallel.core.collective import Collective
from autoparallel.core.placement import BlockShard, Partial, Replicate, Shard, chunk_sizes
from autoparallel.core.spec import DistSpec


@dataclass(frozen=True)
class StepProgram:
    """One step ready to run. ``form``: its row of ``CALLS``, ``(collective, placement type before, type after)``
    (None for ``SEND_RECV`` and when nothing changes). ``calls``: ``((group ranks, arguments), ...)`` for a step on one mesh dim (empty:
    nothing moves); for ``SEND_RECV``, ``((pairs, receive shapes),)`` with ``(source, destination)`` pairs."""

    collective: Collective
    mesh_dim: int
    before: DistSpec
    after: DistSpec
    form: tuple
    calls: tuple


def compile_plan(plan) -> tuple:
    """The ``StepProgram`` of every step of a ``ReshardPlan``, in order."""
    out, spec = [], plan.src_spec
    for step in plan.steps:
        if step.collective == Collective.SEND_RECV:
            before = DistSpec(step.src_mesh, step.src, spec.shape, spec.dtype)
            after = DistSpec(step.dst_mesh, step.dst, spec.shape, spec.dtype)
            out.append(StepProgram(step.collective, step.mesh_dim, before, after, None, (send_calls(before, after),)))
        else:
            before, after = spec.with_placements(step.src), DistSpec(spec.mesh, step.dst, spec.shape, spec.dtype)
            form, calls = group_calls(step.collective, before, after, step.mesh_dim)
            out.append(StepProgram(step.collective, step.mesh_dim, before, after, form, calls))
        spec = after
    return tuple(out)


def _extent(spec: DistSpec, coords, dim: int) -> int:
    a, b = spec.local_range(coords, dim)
    return b - a


# (collective, placement type before, type after) -> arguments of one group: f(p, q, before, after, coords, n).
# A placement with its own layout (say, blocks) adds its rows here and in reshard_exec.GROUP_EXECUTORS.
CALLS = {
    (Collective.SLICE, Replicate, Shard): lambda p, q, b, a, c, n: (q.dim, chunk_sizes(_extent(b, c, q.dim), n)),
    (Collective.ALL_GATHER, Shard, Replicate): lambda p, q, b, a, c, n: (p.dim, chunk_sizes(_extent(a, c, p.dim), n)),
    (Collective.ALL_REDUCE, Partial, Replicate): lambda p, q, b, a, c, n: (p.reduce_type,),
    (Collective.REDUCE_SCATTER, Partial, Shard): lambda p, q, b, a, c, n: (
        q.dim, chunk_sizes(_extent(b, c, q.dim), n), p.reduce_type),
    (Collective.ALL_TO_ALL, Shard, Shard): lambda p, q, b, a, c, n: (
        p.dim, q.dim, chunk_sizes(_extent(a, c, p.dim), n), chunk_sizes(_extent(b, c, q.dim), n)),
    (Collective.LOCAL, Replicate, Partial): lambda p, q, b, a, c, n: (q.reduce_type,),
    (Collective.SLICE, Replicate, BlockShard): lambda p, q, b, a, c, n: (q.dim, q.blocks, n),
    (Collective.ALL_GATHER, BlockShard, Replicate): lambda p, q, b, a, c, n: (p.dim, p.blocks, n),
}


def step_form(collective, p, q, i: int) -> tuple:
    """The row of ``CALLS`` a step runs: ``(collective, type(p), type(q))``; a ValueError if it has none."""
    form = (Collective.of(collective), type(p), type(q))
    if form not in CALLS:
        known = [f"{_kind(k[1])} -> {_kind(k[2])}" for k in CALLS if k[0] == form[0]]
        raise ValueError(f"{form[0]} on mesh dim {i} runs on {' or '.join(known) or 'no single mesh dim'}, "
                         f"got {p} -> {q}")
    return form


def group_calls(collective, before: DistSpec, after: DistSpec, i: int) -> tuple:
    """``(form, ((group ranks, arguments), ...))`` for every group of mesh dim ``i`` (the specs differ on ``i``
    only); no calls when nothing moves."""
    p, q = before.placements[i], after.placements[i]
    if p == q:
        return None, ()
    for spec, pl in ((before, p), (after, q)):
        if isinstance(pl, Shard) and any(j > i for j in spec.shard_mesh_dims(pl.dim)):
            raise ValueError(f"mesh dim {i} is not the innermost splitter of tensor dim {pl.dim} in "
                             f"{spec.placements}: nested shards change from the innermost mesh dim outwards")
    form = step_form(collective, p, q, i)
    mesh = before.mesh
    n = mesh.shape[i]
    if n == 1:              # one member: its shard is the whole extent and a reduction of one term is itself
        return form, ()
    args = CALLS[form]
    return form, tuple((tuple(ranks), args(p, q, before, after, mesh.coords_of(ranks[0]), n))
                       for ranks in mesh.all_groups(i))


def _kind(cls) -> str:
    return {Replicate: "R", Shard: "S(d)", Partial: "P", BlockShard: "S(d,blocks=..)"}.get(cls, cls.__name__)


def send_calls(before: DistSpec, after: DistSpec) -> tuple:
    """``(pairs, receive shapes)``: every shard goes to the rank at the same coordinate of ``after.mesh``."""
    src, dst = before.mesh, after.mesh
    if src.shape != dst.shape and _replicated(before) and _replicated(after):
        return whole_pairs(src.process_ids, dst.process_ids), {d: tuple(before.shape) for d in dst.process_ids}
    if src.shape != dst.shape or before.placements != after.placements:
        raise NotImplementedError(f"direct cross-mesh transfer needs equal mesh shapes and placements, got "
                                  f"{src.shape} {before.placements} -> {dst.shape} {after.placements}")
    pairs, shapes = [], {}
    for coords in itertools.product(*[range(s) for s in src.shape]):
        s, d = src.rank_at(coords), dst.rank_at(coords)
        pairs.append((s, d))
        shapes[d] = before.local_shape(coords)
    return tuple(pairs), shapes


def _replicated(spec: DistSpec) -> bool:
    return all(isinstance(p, Replicate) for p in spec.placements)


def whole_pairs(src_ids, dst_ids) -> tuple:
    """``(source, destination)`` pairs moving a whole (replicated) tensor between meshes of different shapes:
    a destination rank that is also a source rank keeps its own copy (no message); any other destination rank
    at flat position k receives from source flat position k % source size."""
    own = set(src_ids)
    return tuple((r if r in own else src_ids[k % len(src_ids)], r) for k, r in enumerate(dst_ids))
