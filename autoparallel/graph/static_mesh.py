"""The mesh ``ap.to_static`` runs on, and the Strategy checked against it: every degree the strategy states is
the mesh's, or the call is refused.

    semi, no mesh      [data, model] built from the validated degrees (dp x tp = the world)
    semi, mesh=...     the mesh's "data" / "model" dim sizes are dp / tp; degrees the strategy sets explicitly
                       must equal them, and the strategy is validated with them (dependent fields, sequence
                       parallel needs a "model" dim of size > 1, ZeRO needs a "data" dim, ...)
    full               completion lays out every tensor over the mesh (as square as the world allows, or the
                       given one): a data / tensor degree or sequence parallel given too would be ignored, so
                       they are refused; sharding, recompute and gradient accumulation are honoured
"""
from __future__ import annotations

import math

from autoparallel.mesh import ProcessMesh

__all__ = ["mesh_for", "square_mesh"]

_FULL_REFUSED = (("data_parallel.degree", None), ("tensor_parallel.degree", 1), ("sequence_parallel.enable", False))


def square_mesh(world: int) -> ProcessMesh:
    dp = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    tp = world // dp
    return ProcessMesh([[a * tp + b for b in range(tp)] for a in range(dp)], dim_names=["data", "model"])


def mesh_for(strategy, world: int, mesh):
    """(mesh, resolved degrees or None) for ``to_static``; ValueError for a strategy the mesh cannot honour."""
    if strategy.auto_mode == "full":
        _refuse_fixed_degrees(strategy)
        mesh = square_mesh(world) if mesh is None else mesh
        _validate_on(strategy, mesh)
        return mesh, None
    if mesh is None:
        from autoparallel.parallel.mesh_dims import build_mesh

        degrees = strategy.validate(world_size=world)
        return build_mesh(degrees.dp, degrees.tp), degrees
    _check_agree(strategy, mesh)
    return mesh, _validate_on(strategy, mesh)


def _sizes(mesh) -> tuple:
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    return int(sizes.get("data", 1)), int(sizes.get("model", 1))


def _refuse_fixed_degrees(strategy) -> None:
    bad = []
    for name, default in _FULL_REFUSED:
        section, leaf = name.split(".")
        v = getattr(getattr(strategy, section), leaf)
        if v != default:
            bad.append(f"{name}={v!r}")
    if bad:
        raise ValueError(f"ap.to_static with auto_mode='full' lays out every tensor itself, so strategy "
                         f"{', '.join(bad)} would be ignored; expected auto_mode='semi' to fix them, or their "
                         f"defaults")


def _check_agree(strategy, mesh) -> None:
    dp, tp = _sizes(mesh)
    given = (("data_parallel.degree", strategy.data_parallel.degree, None, "data", dp),
             ("tensor_parallel.degree", strategy.tensor_parallel.degree, 1, "model", tp))
    bad = [f"strategy.{name}={v} but the mesh's {dim!r} dim has size {size}"
           for name, v, default, dim, size in given if v != default and v != size]
    if bad:
        raise ValueError(f"ap.to_static(..., mesh=...): {'; '.join(bad)} (mesh dims {mesh.dim_names}, shape "
                         f"{mesh.shape}); the mesh's 'data' / 'model' dim sizes are the degrees")


def _validate_on(strategy, mesh):
    """The strategy validated with the mesh's degrees (a copy: the caller's strategy is not changed)."""
    if strategy.sharding.enable and "data" not in mesh.dim_names:
        raise ValueError(f"strategy.sharding.enable=True shards the optimizer over the mesh's 'data' dim, but the "
                         f"mesh has dims {mesh.dim_names}; name the data-parallel dim 'data'")
    dp, tp = _sizes(mesh)
    s = strategy.copy()
    s.auto_mode = "semi"
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    return s.validate(world_size=dp * tp)
