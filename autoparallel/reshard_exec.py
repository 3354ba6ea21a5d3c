"""Execute reshard plans on DistTensor locals: one step changes the placement of one mesh dim.

What a step does is derived from its (before, after) placements on that mesh dim, and the sizes every
member holds from the DistSpecs — uneven shards included — so the planner (reshard/) only chooses the
order; this module never guesses.
"""
from __future__ import annotations

from autoparallel.comm import collectives as C
from autoparallel.comm.world import current_world
from autoparallel.local_mode import local_mode
from autoparallel.core.placement import Partial, Replicate, Shard, chunk_sizes
from autoparallel.core.spec import DistSpec


def _extent(spec: DistSpec, coords, dim: int) -> int:
    a, b = spec.local_range(coords, dim)
    return b - a


def apply_step(locals_: dict, before: DistSpec, after: DistSpec, i: int, for_split=None) -> dict:
    """Move ``locals_`` from ``before`` to ``after``; the two differ on mesh dim ``i`` only. ``for_split``
    (a callback, or None): the result feeds ops split over mesh dim ``i``, so an all_gather's adjoint is a
    reduce_scatter of partial gradients (collectives.gather_for_split, told ``for_split`` when it runs)."""
    program = _PROGRAMS.get((before, after, i))
    if program is None:
        program = _step_program(before, after, i)
        if len(_PROGRAMS) >= _CACHE_LIMIT:
            _PROGRAMS.clear()
        _PROGRAMS[(before, after, i)] = program
    out = dict(locals_)
    if not program:
        return out
    world = current_world()
    for ranks, name, extra in program:
        members = [r for r in world.local_ranks(ranks) if r in locals_]
        if not members:
            continue
        if name is None:
            raise NotImplementedError(extra[0])
        held = {r: locals_[r] for r in members}
        if for_split is not None and name == "all_gather":
            out.update(C.gather_for_split(held, ranks, *extra, done=for_split))
        else:
            out.update(getattr(C, name)(held, ranks, *extra))
    return out


_PROGRAMS: dict = {}          # (before, after, mesh dim) -> its program (see _step_program)
_CACHE_LIMIT = 4096


def _step_program(before: DistSpec, after: DistSpec, i: int) -> tuple:
    """``((group ranks, collective name, extra arguments), ...)`` for every group of mesh dim ``i``: all a
    step needs besides the data, computed from the two specs once. Empty: nothing moves."""
    p, q = before.placements[i], after.placements[i]
    if p == q:
        return ()
    for spec, pl in ((before, p), (after, q)):
        if isinstance(pl, Shard) and any(j > i for j in spec.shard_mesh_dims(pl.dim)):
            raise ValueError(f"mesh dim {i} is not the innermost splitter of tensor dim {pl.dim} in "
                             f"{spec.placements}: nested shards change from the innermost mesh dim outwards")
    mesh = before.mesh
    n = mesh.shape[i]
    if n == 1:              # one member: its shard is the whole extent and a reduction of one term is itself
        return ()
    program = []
    for ranks in mesh.all_groups(i):
        c = mesh.coords_of(ranks[0])
        if isinstance(p, Replicate) and isinstance(q, Shard):
            step = "slice_shard", (q.dim, chunk_sizes(_extent(before, c, q.dim), n))
        elif isinstance(p, Shard) and isinstance(q, Replicate):
            step = "all_gather", (p.dim, chunk_sizes(_extent(after, c, p.dim), n))
        elif isinstance(p, Partial) and isinstance(q, Replicate):
            step = "all_reduce", (p.reduce_type,)
        elif isinstance(p, Partial) and isinstance(q, Shard):
            step = "reduce_scatter", (q.dim, chunk_sizes(_extent(before, c, q.dim), n), p.reduce_type)
        elif isinstance(p, Shard) and isinstance(q, Shard):
            step = "all_to_all", (p.dim, q.dim, chunk_sizes(_extent(after, c, p.dim), n),
                                  chunk_sizes(_extent(before, c, q.dim), n))
        elif isinstance(p, Replicate) and isinstance(q, Partial):
            step = "to_partial", (q.reduce_type,)
        else:                   # raised when some member is held (as a step with no held member does nothing)
            step = None, (f"no direct transition {p} -> {q} on mesh dim {i}; "
                          f"the reshard planner must route it through R",)
        program.append((ranks, step[0], step[1]))
    return tuple(program)


