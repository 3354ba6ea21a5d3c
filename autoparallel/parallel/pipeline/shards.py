"""Stage-boundary tensors of the pipeline runtime: this rank's tensor of a DistTensor, every rank's shards in the
simulated world (what a transfer carries there), and the backward / input gradient of either."""
from __future__ import annotations

import paddle


def _local(t):
    """This rank's tensor of a DistTensor (every rank's, as ``_Shards``, in the simulated world), or the
    tensor itself."""
    from autoparallel.comm.world import current_world
    from autoparallel.dist_tensor import DistTensor

    if not isinstance(t, DistTensor):
        return t
    if current_world().is_simulated:
        return _Shards([t.local_of(r) for r in t.mesh.process_ids])
    return t.local


class _Shards:
    """Every rank's shard of a stage-boundary tensor in the simulated world, in stage-mesh order: what a
    transfer carries there (rank ``k`` of one stage mesh hands its shard to rank ``k`` of the next)."""

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def detach(self) -> "_Shards":
        return _Shards(t.detach() for t in self.tensors)

    @property
    def stop_gradient(self) -> bool:
        return all(t.stop_gradient for t in self.tensors)

    @stop_gradient.setter
    def stop_gradient(self, value: bool) -> None:
        for t in self.tensors:
            t.stop_gradient = value

    @property
    def shape(self):
        return self.tensors[0].shape

    @property
    def dtype(self):
        return self.tensors[0].dtype


def _backprop(out, grad) -> None:
    if isinstance(out, list):               # the heads of a model's whole output (external_loss.saved)
        pairs = [(_local(o), g) for o, g in zip(out, grad) if not o.stop_gradient]
        outs = [t for o, _ in pairs for t in (o.tensors if isinstance(o, _Shards) else [o])]
        grads = [t for _, g in pairs for t in (g.tensors if isinstance(g, _Shards) else [g])]
        if outs:
            paddle.autograd.backward(outs, grads)
    elif isinstance(out, _Shards):
        paddle.autograd.backward(out.tensors, grad.tensors)
    else:
        paddle.autograd.backward([out], [grad])


def _input_grad(x):
    """The gradient of a stage input (zeros where nothing flowed back), detached."""
    if isinstance(x, _Shards):
        return _Shards(_input_grad(t) for t in x.tensors)
    return (x.grad if x.grad is not None else paddle.zeros_like(x)).detach()
