"""``paddle.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` called by hand between ``backward()`` and the
optimizer step, over distributed parameters.

The data-parallel gradients are reduced first (the owning optimizer's buckets are flushed now; its step then
has nothing left to reduce), then paddle's arithmetic runs on the whole gradients: the norm counts every
distinct element once (tensor-parallel shards, data-parallel copies: parallel/clip.py), the clip factor is
paddle's ``min(max_norm / (norm + 1e-6), 1)``, and every held shard is scaled; ``clip_grad_value_`` clamps
each shard elementwise. Under ZeRO the gradients leave ``p.grad`` at the step (reduce-scattered into
chunks): refused there, naming the optimizer's ``grad_clip``.

The clip acts on the gradients the update will use: a step that still divides them (``strategy.
gradient_accumulation_steps``: the accumulated sum by the steps; ``strategy.amp`` float16: by the loss scale)
is accounted for, so the norm, the factor and ``clip_grad_value_``'s bound are one process's, whose loop divides
its loss and unscales before clipping."""
from __future__ import annotations

import paddle

from autoparallel.comm import collectives as C
from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode
from autoparallel.parallel import clip as clipping
from autoparallel.parallel.grads import owners_of, partial_params

NORM_TYPES = (2.0, float("inf"))


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, paddle.Tensor) else list(parameters)


def reduce_first(params, name: str, instead: str) -> None:
    """Reduce the partial gradients of ``params`` now through their optimizers; refuse if none owns them."""
    owners = owners_of(params)
    for sync in owners:
        sync.flush(final=False)
    owned = {id(p) for sync in owners for p in sync.params_fn()}
    orphan = [p for p in partial_params(params) if id(p) not in owned]
    if orphan:
        raise NotImplementedError(
            f"paddle.nn.utils.{name} over {orphan[0].name}, whose data-parallel gradient is reduced by no "
            f"data-parallel optimizer (under ZeRO sharding gradients are reduce-scattered into chunks at the "
            f"step, outside p.grad): {instead}")


def pending_divisor(params, name: str) -> float:
    """What the step of the optimizers owning ``params`` still divides their gradients by (1: nothing)."""
    ds = {float(sync.step_divisor()) for sync in owners_of(params)}
    if len(ds) > 1:
        raise NotImplementedError(f"paddle.nn.utils.{name} over parameters whose optimizers divide their gradients "
                                  f"by different factors at the step ({sorted(ds)}: accumulation steps or loss "
                                  f"scales); clip the parameters of each optimizer by its own call")
    return ds.pop() if ds else 1.0


def _local_grads(params) -> list:
    out = []
    for p in params:
        ts = p.locals.values() if is_dist(p) else [p]
        out += [t.grad for t in ts if t.grad is not None]
    return out


def _norm(params, norm_type: float) -> float:
    dist = [p for p in params if is_dist(p) and any(t.grad is not None for t in p.locals.values())]
    plain = [p.grad for p in params if not is_dist(p) and p.grad is not None]
    with local_mode(), paddle.no_grad():
        if norm_type == 2.0:
            total = clipping.global_norm(clipping.param_terms(dist)) ** 2 if dist else 0.0
            total += sum(clipping.square_sum(g) for g in plain)
            return total ** 0.5
        top = max([float(g.abs().max()) for g in plain] or [0.0])
        return max(top, _dist_max(dist))


def _dist_max(params) -> float:
    top = 0.0
    for p in params:
        xs = {r: paddle.to_tensor([float(t.grad.abs().max()) if t.grad is not None and t.grad.size else 0.0],
                                  dtype="float64") for r, t in p.locals.items()}
        for d in range(p.mesh.ndim):
            xs = C.mesh_groups_apply(xs, p.mesh, d, lambda v, ranks: C._reduce_raw(v, ranks, "max"))
        if xs:
            top = max(top, float(next(iter(xs.values())).numpy().reshape(-1)[0]))
    return top


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, instead=""):
    params = _as_list(parameters)
    norm_type = float(norm_type)
    if norm_type not in NORM_TYPES:
        raise NotImplementedError(f"paddle.nn.utils.clip_grad_norm_ over distributed parameters supports "
                                  f"norm_type 2 or inf, got {norm_type}")
    reduce_first(params, "clip_grad_norm_", instead)
    if not _local_grads(params):
        return paddle.to_tensor(0.0)
    total = _norm(params, norm_type) / pending_divisor(params, "clip_grad_norm_")
    if error_if_nonfinite and not (total == total and total != float("inf")):
        raise RuntimeError(f"The total norm of {norm_type} order of the gradients from `parameters` is "
                           f"non-finite, so it cannot be clipped; set error_if_nonfinite=False to scale anyway")
    coef = min(float(max_norm) / (total + 1e-6), 1.0)
    grads = _local_grads(params)
    clipping.scale_(grads, coef)
    return paddle.to_tensor(total, dtype="float64" if any(g.dtype == paddle.float64 for g in grads) else "float32")


def clip_grad_value_(parameters, clip_value, instead="") -> None:
    params = _as_list(parameters)
    reduce_first(params, "clip_grad_value_", instead)
    v = float(clip_value) * pending_divisor(params, "clip_grad_value_")
    with local_mode(), paddle.no_grad():
        for g in _local_grads(params):
            g.set_value(g.clip(min=-v, max=v))
