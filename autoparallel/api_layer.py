"""Layer, optimizer-scaler and static-graph entry points in paddle.distributed's call forms.

    ap.shard_layer(layer, process_mesh, shard_fn=None, input_fn=None, output_fn=None)
    ap.to_static(layer, loader=None, loss=None, optimizer=None, strategy=None, input_spec=None)
    ap.shard_scaler(scaler)

This project's own keyword names stay accepted (``shard_layer(layer, mesh=...)``,
``to_static(model=..., loss_fn=...)``); giving both spellings of one argument is an error.
"""
from __future__ import annotations

from autoparallel.core.mesh import as_mesh

__all__ = ["shard_layer", "to_static", "shard_scaler"]

_UNSET = object()


def _one(name: str, ours: str, a, b, where: str):
    """The value of an argument that has paddle's name ``name`` and this project's name ``ours``."""
    if a is not _UNSET and b is not _UNSET:
        raise TypeError(f"{where}: {name}= and {ours}= are the same argument; give one")
    return b if a is _UNSET else a


def shard_layer(layer, process_mesh=_UNSET, shard_fn=None, input_fn=None, output_fn=None, *, mesh=_UNSET):
    """paddle's ``dist.shard_layer``: ``shard_fn(name, sublayer, process_mesh)`` lays out parameters, the rest
    are replicated; ``input_fn(inputs, process_mesh)`` / ``output_fn(outputs, process_mesh)`` become hooks."""
    from autoparallel.layer import shard_layer as build

    m = _one("process_mesh", "mesh", process_mesh, mesh, "shard_layer")
    if m is _UNSET:
        raise TypeError("shard_layer() missing the mesh: shard_layer(layer, process_mesh, shard_fn=None, ...)")
    return build(layer, as_mesh(m), shard_fn, input_fn, output_fn)


def to_static(layer=_UNSET, loader=None, loss=_UNSET, optimizer=None, strategy=None, input_spec=None, *,
              model=_UNSET, loss_fn=_UNSET, **options):
    """paddle's ``dist.to_static(layer, loader, loss, optimizer, strategy, input_spec)`` -> ``DistModel``.
    ``strategy`` may be an ``ap.Strategy`` or a ``paddle.distributed.Strategy`` (converted field by field, see
    ``autoparallel/api_strategy.py``). ``options``: this project's keywords (mesh, annotations, tp_plan, cluster,
    method)."""
    from autoparallel.graph.to_static import to_static as build

    net = _one("layer", "model", layer, model, "to_static")
    if net is _UNSET:
        raise TypeError("to_static() missing the layer: to_static(layer, loader, loss, optimizer, strategy)")
    fn = _one("loss", "loss_fn", loss, loss_fn, "to_static")
    from autoparallel.api_strategy import as_strategy

    strategy = as_strategy(strategy)
    input_spec = _flat_input_spec(input_spec, fn is not _UNSET and fn is not None)
    if strategy is not None and getattr(strategy, "__dict__", {}).get("_paddle_state", {}).get("pipeline.enable"):
        raise NotImplementedError("ap.to_static cannot honour strategy.pipeline.enable=True (the captured graph runs "
                                  "one stage; honoured by ap.parallelize or ap.DataParallel + ap.Optimizer)")
    return build(net, loader, None if fn is _UNSET else fn, optimizer, strategy, input_spec, **options)


def _is_spec_entry(x) -> bool:
    """One field's spec: an InputSpec / DistSpec (anything with shape and dtype) or a (shape, dtype) pair."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return True
    return isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], (list, tuple))


def _flat_input_spec(input_spec, has_loss: bool):
    """paddle's ``input_spec=[inputs_spec, labels_spec]`` (two lists of InputSpec) as this project's flat list of
    fields; without a loss the labels are not fed (paddle's predict). The flat form passes through."""
    if not isinstance(input_spec, (list, tuple)) or len(input_spec) != 2:
        return input_spec
    groups = [g for g in input_spec if isinstance(g, (list, tuple)) and all(_is_spec_entry(e) for e in g)
              and not _is_spec_entry(g)]
    if len(groups) != 2:
        return input_spec
    inputs, labels = groups
    return list(inputs) + (list(labels) if has_loss else [])


def shard_scaler(scaler):
    """paddle's ``dist.shard_scaler``: the loss scaler for distributed training. ``paddle.amp.GradScaler`` already
    handles distributed losses and every ap optimizer here (its found-inf flag is agreed by all ranks:
    parallel/amp_scaler.py), so the scaler is returned as is once that support is installed."""
    import paddle

    from autoparallel.parallel import amp_scaler

    if not isinstance(scaler, paddle.amp.GradScaler):
        raise TypeError(f"shard_scaler expects a paddle.amp.GradScaler, got {type(scaler).__name__}")
    amp_scaler.install()
    return scaler
