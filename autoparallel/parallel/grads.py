"""Gradient reduction for distributed parameters.

A parameter replicated on a mesh dim but used by ops split on it (data parallel: every rank sees other
samples) ends backward with a partial-sum gradient there; dispatch records those dims on the parameter
(``_ap_partial_dims``). ``reduce_gradients`` all-reduces them in fused buckets: parameters grouped by
(mesh, dims), flattened into buffers of at most ``bucket_bytes``, in reverse registration order (the
order backward produces them).
"""
from __future__ import annotations

import paddle

from autoparallel.comm import collectives as C
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import DistParameter


def partial_params(params) -> list:
    return [p for p in params if isinstance(p, DistParameter) and getattr(p, "_ap_partial_dims", None)]


def _grads(p):
    """{rank: local gradient} of a parameter (every held rank in the simulated world)."""
    out = {}
    for r, t in p.locals.items():
        if t.grad is not None:
            out[r] = t.grad
    return out


def reduce_gradients(params, bucket_bytes: int = 25 * 2**20) -> int:
    """All-reduce partial gradients over their recorded mesh dims; returns the number of buckets."""
    groups: dict = {}
    for p in reversed(partial_params(params)):
        key = (p.mesh, tuple(sorted(p._ap_partial_dims)))
        groups.setdefault(key, []).append(p)
    nbuckets = 0
    for (mesh, dims), ps in groups.items():
        for bucket in _buckets(ps, bucket_bytes):
            _reduce_bucket(bucket, mesh, dims)
            nbuckets += 1
    return nbuckets


def _buckets(ps, limit):
    cur, size = [], 0
    for p in ps:
        nbytes = int(p.numel()) * p.element_size()
        if cur and size + nbytes > limit:
            yield cur
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        yield cur


def _reduce_bucket(bucket, mesh, dims):
    held = current_world().local_ranks(mesh.process_ids)
    flat = {}
    for r in held:
        parts = []
        for p in bucket:
            g = p.locals[r].grad
            parts.append(g.reshape([-1]).astype("float32") if g is not None
                         else paddle.zeros([int(p.locals[r].numel())], dtype="float32"))
        flat[r] = paddle.concat(parts) if parts else None
    with paddle.no_grad():
        for d in dims:
            flat = C.mesh_groups_apply(flat, mesh, d, lambda xs, ranks: C._reduce_raw(xs, ranks, "sum"))
    for r in held:
        off = 0
        for p in bucket:
            t = p.locals[r]
            n = int(t.numel())
            g = flat[r][off:off + n].reshape(t.shape).astype(t.dtype)
            off += n
            if t.grad is None:
                continue
            t.grad.set_value(g)
