"""``paddle.DataParallel`` over a model with distributed parameters is refused, naming the conflict.

A model parallelized here (``ap.parallelize`` / ``ap.DataParallel`` / ``ap.shard_layer``) already reduces its
gradients over the data axis. ``paddle.DataParallel`` on top of it would broadcast rank 0's parameters (every
tensor-parallel shard would become rank 0's shard) and all-reduce every gradient again across all ranks
(averaging different shards together); frameworks that wrap for you do it when they see several ranks:
hapi's ``paddle.Model`` (which also gives each rank its own part of the data, while the model here expects the
global batch on every rank) and PaddleFormers' ``Trainer``. The wrapping fails there with a
NotImplementedError saying what to use instead.
"""
from __future__ import annotations

from autoparallel import patches


def install() -> None:
    import paddle

    from autoparallel import collective_guard, fleet_guard

    collective_guard.install()          # the user's own paddle.distributed collectives on distributed tensors
    fleet_guard.install()               # fleet.distributed_model / distributed_optimizer over them
    cls = paddle.DataParallel
    orig = cls.__init__
    if getattr(orig, "_ap_wrapper", False):
        return

    def __init__(self, layers, *args, **kwargs):
        from autoparallel.dist_tensor import is_dist

        if isinstance(layers, paddle.nn.Layer) and any(is_dist(p) for p in layers.parameters()):
            raise NotImplementedError(
                f"paddle.DataParallel over {type(layers).__name__}, whose parameters are distributed by "
                f"autoparallel: its gradients are already reduced over the data axis, and DataParallel would "
                f"broadcast rank 0's shards and reduce every gradient again. Use the model itself (it has "
                f"no_sync() for gradient accumulation). hapi's paddle.Model and PaddleFormers' Trainer wrap a model "
                f"in paddle.DataParallel when launched on several ranks: run the training loop yourself there "
                f"(or ap.to_static)")
        return orig(self, layers, *args, **kwargs)

    __init__._ap_wrapper = True
    patches.patch(cls, "__init__", __init__)
