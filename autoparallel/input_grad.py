"""A model input that needs its gradient (input saliency, an R1 penalty, adversarial examples), laid out by the
model's own input sharding (``ap.parallelize`` / ``ap.DataParallel``: the plain global batch sharded on its
batch dim).

``ap.shard_tensor`` makes a new leaf, as paddle's ``dist.shard_tensor`` does; applied silently to such an input
it would leave ``x.grad`` empty and ``paddle.grad(out, [x])`` without a path. Here the layout is an autograd
op instead: forward slices each held rank's shard; backward gathers the shards' gradients into the gradient
of the whole input on every rank (an all_gather over the sharded mesh dims; every rank runs it, as every
rank's input needs a gradient), so ``x.grad`` and ``paddle.grad`` read what one process reads. Under
``create_graph=True`` the gather is itself differentiable (comm/collectives.py), so a penalty on the input
gradient trains the model.
"""
from __future__ import annotations

import paddle
from paddle.autograd import PyLayer

from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import DistTensor, _spec_for, reshard
from autoparallel.local_parts import _local_from_full
from autoparallel.placement import Replicate


class _ShardInput(PyLayer):
    @staticmethod
    def forward(ctx, x, spec, ranks):
        ctx.spec, ctx.ranks = spec, ranks
        return tuple(_local_from_full(x, spec, r).contiguous() for r in ranks)

    @staticmethod
    def backward(ctx, *gs):
        return _whole_gradient(ctx.spec, ctx.ranks, gs)


def _whole_gradient(spec, ranks, gs):
    grads = {r: g if g is not None else paddle.zeros(list(spec.local_shape(r)), spec.dtype) for r, g in zip(ranks, gs)}
    whole = reshard(DistTensor(grads, spec), spec.mesh, [Replicate()] * spec.mesh.ndim)
    if current_world().is_simulated:
        from autoparallel.comm.collectives import pick_replicated
        return pick_replicated(whole._locals)
    return whole.local


def shard_input(x: paddle.Tensor, mesh, placements) -> DistTensor:
    """``ap.shard_tensor(x, mesh, placements)`` that keeps ``x`` in the autograd graph (``x.stop_gradient`` is
    False); any other tensor goes through ``shard_tensor`` unchanged."""
    from autoparallel.dist_tensor import shard_tensor

    if x.stop_gradient or not paddle.is_grad_enabled():
        return shard_tensor(x, mesh, placements)
    spec = _spec_for(x.shape, x.dtype, mesh, placements)
    ranks = current_world().local_ranks(mesh.process_ids)
    outs = _ShardInput.apply(x, spec, ranks)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return DistTensor(dict(zip(ranks, outs)), spec)
