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
from autoparallel.core.placement import Partial, Replicate, Shard, chunk_sizes
from autoparallel.core.spec import DistSpec


@dataclass(frozen=True)
class StepProgram:
    """One step ready to run. ``calls``: ``((group ranks, arguments), ...)`` for a step on one mesh dim (empty:
    nothing moves); for ``SEND_RECV``, ``((pairs, receive shapes),)`` with ``(source, destination)`` pairs."""

    collective: Collective
    mesh_dim: int
    before: DistSpec
    after: DistSpec
    calls: tuple


def compile_plan(plan) -> tuple:
    """The ``StepProgram`` of every step of a ``ReshardPlan``, in order."""
    out, spec = [], plan.src_spec
    for step in plan.steps:
        if step.collective == Collective.SEND_RECV:
            before = DistSpec(step.src_mesh, step.src, spec.shape, spec.dtype)
            after = DistSpec(step.dst_mesh, step.dst, spec.shape, spec.dtype)
            out.append(StepProgram(step.collective, step.mesh_dim, before, after, (send_calls(before, after),)))
        else:
            before, after = spec.with_placements(step.src), DistSpec(spec.mesh, step.dst, spec.shape, spec.dtype)
            calls = group_calls(step.collective, before, after, step.mesh_dim)
            out.append(StepProgram(step.collective, step.mesh_dim, before, after, calls))
        spec = after
    return tuple(out)


def _extent(spec: DistSpec, coords, dim: int) -> int:
    a, b = spec.local_range(coords, dim)
    return b - a


# collective -> ((placement kind before, kind after), arguments of one group: f(p, q, before, after, coords, n))
_CALLS = {
    Collective.SLICE: ((Replicate, Shard), lambda p, q, b, a, c, n: (q.dim, chunk_sizes(_extent(b, c, q.dim), n))),
    Collective.ALL_GATHER: ((Shard, Replicate), lambda p, q, b, a, c, n: (p.dim, chunk_sizes(_extent(a, c, p.dim), n))),
    Collective.ALL_REDUCE: ((Partial, Replicate), lambda p, q, b, a, c, n: (p.reduce_type,)),
    Collective.REDUCE_SCATTER: ((Partial, Shard), lambda p, q, b, a, c, n: (
        q.dim, chunk_sizes(_extent(b, c, q.dim), n), p.reduce_type)),
    Collective.ALL_TO_ALL: ((Shard, Shard), lambda p, q, b, a, c, n: (
        p.dim, q.dim, chunk_sizes(_extent(a, c, p.dim), n), chunk_sizes(_extent(b, c, q.dim), n))),
    Collective.LOCAL: ((Replicate, Partial), lambda p, q, b, a, c, n: (q.reduce_type,)),
}


def group_calls(collective, before: DistSpec, after: DistSpec, i: int) -> tuple:
    """``((group ranks, arguments), ...)`` for every group of mesh dim ``i``; the specs differ on ``i`` only."""
    p, q = before.placements[i], after.placements[i]
    if p == q:
        return ()
    for spec, pl in ((before, p), (after, q)):
        if isinstance(pl, Shard) and any(j > i for j in spec.shard_mesh_dims(pl.dim)):
            raise ValueError(f"mesh dim {i} is not the innermost splitter of tensor dim {pl.dim} in "
                             f"{spec.placements}: nested shards change from the innermost mesh dim outwards")
    if collective not in _CALLS:
        raise ValueError(f"{collective} does not change one mesh dim; expected one of {[c.value for c in _CALLS]}")
    (kind_p, kind_q), args = _CALLS[collective]
    if not (isinstance(p, kind_p) and isinstance(q, kind_q)):
        raise ValueError(f"a {collective} step on mesh dim {i} turns {_kind(kind_p)} into {_kind(kind_q)}, "
                         f"got {p} -> {q}")
    mesh = before.mesh
    n = mesh.shape[i]
    if n == 1:              # one member: its shard is the whole extent and a reduction of one term is itself
        return ()
    return tuple((tuple(ranks), args(p, q, before, after, mesh.coords_of(ranks[0]), n))
                 for ranks in mesh.all_groups(i))


def _kind(cls) -> str:
    return {Replicate: "R", Shard: "S(d)", Partial: "P"}[cls]


def send_calls(before: DistSpec, after: DistSpec) -> tuple:
    """``(pairs, receive shapes)``: every shard goes to the rank at the same coordinate of ``after.mesh``."""
    src, dst = before.mesh, after.mesh
    if src.shape != dst.shape or before.placements != after.placements:
        raise NotImplementedError(f"direct cross-mesh transfer needs equal mesh shapes and placements, got "
                                  f"{src.shape} {before.placements} -> {dst.shape} {after.placements}")
    pairs, shapes = [], {}
    for coords in itertools.product(*[range(s) for s in src.shape]):
        s, d = src.rank_at(coords), dst.rank_at(coords)
        pairs.append((s, d))
        shapes[d] = before.local_shape(coords)
    return tuple(pairs), shapes
