"""Per-rank local arrays from full arrays per a spec, and the full array assembled back from them."""
from __future__ import annotations

import zlib

import numpy as np

from autoparallel.placement import Replicate
from autoparallel.spec import DistSpec


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _terms(full: np.ndarray, kind: str, n: int, rng) -> list:
    """``n`` arrays whose reduction by ``kind`` is ``full``."""
    if kind in ("sum", "avg"):
        total = full * n if kind == "avg" else full
        if np.issubdtype(full.dtype, np.integer):
            parts = [rng.integers(-3, 4, size=full.shape).astype(full.dtype) for _ in range(n - 1)]
        elif full.dtype == np.bool_:
            raise ValueError("a bool tensor cannot be Partial(sum)")
        else:
            parts = [rng.standard_normal(full.shape).astype(full.dtype) for _ in range(n - 1)]
        return parts + [total - sum(parts, np.zeros_like(full))]
    owner = rng.integers(0, n, size=full.shape)
    out = []
    for j in range(n):
        gap = np.abs(rng.standard_normal(full.shape)).astype(full.dtype) + 0.5
        t = full - gap if kind == "max" else full + gap
        out.append(np.where(owner == j, full, t))
    return out


def local_input(full: np.ndarray, spec: DistSpec, coords, key) -> np.ndarray:
    arr = full
    pdims = spec.partial_mesh_dims()
    for k, m in enumerate(pdims):
        earlier = tuple(coords[q] for q in pdims[:k])
        parts = _terms(arr, spec.placements[m].reduce_type, spec.mesh.shape[m], _rng(key, m, earlier))
        arr = parts[coords[m]]
    return np.ascontiguousarray(arr[spec.local_slices(coords)])


def _reduce(kind, vals):
    if kind == "sum":
        return sum(vals[1:], vals[0])
    if kind == "avg":
        return sum(vals[1:], vals[0]) / len(vals)
    return np.maximum.reduce(vals) if kind == "max" else np.minimum.reduce(vals)


def assemble(locals_: dict, spec: DistSpec, rtol, atol) -> np.ndarray:
    """Global array from per-rank local arrays per ``spec``; raises AssertionError on inconsistency."""
    mesh = spec.mesh
    rdims = [m for m, p in enumerate(spec.placements) if isinstance(p, Replicate)]
    pdims = spec.partial_mesh_dims()
    for c, a in locals_.items():
        rep = list(c)
        for m in rdims:
            rep[m] = 0
        b = locals_[tuple(rep)]
        if a.shape != b.shape or not _close(a, b, rtol, atol):
            raise AssertionError(f"output is R on mesh dims {rdims} but ranks at {c} and {tuple(rep)} differ")

    def value(c, dims):
        if not dims:
            return locals_[tuple(c)]
        m, vals = dims[0], []
        for j in range(mesh.shape[m]):
            cc = list(c)
            cc[m] = j
            vals.append(value(cc, dims[1:]))
        return _reduce(spec.placements[m].reduce_type, vals)

    canvas = np.zeros(spec.shape, dtype=np.result_type(*[a.dtype for a in locals_.values()]))
    cover = np.zeros(spec.shape, dtype=np.int64)
    for c in np.ndindex(*mesh.shape):
        if any(c[m] != 0 for m in rdims + pdims):
            continue
        sl = spec.local_slices(c)
        canvas[sl] = value(list(c), pdims)
        cover[sl] += 1
    if spec.numel and not (cover == 1).all():
        raise AssertionError(f"the shards of the output do not tile the global shape {list(spec.shape)}")
    return canvas


def _close(a, b, rtol, atol) -> bool:
    if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
        return np.array_equal(a, b)
    return np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


def _paddle():
    import paddle

    return paddle


def _to_paddle(arr: np.ndarray, grad: bool):
    paddle = _paddle()
    t = paddle.to_tensor(arr)
    t.stop_gradient = not grad
    return t


def _outputs(out) -> list:
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _np(t):
    return None if t is None else np.asarray(t.numpy())
