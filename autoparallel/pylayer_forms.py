"""A user's ``paddle.autograd.PyLayer`` inside a model that runs on distributed tensors.

    class Scale(PyLayer):                       # forward / backward written for whole, plain tensors
        @staticmethod
        def forward(ctx, x, w): ...
    y = Scale.apply(x_dist, w_dist)             # DistTensor, replicated on x_dist's mesh

paddle's ``PyLayer.apply`` takes plain tensors only, and what the user's ``forward`` / ``backward`` compute
(a sum over the batch, a gather by index) is unknown to any rule: running them on shards could silently give
per-shard results. So ``apply`` with a distributed argument gathers every distributed argument to Replicate
(autograd-aware: the backward slices or reduces as the reshard's adjoint does), runs the user's PyLayer on the
whole tensors on every rank, and returns Replicate DistTensors: the values and gradients one process gets (an
input gathered for column-parallel layers, whose gradient is kept partial, is read as ``fanout.complete_gradient``).
Code that knows its PyLayer is local per shard says so with ``ap.local_map(Scale.apply, ...)`` instead (no
gather). All distributed arguments must share one mesh. A PyLayer applied in local code (``local_map``,
``LocalLayer``, or the gathered run above) also runs its backward in local mode: its saved tensors are plain
per-rank tensors (a replicated parameter's own storage among them) that must not be routed again.
"""
from __future__ import annotations

import weakref

from autoparallel import patches

_LOCAL_BACKWARD = weakref.WeakKeyDictionary()      # user PyLayer class -> subclass whose backward runs locally


def _gathered_apply(orig):
    def apply(cls, *args, **kwargs):
        from autoparallel.context import state
        from autoparallel.dist_tensor import is_dist

        if cls.__module__.startswith("autoparallel."):
            return orig.__get__(None, cls)(*args, **kwargs)
        if state.local_depth > 0:           # inside local_map / LocalLayer: local forward, so local backward
            return orig.__get__(None, _with_local_backward(cls))(*args, **kwargs)
        if not any(is_dist(v) for v in list(args) + list(kwargs.values())):
            return orig.__get__(None, cls)(*args, **kwargs)
        local_cls = _with_local_backward(cls)
        return _run_replicated(cls, orig.__get__(None, local_cls), args, kwargs)

    apply._ap_wrapper = True
    return classmethod(apply)


def _with_local_backward(cls):
    """``cls`` whose backward runs in local mode, like its forward: its saved tensors are the ranks' plain
    (whole) tensors, some of them a replicated parameter's own storage, which must not be routed again."""
    sub = _LOCAL_BACKWARD.get(cls)
    if sub is None:
        def backward(ctx, *grads):
            from autoparallel.local_mode import local_mode

            with local_mode():
                return cls.backward(ctx, *grads)

        sub = type(cls.__name__, (cls,), {"backward": staticmethod(backward), "__module__": cls.__module__})
        _LOCAL_BACKWARD[cls] = sub
    return sub


def _run_replicated(cls, bound, args, kwargs):
    from autoparallel.api_tensor import reshard
    from autoparallel.comm.fanout import complete_gradient
    from autoparallel.core.placement import Replicate
    from autoparallel.dispatch_cache import param_use
    from autoparallel.dist_tensor import as_dist, is_dist

    dists = [as_dist(v) for v in list(args) + list(kwargs.values()) if is_dist(v)]
    mesh = dists[0].mesh
    for d in dists[1:]:
        if d.mesh != mesh:
            raise ValueError(f"{cls.__name__}.apply: distributed arguments on different meshes ({mesh!r} and "
                             f"{d.mesh!r}); reshard them onto one mesh first")
    whole = [Replicate()] * mesh.ndim

    def gather(v):
        if not is_dist(v):
            return v
        if _replicated_param(v):
            return _ParamLocals(param_use(v, dict(v._ap_locals), mesh, (), range(mesh.ndim)))
        if _sharded_param(v):       # a replicated use on its replicated dims, then gathered on its split dims
            v = _param_use_sharded(v, mesh, param_use)
        v = complete_gradient(as_dist(v))       # a whole-tensor reader's gradient is complete on every rank
        return v if all(isinstance(p, Replicate) for p in v.placements) else reshard(v, mesh, whole)

    names = list(kwargs)
    inputs = [gather(a) for a in args] + [gather(kwargs[k]) for k in names]
    return _per_rank(cls, bound, inputs, len(args), names, mesh, whole)


class _ParamLocals(dict):
    """A replicated parameter's per-rank tensors, its gradient contribution already put in the parameter's
    state (complete on every rank, or kept on one rank of a dim where its gradient is a partial sum): the
    whole-tensor run is a replicated use of it, like any replicated op dispatch runs."""


def _replicated_param(v) -> bool:
    from autoparallel.core.placement import Replicate
    from autoparallel.dist_tensor import DistParameter

    return isinstance(v, DistParameter) and not v.stop_gradient and \
        all(isinstance(p, Replicate) for p in v._ap_spec.placements)


def _sharded_param(v) -> bool:
    from autoparallel.dist_tensor import DistParameter

    return isinstance(v, DistParameter) and not v.stop_gradient


def _param_use_sharded(v, mesh, param_use):
    """A split parameter read whole by the PyLayer: its gradient state on the dims it is replicated on
    follows its other uses (dispatch_cache.param_use), so a complete contribution is not summed again."""
    from autoparallel.api_local import _simulated
    from autoparallel.api_tensor import dtensor_from_local
    from autoparallel.core.placement import Replicate

    placements = list(v._ap_spec.placements)
    rep = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    locs = param_use(v, dict(v._ap_locals), mesh, (), rep)
    if len(locs) == 1 and not _simulated():
        locs = next(iter(locs.values()))
    return dtensor_from_local(locs, mesh, placements, global_shape=list(v._ap_spec.shape))


def _per_rank(cls, bound, inputs, n, names, mesh, whole):
    """The PyLayer run on every held rank's whole tensors; each tensor output a Replicate DistTensor."""
    import paddle

    from autoparallel.api_local import _held_ranks, _simulated
    from autoparallel.api_tensor import dtensor_from_local
    from autoparallel.dist_tensor import is_dist
    from autoparallel.local_mode import local_mode

    ranks = _held_ranks([x for x in inputs if is_dist(x)], [mesh])
    ranks = [r for r in ranks if all(r in x for x in inputs if isinstance(x, _ParamLocals))]
    with local_mode():
        per_rank = {}
        for r in ranks:
            xs = [x[r] if isinstance(x, _ParamLocals) else x.local_of(r) if is_dist(x) else x for x in inputs]
            per_rank[r] = bound(*xs[:n], **dict(zip(names, xs[n:])))
    structure = per_rank[ranks[0]]
    flat = {r: paddle.utils.flatten(out) for r, out in per_rank.items()}
    outs = []
    for i, first in enumerate(flat[ranks[0]]):
        if not isinstance(first, paddle.Tensor):
            outs.append(first)
            continue
        locals_ = {r: flat[r][i] for r in ranks}
        outs.append(dtensor_from_local(locals_ if len(ranks) > 1 or _simulated() else locals_[ranks[0]], mesh,
                                       list(whole)))
    return paddle.utils.pack_sequence_as(structure, outs)


def install() -> None:
    from paddle.autograd.py_layer import PyLayer

    if getattr(getattr(PyLayer, "apply", None), "_ap_wrapper", False):
        return
    base = PyLayer.__mro__[1].__dict__["apply"]          # the C base's classmethod descriptor
    patches.patch(PyLayer, "apply", _gathered_apply(base))
