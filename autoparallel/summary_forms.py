"""``paddle.summary(model, ...)`` and hapi's ``Model.summary()`` over a distributed model: global counts.

paddle's summary runs one forward with a post-hook on every sublayer; the hook counts ``np.prod(v.shape)`` of
the layer's own parameters and reads the input shapes of paddle tensors only. On a ``DistParameter`` ``.shape``
is this rank's shard (DESIGN.md, Shapes), so a tensor-parallel ``Linear(8, 8)`` at tp 2 reported 32 + 4
parameters, a released ZeRO-3 parameter its chunk, and a ``DistTensor`` input showed as ``[None]``.

While paddle's hook runs (and only then: the forward itself keeps the local shapes), a distributed parameter's
``shape`` reads its global shape and a distributed input is handed to the hook as an unallocated paddle tensor
of its global shape. The counts are then those of one process under DP, TP, SP and ZeRO 1-3.

A pipeline-parallel model (``PipelineModule``) is summarised through a view layer holding every stage: its
forward is ``eval_batch(inputs)``, so the rows of the stages this process runs carry the shapes of one
micro-batch; the layers of stages held by other ranks did not run here and get their row (parameters counted,
output shape ``[0]``) after the forward, so the totals are the whole model's on every rank.
"""
from __future__ import annotations

from autoparallel import patches


def install() -> None:
    from paddle.hapi import model_summary

    orig = model_summary.summary_string
    if getattr(orig, "_ap_wrapper", False):
        return
    patches.patch(model_summary, "summary_string", _summary_string(orig))


def _summary_string(orig):
    def summary_string(model, input_size=None, dtypes=None, input=None):
        from autoparallel.parallel.pipeline.runtime import PipelineModule

        if isinstance(model, PipelineModule):
            model = _PipelineView(model)
        elif not _holds_dist(model):
            return orig(model, input_size, dtypes, input)
        with _global_hooks():
            return orig(model, input_size, dtypes, input)

    summary_string._ap_wrapper = True
    return summary_string


def _holds_dist(model) -> bool:
    from autoparallel.dist_tensor import is_dist

    return any(is_dist(p) for p in model.parameters())


def _global_hooks():
    """Every forward post-hook registered meanwhile (paddle's summary hooks) runs with global shapes."""
    import paddle

    register = paddle.nn.Layer.register_forward_post_hook

    def register_global(self, hook):
        return register(self, _global_hook(hook))

    return patches.swapped(paddle.nn.Layer, {"register_forward_post_hook": register_global})


def _global_hook(hook):
    def run(layer, inputs, output):
        with _global_param_shapes():
            return hook(layer, _global_inputs(inputs), output)

    return run


def _global_param_shapes():
    """A distributed parameter's ``shape`` reads its global shape for a block."""
    import paddle

    from autoparallel.dist_tensor import DistParameter

    local = paddle.Tensor.shape.__get__
    shape = property(lambda p: list(p.global_shape) if hasattr(p, "_ap_spec") else local(p))
    return patches.swapped(DistParameter, {"shape": shape})


def _global_inputs(inputs):
    """The hook's inputs with each DistTensor replaced by an unallocated paddle tensor of its global shape."""
    from autoparallel.compat import storage_free_tensor
    from autoparallel.dist_tensor import DistTensor

    def one(x):
        if isinstance(x, DistTensor):
            return storage_free_tensor(x.dtype, x.shape, "summary_input")
        return type(x)(one(v) for v in x) if isinstance(x, (list, tuple)) else x

    return one(inputs)


def _pipeline_view_cls():
    import paddle

    class PipelineView(paddle.nn.Layer):
        """Every stage of a pipeline as sublayers; the forward runs ``eval_batch`` and then gives the post-hooks
        of layers that did not run on this process (stages held by other ranks) their call, without shapes."""

        def __init__(self, pipe):
            super().__init__()
            object.__setattr__(self, "_pipe", pipe)
            for k, stage in enumerate(pipe.stages):
                self.add_sublayer(f"stage{k}", stage)

        def forward(self, *inputs):
            pipe = self._pipe
            ran = set()
            hooks = [layer.register_forward_post_hook(lambda layer, i, o: ran.add(id(layer)))
                     for layer in self.sublayers()]
            try:
                out = pipe.eval_batch(inputs[0] if len(inputs) == 1 else list(inputs))
            finally:
                for h in hooks:
                    h.remove()
            empty = paddle.empty([0])
            for layer in self.sublayers():
                if id(layer) not in ran and layer._parameters:
                    for hook in list(layer._forward_post_hooks.values()):
                        hook(layer, (), empty)
            return out

    return PipelineView


def _PipelineView(pipe):
    return _pipeline_view_cls()(pipe)
