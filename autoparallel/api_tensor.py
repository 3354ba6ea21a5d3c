"""The tensor entry points in paddle.distributed's call forms (names, positions, defaults as paddle 3.3).

    ap.shard_tensor(data, mesh, placements, dtype=None, place=None, stop_gradient=None)
    ap.reshard(dist_tensor, mesh, placements)
    ap.dtensor_from_local(local_tensor, mesh, placements, global_shape=None, dtype=None)
    ap.dtensor_to_local(dist_tensor, mesh=None, placements=None)
    ap.dtensor_from_fn(fn, mesh, placements, *args, **kwargs)
    ap.unshard_dtensor(dist_tensor)

``mesh`` may be an ``ap.ProcessMesh`` or a ``paddle.distributed.ProcessMesh``; ``placements`` a list or tuple
of our placements, paddle's own ``dist.Shard/Replicate/Partial`` objects, or a string (``"S(0),R"``); negative
``Shard`` dims count from the end. The runtime itself lives in ``dist_tensor``; these functions only bind
paddle's arguments and refuse what cannot be honoured.
"""
from __future__ import annotations

from autoparallel import dist_tensor as _dt
from autoparallel.core.mesh import ProcessMesh, as_mesh
from autoparallel.core.placement import normalize_dims, parse_placements

__all__ = ["shard_tensor", "reshard", "dtensor_from_local", "dtensor_to_local", "dtensor_from_fn", "unshard_dtensor"]


def _placements(placements, what: str):
    if placements is None:
        raise TypeError(f"{what} needs placements: a list with one Shard/Replicate/Partial per mesh dim")
    return tuple(parse_placements(placements))


def _on_place(data, place, dtype):
    """``place``: new tensors (from ndarrays, lists, numbers) are created there; a tensor already on it is taken
    as is; a tensor elsewhere is refused (shards stay where the data is)."""
    if place is None:
        return data
    import paddle
    from autoparallel.compat import paddle_place

    try:
        want = paddle_place(place)
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"shard_tensor(place={place!r}) is not a device of this paddle build: {e}") from None
    if not isinstance(data, paddle.Tensor) and not hasattr(data, "placements"):
        return paddle.to_tensor(data, dtype=dtype, place=want)
    if str(data.place) != str(want):
        raise NotImplementedError(f"shard_tensor(place={place!r}): the data is on {data.place}; shards stay on the "
                                  f"device of the data: move it first (tensor.to({place!r}))")
    return data


def _refuse_paddle_dist(x, what: str) -> None:
    """A tensor distributed by paddle's own runtime (``paddle.distributed.shard_tensor``) holds only this rank's
    part of its value: taken as a full value it would be laid out wrong. paddle's ``shard_tensor`` refuses it too."""
    import paddle

    if isinstance(x, paddle.Tensor) and not hasattr(x, "_ap_spec") and x.is_dist():
        raise TypeError(f"{what}: the tensor was distributed by paddle.distributed ({x.placements} on "
                        f"{x.process_mesh}) and holds this rank's part only; pass the dense tensor "
                        f"(paddle.distributed.unshard_dtensor gathers it) or build it with ap.shard_tensor")


def shard_tensor(data, mesh, placements, dtype=None, place=None, stop_gradient=None):
    """paddle's ``dist.shard_tensor``: distribute ``data`` (the same full value on every rank) over ``mesh``."""
    if data is None:
        return None
    _refuse_paddle_dist(data, "shard_tensor")
    data = _on_place(data, place, dtype)
    if stop_gradient is not None and not isinstance(stop_gradient, bool):
        raise TypeError(f"shard_tensor(stop_gradient=...) expects True, False or None, got {stop_gradient!r}")
    if isinstance(data, (list, tuple, int, float, complex)):
        import paddle

        data = paddle.to_tensor(data, dtype=dtype)     # paddle's: python floats take the default dtype (float32)
    out = _dt.shard_tensor(data, as_mesh(mesh), _placements(placements, "shard_tensor"), dtype=dtype,
                           stop_gradient=stop_gradient)
    if stop_gradient is not None and out is not None and out.stop_gradient != stop_gradient:
        out.stop_gradient = stop_gradient   # a parameter took its own (paddle's docs: the asked one is returned)
    return out


