"""The op trace of a mixture of experts: spec-only everywhere but in the MoE layers, which run eagerly.

A MoE layer routes tokens with value-dependent shapes (``where`` / ``nonzero`` on the router's choice), which
a spec-only trace cannot follow. ``trace_moe(model, seq_len)`` traces the model as ``from_trace`` does, but each
MoE layer (a block's sublayer holding ``experts``) is swapped for a stand-in that runs the layer's own forward
eagerly on a random sample of the traced input's shape, on a one-rank mesh, counting the ops dispatch routes;
the trace records the layer as one ``moe_layer`` node whose outputs have the eager outputs' shapes, so the
rest of the forward (attention, norms, head, loss) is traced as usual. Returns the op profile with the eager
counts folded in, and the trace figures. The routing is the one the model's router makes on that sample; the
layer's FLOPs are the planner's MoE formulas (from the config), not measured.
A model whose parameters are not allocated (``paddle.LazyGuard``) cannot run a layer eagerly: ``LazyModel``.
"""
from __future__ import annotations

import contextlib

import numpy as np


class LazyModel(ValueError):
    """The MoE layers' parameters are not allocated, so they cannot run eagerly."""


def moe_layers(blocks) -> dict:
    """{block index: the block's sublayer holding an ``experts`` sublayer} (None when a block has none)."""
    out = {}
    for i, block in enumerate(blocks):
        for name, layer in block.named_sublayers():
            if name.rsplit(".", 1)[-1] == "experts":
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                out[i] = dict(block.named_sublayers(include_self=True))[parent]
                break
    return out


def _to_specs(value, mesh):
    """Eager outputs -> spec-only DistTensors of the same global shape and dtype (structure kept)."""
    from autoparallel.core.placement import Replicate
    from autoparallel.core.spec import DistSpec
    from autoparallel.dist_tensor import DistTensor

    if isinstance(value, DistTensor):
        spec = DistSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), tuple(value.shape), str(value.spec.dtype))
        return DistTensor({}, spec)
    if isinstance(value, tuple):
        return tuple(_to_specs(v, mesh) for v in value)
    if isinstance(value, list):
        return [_to_specs(v, mesh) for v in value]
    return value


class _StandIn:
    """Patches each MoE layer's forward; ``counts[i]`` is the eager op count of block i's layer."""

    def __init__(self, layers: dict):
        from autoparallel.comm.world import current_world

        import autoparallel as ap

        self.layers = layers
        self.counts = {}
        rank = getattr(current_world(), "rank", 0) or 0
        self.mesh = ap.ProcessMesh([rank], dim_names=["data"], create_groups=False)

    @contextlib.contextmanager
    def installed(self):
        for i, layer in self.layers.items():
            layer.forward = self._forward(i, layer.forward)
        try:
            yield self
        finally:
            for layer in self.layers.values():
                del layer.forward

    def _forward(self, i, original):
        def forward(x, *args, **kwargs):
            from autoparallel.dist_tensor import DistTensor
            from autoparallel.graph import trace as trace_state

            if any(isinstance(v, DistTensor) for v in list(args) + list(kwargs.values())):
                raise NotImplementedError(f"the MoE layer of block {i} takes more than one tensor input; its "
                                          f"stand-in runs it on a sample of its first input only")
            tracer = trace_state.active()
            out, self.counts[i] = self._eager(original, x, args, kwargs)
            specs = _to_specs(out, tracer.mesh)
            flat = [s for s in (specs if isinstance(specs, (tuple, list)) else [specs]) if isinstance(s, DistTensor)]
            node = tracer.record("moe_layer", [x], [x.spec], [s.spec for s in flat], [])
            for s in flat:
                tracer.producer[id(s)] = node
            return specs
        return forward

    def _eager(self, original, x, args, kwargs):
        import paddle

        import autoparallel as ap
        from autoparallel.graph.trace import tracing
        from autoparallel.lazy_init.params import is_lazy
        from autoparallel.planner.calib_worker import _count_dispatched

        layer = original.__self__
        if any(is_lazy(p) for p in layer.parameters()):
            raise LazyModel("the MoE layers' parameters are not allocated (paddle.LazyGuard)")
        dtype = str(x.spec.dtype).replace("paddle.", "")
        sample = paddle.to_tensor(np.random.default_rng(0).standard_normal(list(x.shape)).astype("float32"))
        out = []
        with tracing(None), _state_kept(layer):
            dist = ap.shard_tensor(sample.astype(dtype), self.mesh, [ap.Replicate()])
            with paddle.no_grad():
                count = _count_dispatched(lambda: out.append(original(dist, *args, **kwargs)))
        return out[0], count


@contextlib.contextmanager
def _state_kept(layer):
    """The paddle RNG stream and the layer's buffers (routing statistics, bias corrections) as they were:
    planning leaves no trace in what the user's run draws or holds."""
    import paddle

    rng = paddle.get_rng_state()
    buffers = [(b, b.numpy().copy()) for b in layer.buffers() if b is not None and b._is_initialized()]
    try:
        yield
    finally:
        paddle.set_rng_state(rng)
        for b, value in buffers:
            b.set_value(value)


def trace_moe(model, seq_len: int, batch: int = 1):
    """(OpProfile, graph, spans, per-block eager counts) of ``model`` (see the module docstring)."""
    from autoparallel.planner.from_trace import _find_blocks, op_profile, trace_model

    _, blocks = _find_blocks(model)
    layers = moe_layers(blocks)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no block holds an 'experts' sublayer")
    stand_in = _StandIn(layers)
    with stand_in.installed():
        graph, spans, core = trace_model(model, seq_len, batch)
    extra = {i: c - 1 for i, c in stand_in.counts.items()}          # the stand-in's node counted once
    adjusted = [(a, b + extra.get(i, 0)) for i, (a, b) in enumerate(spans)]
    ops = op_profile(model, adjusted, core, graph.number_of_nodes() + sum(extra.values()))
    return ops, graph, adjusted, stand_in.counts
