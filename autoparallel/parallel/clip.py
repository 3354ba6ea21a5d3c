"""Global-norm gradient clipping across tensor-parallel and ZeRO shards.

The global norm is sqrt of the sum of squares of every distinct gradient element. A rank's local piece
is distinct along the mesh dims where it is sharded and a copy along the others, so each rank adds its
local sum of squares only when its coordinate is 0 on every mesh dim where the piece is replicated; the
sum is then all-reduced over every mesh dim. Each term is ``(locals, mesh, sharded_dims)``: ``locals``
{rank: tensor} for the held ranks, ``sharded_dims`` the names of the mesh dims along which the pieces
differ.
"""
from __future__ import annotations

import paddle

from autoparallel.comm import collectives as C
from autoparallel.comm.sizes import numel
from autoparallel.comm.world import current_world
from autoparallel.dist_tensor import is_dist
from autoparallel.local_mode import local_mode


def global_norm(terms) -> float:
    """sqrt(sum of squares) of the distinct elements described by ``terms`` (same on every rank). The squares are
    summed on the device, in float64 as a Python float would: one read to the host per mesh, not one per tensor
    (each read waits for the device)."""
    by_mesh: dict = {}
    for locals_, mesh, sharded in terms:
        bad = [d for d in sharded if d not in mesh.dim_names]
        if bad:
            raise ValueError(f"sharded dims {bad} are not dims of the mesh {mesh.dim_names}")
        acc = by_mesh.setdefault(mesh, {r: None for r in current_world().local_ranks(mesh.process_ids)})
        for r, t in locals_.items():
            if t is None or numel(t) == 0 or not _counts(mesh, r, sharded):
                continue
            with local_mode(), paddle.no_grad():
                s = square_sum_tensor(t)
                acc[r] = s if acc[r] is None else acc[r] + s
    total = 0.0
    for mesh, acc in by_mesh.items():
        if not acc:
            continue
        xs = {r: paddle.zeros([1], dtype="float64") if v is None else v.reshape([1]) for r, v in acc.items()}
        with local_mode(), paddle.no_grad():
            for d in range(mesh.ndim):
                xs = C.mesh_groups_apply(xs, mesh, d, lambda v, ranks: C._reduce_raw(v, ranks, "sum"))
        total += float(next(iter(xs.values())).numpy().reshape(-1)[0])
    return total ** 0.5


def _counts(mesh, rank, sharded) -> bool:
    coords = mesh.coords_of(rank)
    return all(c == 0 for name, c in zip(mesh.dim_names, coords) if name not in sharded)


def param_terms(params) -> list:
    """Terms for DistParameters whose gradients are already reduced (DP / TP): sharded where placed Shard."""
    terms = []
    for p in params:
        if not getattr(p, "need_clip", True):
            continue
        sharded = {p.mesh.dim_names[i] for i, pl in enumerate(p.placements) if pl.is_shard() or pl.is_block_shard()}
        terms.append(({r: t.grad for r, t in p.locals.items()}, p.mesh, sharded))
    return terms


def clip_coefficient(norm: float, max_norm: float) -> float:
    """paddle.nn.ClipGradByGlobalNorm's factor: max_norm / max(norm, max_norm)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    return max_norm / max(norm, max_norm)


def scale_(tensors, factor: float) -> None:
    if factor == 1.0:
        return
    with local_mode(), paddle.no_grad():
        for t in tensors:
            if t is not None:
                t.set_value(t * factor)


def clip_grad_norm_(params, max_norm: float) -> float:
    """Clip the (reduced) gradients of DistParameters by the global norm in place; returns the norm."""
    terms = param_terms(params)
    norm = global_norm(terms)
    scale_([t for locs, _, _ in terms for t in locs.values()], clip_coefficient(norm, max_norm))
    return norm


def clip_grad_norm_per_param_(params, max_norm: float) -> None:
    """paddle.nn.ClipGradByNorm over distributed parameters: each gradient scaled by
    max_norm / max(norm, max_norm) with the norm of that parameter's whole gradient (its shards counted once);
    a plain parameter's gradient by its own norm."""
    for p in params:
        if not getattr(p, "need_clip", True):
            continue
        if is_dist(p):
            terms = param_terms([p])
            grads = [g for g in terms[0][0].values() if g is not None]
            norm = global_norm(terms) if grads else None
        else:
            grads = [] if p.grad is None else [p.grad]
            norm = _plain_norm(p.grad) if grads else None
        if grads:
            scale_(grads, clip_coefficient(norm, max_norm))


def _plain_norm(g) -> float:
    with local_mode(), paddle.no_grad():
        return square_sum(g) ** 0.5


def square_sum(t) -> float:
    """Sum of squares in float32 (low precision upcast), in float64 for a float64 tensor (as paddle's clips)."""
    return float(square_sum_tensor(t))


def square_sum_tensor(t):
    """``square_sum`` as a float64 tensor on ``t``'s device (no read to the host)."""
    return ((t if t.dtype == paddle.float64 else t.astype("float32")) ** 2).sum().astype("float64")
