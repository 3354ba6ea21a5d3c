"""Creation ops.

``*_like(x, ...)``: the output has x's placements with Partial replaced by R (the values of x are not
read, so x is taken as it is). ``arange``, ``full``, ``zeros``, ``ones`` have no DistSpec input: the
rule takes keyword arguments ``mesh`` (a ProcessMesh) and ``placements`` (default all R; Shard allowed,
Partial rejected) and gives the local ``start``/``end`` (arange) or ``shape`` (full/zeros/ones) per rank
in ``local_attrs``.
"""
from __future__ import annotations

import math

from autoparallel.core.mesh import ProcessMesh
from autoparallel.core.placement import Partial, Shard
from autoparallel.core.spec import DistSpec, normalize_dtype

from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, int_list


def _like(op, x, dtype):
    check_spec(op, "x", x)
    pl = tuple(R if isinstance(p, Partial) else p for p in x.placements)
    dt = normalize_dtype(dtype) if dtype is not None else x.dtype
    return SpmdResult((x,), (DistSpec(x.mesh, pl, x.shape, dt),))


@register_spmd_rule("full_like")
def full_like(x, fill_value, dtype=None, name=None):
    return _like("full_like", x, dtype)


@register_spmd_rule("zeros_like")
def zeros_like(x, dtype=None, name=None):
    return _like("zeros_like", x, dtype)


@register_spmd_rule("ones_like")
def ones_like(x, dtype=None, name=None):
    return _like("ones_like", x, dtype)


def created_spec(op, mesh, placements, shape, dtype) -> DistSpec:
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{op}: creation rules need mesh=<ProcessMesh> (the op has no DistSpec input to take "
                        f"one from), got {type(mesh).__name__}")
    pl = tuple(R for _ in range(mesh.ndim)) if placements is None else placements
    spec = DistSpec(mesh, tuple(pl), shape, dtype)
    if spec.partial_mesh_dims():
        raise ValueError(f"{op}: a created tensor cannot be Partial, got placements "
                         f"[{', '.join(map(str, spec.placements))}]")
    return spec


def _shaped(op, spec, kw="shape"):
    if not any(isinstance(p, Shard) for p in spec.placements):
        return SpmdResult((), (spec,))
    return SpmdResult((), (spec,), None, lambda coords: {kw: list(spec.local_shape(coords))})


@register_spmd_rule("arange")
def arange(start=0, end=None, step=1, dtype=None, *, mesh=None, placements=None, name=None):
    if end is None:
        start, end = 0, start
    for v in (start, end, step):
        if isinstance(v, DistSpec) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"arange: start, end and step must be python numbers, got {start!r}, {end!r}, {step!r}")
    if step == 0:
        raise ValueError("arange: step must not be zero")
    ints = all(isinstance(v, int) for v in (start, end, step))
    dt = normalize_dtype(dtype) if dtype is not None else ("int64" if ints else "float32")
    n = max(0, math.ceil((end - start) / step))
    spec = created_spec("arange", mesh, placements, (n,), dt)
    if not spec.shard_mesh_dims(0):
        return SpmdResult((), (spec,))

    def attrs(coords):
        a, b = spec.local_range(coords, 0)
        s = start + a * step
        if b <= a:
            return {"start": s, "end": s, "step": step}
        e = start + b * step if ints else s + (b - a - 0.5) * step
        return {"start": s, "end": e, "step": step}

    return SpmdResult((), (spec,), None, attrs)


def _shape_arg(op, shape):
    if isinstance(shape, DistSpec):
        raise NotImplementedError(f"{op}: a shape given as a tensor is not supported")
    return tuple(int_list(op, "shape", shape))


@register_spmd_rule("full")
def full(shape, fill_value, dtype=None, *, mesh=None, placements=None, name=None):
    dt = normalize_dtype(dtype) if dtype is not None else ("bool" if isinstance(fill_value, bool) else "float32")
    return _shaped("full", created_spec("full", mesh, placements, _shape_arg("full", shape), dt))


@register_spmd_rule("zeros")
def zeros(shape, dtype=None, *, mesh=None, placements=None, name=None):
    dt = normalize_dtype(dtype) if dtype is not None else "float32"
    return _shaped("zeros", created_spec("zeros", mesh, placements, _shape_arg("zeros", shape), dt))


@register_spmd_rule("ones")
def ones(shape, dtype=None, *, mesh=None, placements=None, name=None):
    dt = normalize_dtype(dtype) if dtype is not None else "float32"
    return _shaped("ones", created_spec("ones", mesh, placements, _shape_arg("ones", shape), dt))
