"""Input checks for the planner: each error says what was expected and what was given."""
from __future__ import annotations

import numbers
from functools import lru_cache

from autoparallel.core.capabilities import capabilities
from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import Partial, Placement, parse_placements
from autoparallel.core.cluster import ClusterSpec, default_cluster, parse_cluster
from autoparallel.core.spec import check_placements, normalize_dtype


MAX_NUMEL = 2 ** 53


def check_mesh(mesh, name: str = "mesh") -> ProcessMesh:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{name} must be a ProcessMesh, got {type(mesh).__name__} {mesh!r}")
    return mesh


def check_shape(shape) -> tuple:
    """A sequence of non-negative ints -> tuple."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"global_shape must be a sequence of ints like [4096, 4096], got {type(shape).__name__} "
                        f"{shape!r}")
    dims = list(shape)
    for s in dims:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"global_shape must hold ints, got {type(s).__name__} {s!r} in {dims}")
    if any(s < 0 for s in dims):
        raise ValueError(f"global_shape must be non-negative, got {dims}")
    numel = 1
    for s in dims:
        numel *= int(s)
    if numel > MAX_NUMEL:           # byte counts (x 8 per element at most) stay inside int64
        raise ValueError(f"global_shape {dims} holds {numel:.3g} elements, beyond 2**53 (no cluster holds such a "
                         f"tensor)")
    return tuple(int(s) for s in dims)


def check_dtype(dtype) -> str:
    return normalize_dtype(dtype)


def check_placements_for(name: str, mesh: ProcessMesh, placements, ndim: int) -> tuple:
    """Parse and validate ``placements`` (a string like "S(0),R" or a sequence) for ``mesh`` and a rank-``ndim`` tensor."""
    if isinstance(placements, Placement):
        placements = (placements,)
    if not isinstance(placements, str) and not hasattr(placements, "__iter__"):
        raise TypeError(f"{name} must be a string like 'S(0),R' or a sequence of placements, "
                        f"got {type(placements).__name__} {placements!r}")
    try:
        text = placements if isinstance(placements, str) else tuple(parse_placements(placements))
        pl = check_placements(mesh, text, ndim)          # a short list is padded, a string names every dim
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    kinds = sorted({p.reduce_type for p in pl if isinstance(p, Partial)})
    if len(kinds) > 1:
        raise ValueError(f"{name}: a tensor may be partial under one reduce type only, got "
                         f"{[str(p) for p in pl]} mixing {kinds}")
    return pl


def check_cluster(cluster) -> ClusterSpec:
    """None -> the default cluster; a spec string or profile path -> ClusterSpec; the backend must be known."""
    if cluster is None:
        return _default_cluster()
    if not isinstance(cluster, (ClusterSpec, str)):
        raise TypeError(f"cluster must be None, a ClusterSpec or a spec string like '1x8:A100-80GB', "
                        f"got {type(cluster).__name__}")
    cluster = parse_cluster(cluster)
    capabilities(cluster.backend)
    return cluster


@lru_cache(maxsize=1)
def _default_cluster() -> ClusterSpec:
    return default_cluster()