def reshard(dist_tensor, mesh, placements):
    """paddle's ``dist.reshard``: redistribute to ``placements`` on ``mesh`` (differentiable)."""
    from autoparallel.comm.fanout import complete_gradient

    x = complete_gradient(dist_tensor)          # the move's adjoint gives complete gradients on replicated dims
    return _dt.reshard(x, as_mesh(mesh), _placements(placements, "reshard"))


_UNSET = object()


def dtensor_from_local(local_tensor=_UNSET, mesh=None, placements=None, global_shape=None, dtype=None, *,
                       local=_UNSET):
    """paddle's ``dtensor_from_local(local_tensor, mesh, placements)``; ``global_shape`` (default: the local
    shape times the shard counts) and ``dtype`` are this project's additions for uneven shards; ``local=`` is
    this project's earlier name of ``local_tensor``."""
    if (local_tensor is _UNSET) == (local is _UNSET):
        raise TypeError("dtensor_from_local needs the local shard once: dtensor_from_local(local_tensor, mesh, "
                        "placements)" + ("" if local_tensor is _UNSET else "; local_tensor= and local= are the "
                                         "same argument"))
    local_tensor = local if local_tensor is _UNSET else local_tensor
    _refuse_paddle_dist(local_tensor, "dtensor_from_local")
    if mesh is None:
        raise TypeError("dtensor_from_local() missing the mesh: dtensor_from_local(local_tensor, mesh, placements)")
    mesh = as_mesh(mesh)
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"dtensor_from_local expects a ProcessMesh, got {type(mesh).__name__} {mesh!r:.60}")
    pl = _placements(placements, "dtensor_from_local")
    ndim = len(global_shape) if global_shape is not None else _local_ndim(local_tensor)
    if ndim is not None:
        pl = normalize_dims(pl, ndim)
    if global_shape is None:
        global_shape = _agreed_global_shape(local_tensor, mesh, pl)
    return _dt.dtensor_from_local(local_tensor, mesh, pl, global_shape=global_shape, dtype=dtype)


def _agreed_global_shape(local, mesh, placements):
    """On real ranks (one shard per process) the global shape from every rank's size along each sharded dim,
    agreed by one small all-reduce per sharded tensor dim over the ranks of the mesh dims sharding it: uneven
    shards (7 rows over 2 ranks: 4 and 3; over both dims of a 2 x 2 mesh: 2, 2, 2, 1) make one global shape on
    every rank. Inferred alone, each rank took its own size times the shard count (rank 0 [8, 3], rank 1 [6, 3])
    and the next collective aborted the process. None: the default inference (the simulated world, which holds
    every shard, and layouts without a Shard)."""
    import paddle

    from autoparallel.comm.world import current_world
    from autoparallel.core.placement import Shard

    world = current_world()
    if world.is_simulated or not isinstance(local, paddle.Tensor) or len(placements) != mesh.ndim \
            or not mesh.contains(world.rank):
        return None                                     # (a wrong count is refused by dist_tensor.dtensor_from_local)
    by_dim: dict = {}                                   # tensor dim -> the mesh dims sharding it, in mesh order
    for i, p in enumerate(placements):
        if type(p) is Shard and mesh.shape[i] > 1:
            by_dim.setdefault(p.dim, []).append(i)
    if not by_dim:
        return None
    shape = list(local.shape)
    for d, mdims in by_dim.items():
        if not 0 <= d < len(shape):
            return None                                # out of range: refused by dist_tensor.dtensor_from_local
        shape[d] = _agreed_dim_size(world, mesh, mdims, d, local.shape[d])
    return shape