def apply_cross_mesh(locals_: dict, before: DistSpec, after: DistSpec) -> dict:
    """Send every shard to the rank at the same coordinate of ``after.mesh`` (same shape, same placements)."""
    src, dst = before.mesh, after.mesh
    if src.shape != dst.shape or before.placements != after.placements:
        raise NotImplementedError(f"direct cross-mesh transfer needs equal mesh shapes and placements, got "
                                  f"{src.shape} {before.placements} -> {dst.shape} {after.placements}")
    import itertools

    pairs, shapes = [], {}
    for coords in itertools.product(*[range(s) for s in src.shape]):
        s, d = src.rank_at(coords), dst.rank_at(coords)
        pairs.append((s, d))
        shapes[d] = before.local_shape(coords)
    world = current_world()
    mine = set(world.local_ranks(src.process_ids + [r for r in dst.process_ids if r not in src.process_ids]))
    pairs = [(s, d) for s, d in pairs if s in mine or d in mine]
    xs = {s: locals_[s] for s, _ in pairs if s in locals_}
    return C.send_recv(xs, pairs, shapes, before.dtype)


def execute(locals_: dict, plan, for_split=None) -> dict:
    """Run every step of a reshard plan (reshard.ReshardPlan) on plain local tensors. ``for_split``:
    {step index: callback} of S->R steps whose adjoint reduce-scatters (see ``apply_step``)."""
    with local_mode():
        return _execute(locals_, plan, for_split)


def _execute(locals_: dict, plan, for_split=None) -> dict:
    for j, (cross, before, after, i) in enumerate(_plan_specs(plan)):
        if cross:
            locals_ = apply_cross_mesh(locals_, before, after)
        else:
            locals_ = apply_step(locals_, before, after, i, for_split.get(j) if for_split else None)
    return locals_


def gathers_for_split(plan, dims) -> dict:
    """{mesh dim in ``dims``: index of its step} for every dim whose last step in ``plan`` is S -> R (it can
    take the reduce_scatter adjoint); later steps act on other mesh dims, whose adjoints are linear per
    group, so the gradient reaching the step is still a partial sum over the dim."""
    last = {}
    for j, (cross, before, after, i) in enumerate(_plan_specs(plan)):
        if cross:
            return {}
        last[i] = (j, before.placements[i], after.placements[i])
    return {m: last[m][0] for m in dims
            if m in last and isinstance(last[m][1], Shard) and isinstance(last[m][2], Replicate)}


_PLAN_SPECS: dict = {}        # id(plan) -> (plan, its steps as specs); the plan is kept so its id stays its own


def _plan_specs(plan) -> tuple:
    """``((cross mesh?, spec before, spec after, mesh dim), ...)`` for the steps of ``plan``."""
    hit = _PLAN_SPECS.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1]
    out, spec = [], plan.src_spec
    for step in plan.steps:
        if getattr(step, "src_mesh", None) is not None and step.mesh_dim < 0:
            nxt = DistSpec(step.dst_mesh, step.dst, spec.shape, spec.dtype)
            out.append((True, DistSpec(step.src_mesh, step.src, spec.shape, spec.dtype), nxt, step.mesh_dim))
        else:
            nxt = DistSpec(spec.mesh, step.dst, spec.shape, spec.dtype)
            out.append((False, spec.with_placements(step.src), nxt, step.mesh_dim))
        spec = nxt
    if len(_PLAN_SPECS) >= _CACHE_LIMIT:
        _PLAN_SPECS.clear()
    _PLAN_SPECS[id(plan)] = (plan, tuple(out))
    return tuple(out)
