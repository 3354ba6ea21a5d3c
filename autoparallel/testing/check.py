"""Full-tensor ground truth for layouts: what every rank must hold, and reassembly of a DistTensor."""
from __future__ import annotations

import itertools

import numpy as np

from autoparallel.placement import Partial
from autoparallel.spec import DistSpec

_NP_REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


def expected_local(full: np.ndarray, spec: DistSpec, coords, flip: bool = False) -> np.ndarray:
    """The slice of ``full`` the rank at ``coords`` holds under ``spec`` (Partial dims ignored).
    ``flip=True`` is a deliberately wrong shard order (a negative control)."""
    if flip:
        coords = tuple(spec.mesh.shape[i] - 1 - c for i, c in enumerate(coords))
    return full[spec.local_slices(coords)]


def check_every_rank(model, ref_params: dict, rtol: float = 1e-4, atol: float = 2e-5) -> int:
    """Every rank's local copy of every parameter of ``model`` equals its slice of ``ref_params[name]`` (raises
    AssertionError naming the first that does not); the number of copies checked."""
    checked = 0
    for name, p in model.named_parameters():
        for r, t in p.locals.items():
            want = expected_local(ref_params[name], p.spec, p.mesh.coords_of(r))
            np.testing.assert_allclose(t.numpy(), want, rtol=rtol, atol=atol, err_msg=f"{name} on rank {r}")
            checked += 1
    return checked


def assemble(locals_: dict, spec: DistSpec) -> np.ndarray:
    """Rebuild the global tensor from every rank's local (reducing Partial dims); checks that ranks
    that must agree do agree."""
    mesh = spec.mesh
    out = np.zeros(spec.shape, dtype=np.float64)
    seen = np.zeros(spec.shape, dtype=bool)
    pdims = spec.partial_mesh_dims()
    for coords in itertools.product(*[range(s) for s in mesh.shape]):
        if any(coords[i] != 0 for i in pdims):
            continue
        value = _reduced(locals_, spec, coords, pdims)
        sl = spec.local_slices(coords)
        if seen[sl].any() and not np.allclose(out[sl], value, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"replicas disagree at mesh coords {coords} for {spec}")
        out[sl] = value
        seen[sl] = True
    if not seen.all() and seen.size:
        raise AssertionError(f"the shards of {spec} do not cover the tensor")
    return out


def _reduced(locals_, spec, coords, pdims):
    mesh = spec.mesh
    if not pdims:
        return np.asarray(locals_[mesh.rank_at(coords)].numpy(), dtype=np.float64)
    i = pdims[0]
    op = spec.placements[i].reduce_type
    terms = []
    for k in range(mesh.shape[i]):
        c = list(coords)
        c[i] = k
        terms.append(_reduced(locals_, spec, tuple(c), pdims[1:]))
    return _NP_REDUCE[op](np.stack(terms), axis=0)


def placement_choices(ndim: int, partial: bool = True):
    """Every single-mesh-dim placement for a tensor of rank ``ndim``."""
    from autoparallel.placement import Replicate, Shard

    out = [Replicate()] + [Shard(d) for d in range(ndim)]
    return out + [Partial("sum")] if partial else out