def _agreed_dim_size(world, mesh, mdims, d, mine_size):
    """Tensor dim ``d``'s global size from the local sizes of the ranks sharing this rank's place on every mesh
    dim but ``mdims`` (one all-reduce per mesh dim of ``mdims``); ValueError (the same on each of those ranks) if
    the sizes are not the layout ``shard_tensor`` makes (``DistSpec.local_range``: ceil-division chunks over
    ``mdims[0]``, each chunked over ``mdims[1]``, ...)."""
    import numpy as np

    from autoparallel.core.placement import Replicate, Shard
    from autoparallel.core.spec import DistSpec
    from autoparallel.comm.collectives import mesh_max

    ids = np.moveaxis(np.asarray(mesh.process_ids).reshape(mesh.shape), mdims, range(-len(mdims), 0))
    group = int(np.prod([mesh.shape[i] for i in mdims]))
    ranks = next(row for row in ids.reshape(-1, group).tolist() if world.rank in row)
    mine = np.zeros(len(ranks), dtype="float32")
    mine[ranks.index(world.rank)] = mine_size
    sizes = [int(n) for n in mesh_max(mine, mesh, dims=mdims).numpy()]
    rows = DistSpec(mesh, tuple(Shard(0) if i in mdims else Replicate() for i in range(mesh.ndim)), (sum(sizes),))
    want = [rows.local_extent(mesh.coords_of(r), 0) for r in ranks]
    if sizes != want:
        names = [mesh.dim_names[i] for i in mdims]
        where = f"mesh dim {names[0]!r}" if len(names) == 1 else f"mesh dims {names}"
        raise ValueError(f"dtensor_from_local: the local shards along dim {d} have sizes {sizes} on the ranks "
                         f"{ranks} of {where}, which is not a layout of this project (ceil division: {sum(sizes)} "
                         f"over {len(sizes)} is {want}); pass the global shape, global_shape=[...]")
    return sum(sizes)


def _local_ndim(local):
    if isinstance(local, dict):
        local = next(iter(local.values()), None)
    elif isinstance(local, (list, tuple)):
        local = local[0] if local else None
    shape = getattr(local, "shape", None)
    return None if shape is None else len(shape)


def dtensor_to_local(dist_tensor, mesh=None, placements=None):
    """paddle's ``dtensor_to_local``: this rank's shard (differentiable). ``mesh`` / ``placements``, when given,
    must be the tensor's own: they describe the layout of the local value, they do not change it."""
    x = _dt.as_dist(dist_tensor)
    if not isinstance(x, _dt.DistTensor):
        raise TypeError(f"dtensor_to_local expects a DistTensor or DistParameter, got {type(dist_tensor).__name__}")
    if mesh is not None and not isinstance(as_mesh(mesh), ProcessMesh):
        raise TypeError(f"dtensor_to_local: mesh must be a ProcessMesh (the tensor's own) or None, got "
                        f"{type(mesh).__name__} {mesh!r:.60}")
    if mesh is not None and as_mesh(mesh) != x.mesh:
        raise ValueError(f"dtensor_to_local: mesh {as_mesh(mesh)!r} is not the tensor's mesh {x.mesh!r}; reshard "
                         f"first (ap.reshard) if another layout is wanted")
    if placements is not None:
        want = _dt.DistSpec(x.mesh, _placements(placements, "dtensor_to_local"), tuple(x.shape), x.spec.dtype)
        if want.placements != x.spec.placements:
            raise ValueError(f"dtensor_to_local: placements [{', '.join(map(str, want.placements))}] are not the "
                             f"tensor's [{', '.join(map(str, x.spec.placements))}]; reshard first (ap.reshard)")
    from autoparallel.comm.fanout import complete_gradient

    return complete_gradient(x).local_of(_current_rank())     # the local gradient of a Replicate dim is whole


def _current_rank() -> int:
    from autoparallel.comm.world import current_world

    return current_world().rank


def dtensor_from_fn(fn, mesh, placements, *args, **kwargs):
    """paddle's ``dtensor_from_fn``: ``shard_tensor(fn(*args, **kwargs), mesh, placements)``."""
    if not callable(fn):
        raise TypeError(f"dtensor_from_fn expects a callable building the full tensor, got {type(fn).__name__}")
    return shard_tensor(fn(*args, **kwargs), mesh, placements)


def unshard_dtensor(dist_tensor):
    """paddle's ``unshard_dtensor``: the whole (global) value as a plain tensor on every rank (gathered); of a
    distributed parameter, a plain Parameter (paddle's: ``layer.weight = unshard_dtensor(layer.weight)`` puts the
    whole weight back into the layer's parameter slot) with its trainable / stop_gradient / optimizer attributes."""
    x = _dt.as_dist(dist_tensor)
    if not isinstance(x, _dt.DistTensor):
        raise TypeError(f"unshard_dtensor expects a DistTensor or DistParameter, got {type(dist_tensor).__name__}")
    if isinstance(dist_tensor, _dt.DistParameter):
        from autoparallel.export_forms import plain_param

        return plain_param(dist_tensor)
    return x.full()
