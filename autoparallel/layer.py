"""shard_layer: distribute an ordinary paddle Layer's parameters over a mesh (paddle's convention).

``shard_fn(name, sublayer, mesh)`` replaces the parameters it wants sharded
(``sublayer.weight = ap.shard_tensor(sublayer.weight, mesh, [...])``); every parameter left plain is
replicated. A parameter held by several layers (tied weights) stays one parameter: sharding it through one
holder repoints every holder (two holders asking for different layouts is a ``TiedLayoutError``).
``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` become forward hooks.
"""
from __future__ import annotations

from autoparallel import dispatch_handle
from autoparallel.dist_tensor import is_dist, shard_tensor
from autoparallel.mesh import ProcessMesh
from autoparallel.placement import Replicate


def replicate_remaining(layer, mesh: ProcessMesh) -> None:
    """Replicate every parameter of ``layer`` that is not distributed yet (tied parameters stay tied); ops its
    sublayers captured before dispatch was installed are repointed (aliases.repoint_layer_ops)."""
    from autoparallel.aliases import repoint_layer_ops
    from autoparallel.isinstance_lint import warn_tensor_tests

    repoint_layer_ops(layer)
    warn_tensor_tests(layer)
    done = {}
    for _, sub in layer.named_sublayers(include_self=True):
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            if is_dist(p):
                done[id(p)] = p
                continue
            if id(p) not in done:
                done[id(p)] = shard_tensor(p, mesh, [Replicate()] * mesh.ndim)
            sub._parameters[pname] = done[id(p)]


def shard_layer(layer, mesh: ProcessMesh, shard_fn=None, input_fn=None, output_fn=None):
    """Distribute ``layer`` over ``mesh`` in place and return it."""
    import paddle

    if not isinstance(layer, paddle.nn.Layer):
        raise TypeError(f"shard_layer expects a paddle.nn.Layer, got {type(layer).__name__}")
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"shard_layer expects a ProcessMesh, got {type(mesh).__name__}")
    for name, fn, form in (("shard_fn", shard_fn, "(name, sublayer, mesh)"), ("input_fn", input_fn, "(inputs, mesh)"),
                           ("output_fn", output_fn, "(outputs, mesh)")):
        if fn is not None and not callable(fn):
            raise TypeError(f"shard_layer: {name} must be a callable {form} or None, got {type(fn).__name__}")
    from autoparallel.parallel.model_families import check_built_split

    check_built_split(layer, "shard_layer")     # a model that split itself (fleet mpu layers) is not split twice
    dispatch_handle.install()
    from autoparallel.watchdog import start_default

    start_default()                            # a real job names a lost, frozen or mismatched rank (as parallelize)
    from autoparallel.parallel.ties import check_replaced, holders, repoint

    before = holders(layer)
    if shard_fn is not None:
        for name, sub in layer.named_sublayers(include_self=True):
            shard_fn(name, sub, mesh)
    repoint(layer, before)                     # a tied parameter sharded through one holder: all holders see it
    replicate_remaining(layer, mesh)
    check_replaced(layer, before)
    from autoparallel.parallel.cross_ties import join

    join(layer, before, repoint(layer, before))  # a parameter shared with a model distributed earlier
    from autoparallel.parallel.stale_optimizers import replaced_params, repoint_optimizers

    repoint_optimizers(replaced_params(before))
    from autoparallel.parallel.builds import remember_sharded

    remember_sharded(layer)                    # shard_optimizer(ShardingStage3) finds the model from its parameters
    if input_fn is not None:
        layer.register_forward_pre_hook(lambda _layer, inputs: input_fn(inputs, mesh))
    if output_fn is not None:
        layer.register_forward_post_hook(lambda _layer, inputs, outputs: output_fn(outputs, mesh))
    return layer
