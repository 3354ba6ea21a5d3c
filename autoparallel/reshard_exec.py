"""Run reshard plans on DistTensor locals: each step's collective, looked up in an executor table.

The planner (``reshard/``) chose every step's ``Collective`` and ``ReshardPlan.program`` holds each step's
per-group arguments (sizes every member holds, uneven shards included), compiled once per plan; this module
only runs them on the groups whose shards this process holds: ``EXECUTORS[step.collective]``, and for a step
on one mesh dim ``GROUP_EXECUTORS[step.form]`` on each group. (``autoparallel.redistribute`` is the old name
of this module and stays importable.)
"""
from __future__ import annotations

from autoparallel import cross_mesh_grad
from autoparallel.comm import collectives as C
from autoparallel.comm.world import current_world
from autoparallel.core.collective import Collective
from autoparallel.core.placement import BlockShard, Partial, Replicate, Shard
from autoparallel.local_mode import local_mode


def _all_gather(held, ranks, args, for_split):
    if for_split is not None:          # feeds ops split over this mesh dim: the adjoint reduce-scatters
        return C.gather_for_split(held, ranks, *args, done=for_split)
    return C.all_gather(held, ranks, *args)


# ---- block-sharded layouts (S(d,blocks=..): fused projections) -------------------------------------------
def _reorder(t, axis, blocks, n):
    """Gathered member parts ``[b0_0 b1_0 .. | b0_1 b1_1 .. | ..]`` -> the global order ``[b0_0 b0_1 .. | b1_0 ..]``."""
    import paddle

    local, pieces, off = sum(blocks) // n, [], 0
    for b in blocks:
        c = b // n
        pieces += [paddle.slice(t, [axis], [j * local + off], [j * local + off + c]) for j in range(n)]
        off += c
    return paddle.concat(pieces, axis=axis)


def _block_slice_raw(xs, ranks, axis, blocks, n):
    import paddle

    out = {}
    for r, t in xs.items():
        j, pieces, start = ranks.index(r), [], 0
        for b in blocks:
            c = b // n
            pieces.append(paddle.slice(t, [axis], [start + j * c], [start + (j + 1) * c]))
            start += b
        out[r] = paddle.concat(pieces, axis=axis)
    return out


def _block_gather_raw(xs, ranks, axis, blocks, n):
    got = C._gather_raw(xs, ranks, axis, [sum(blocks) // n] * n)
    return {r: _reorder(t, axis, blocks, n) for r, t in got.items()}


def block_gather(xs, ranks, axis, blocks, n):
    """BlockShard -> R: all_gather the equal local parts, then put each block's pieces back in order
    (member j holds ``[b0_j | b1_j | ..]``). Adjoint: ``block_slice`` of the gradient."""
    return C._run(xs, lambda v: _block_gather_raw(v, ranks, axis, blocks, n),
                  lambda g: _block_slice_raw(g, ranks, axis, blocks, n))


def block_slice(xs, ranks, axis, blocks, n):
    """R -> BlockShard: member j keeps its piece of every block (no communication). Adjoint: ``block_gather``
    (a replicated tensor's gradient is whole on every rank)."""
    return C._run(xs, lambda v: _block_slice_raw(v, ranks, axis, blocks, n),
                  lambda g: _block_gather_raw(g, ranks, axis, blocks, n))


# step form (collective, placement type before, type after; see reshard.program.CALLS) -> what one group runs:
# f(held locals, group ranks, arguments, for_split callback or None)
GROUP_EXECUTORS = {
    (Collective.SLICE, Replicate, Shard): lambda held, ranks, args, _: C.slice_shard(held, ranks, *args),
    (Collective.ALL_GATHER, Shard, Replicate): _all_gather,
    (Collective.ALL_REDUCE, Partial, Replicate): lambda held, ranks, args, _: C.all_reduce(held, ranks, *args),
    (Collective.REDUCE_SCATTER, Partial, Shard): lambda held, ranks, args, _: C.reduce_scatter(held, ranks, *args),
    (Collective.ALL_TO_ALL, Shard, Shard): lambda held, ranks, args, _: C.all_to_all(held, ranks, *args),
    (Collective.LOCAL, Replicate, Partial): lambda held, ranks, args, _: C.to_partial(held, ranks, *args),
    (Collective.SLICE, Replicate, BlockShard): lambda held, ranks, args, _: block_slice(held, ranks, *args),
    (Collective.ALL_GATHER, BlockShard, Replicate): lambda held, ranks, args, _: block_gather(held, ranks, *args),
}


def run_groups(locals_: dict, step, for_split=None) -> dict:
    """Run a one-mesh-dim step (``reshard.StepProgram``) on every group holding a local shard."""
    out = dict(locals_)
    if not step.calls:
        return out
    run, world = GROUP_EXECUTORS[step.form], current_world()
    for ranks, args in step.calls:
        members = [r for r in world.local_ranks(ranks) if r in locals_]
        if members:
            out.update(run({r: locals_[r] for r in members}, ranks, args, for_split))
    return out


def send_to_mesh(locals_: dict, step, for_split=None) -> dict:
    """Send every shard to the rank at the same coordinate of the destination mesh (a ``SEND_RECV`` step)."""
    (pairs, shapes), = step.calls
    src, dst = step.before.mesh, step.after.mesh
    world = current_world()
    xs = {s: locals_[s] for s in src.process_ids if s in locals_}
    if world.is_simulated:        # the gradient goes back as on real ranks (cross_mesh_grad.grad_pairs)
        return cross_mesh_grad.sim_send(xs, pairs, shapes, step.before.dtype, src.process_ids, dst.process_ids)
    return cross_mesh_grad.real_send(xs, pairs, shapes, step.before.dtype, src.process_ids, dst.process_ids)


# Collective -> its executor: f(locals, StepProgram, for_split callback or None) -> locals
EXECUTORS = {**{form[0]: run_groups for form in GROUP_EXECUTORS}, Collective.SEND_RECV: send_to_mesh}


def execute(locals_: dict, plan, for_split=None) -> dict:
    """Run every step of a reshard plan (reshard.ReshardPlan) on plain local tensors. ``for_split``:
    {step index: callback} of all_gather steps whose adjoint reduce-scatters (see ``gathers_for_split``)."""
    with local_mode():
        for j, step in enumerate(plan.program):
            locals_ = EXECUTORS[step.collective](locals_, step, for_split.get(j) if for_split else None)
        return locals_


def gathers_for_split(plan, dims) -> dict:
    """{mesh dim in ``dims``: index of its step} for every dim whose last step in ``plan`` is an all_gather
    (S -> R: it can take the reduce_scatter adjoint); later steps act on other mesh dims, whose adjoints are
    linear per group, so the gradient reaching the step is still a partial sum over the dim."""
    last = {}
    for j, step in enumerate(plan.steps):
        if step.collective == Collective.SEND_RECV:
            return {}
        last[step.mesh_dim] = (j, step.collective, step.src[step.mesh_dim])
    return {m: last[m][0] for m in dims if m in last and last[m][1] == Collective.ALL_GATHER
            and isinstance(last[m][2], Shard)}          # a block gather reorders: it keeps its own adjoint
