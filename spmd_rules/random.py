"""Randomness: dropout and random creation (rand, randn, uniform, randint).

Sharded and replicated tensors get the values a single process would: the local op draws for the
GLOBAL shape from the generator state shared by every rank of the mesh and keeps this rank's slice
(``local_attrs``: ``global_shape`` and ``local_slices`` as [start, stop) pairs per dim). Local op names:
``sharded_dropout`` (dropout's keep-mask, then paddle's scaling) and ``sharded_random`` (the created
tensor). Dropout in eval mode or with p == 0 is deterministic (identity, or scaling by 1 - p in
'downscale_in_infer' mode) and runs as the plain op; it is linear, so Partials pass.
"""
from __future__ import annotations

from spmd_rules.creation import created_spec, _shape_arg
from spmd_rules.einsum import ALL, labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec
from autoparallel.core.spec import normalize_dtype


def _slices(spec):
    def attrs(coords):
        return {"global_shape": list(spec.shape),
                "local_slices": [list(spec.local_range(coords, d)) for d in range(spec.ndim)]}
    return attrs


@register_spmd_rule("dropout")
def dropout(x, p=0.5, axis=None, training=True, inplace=False, mode="upscale_in_train", name=None):
    check_spec("dropout", "x", x)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    labels = tuple(range(x.ndim))
    if not training or p == 0:
        return labels_result("dropout", [x], [labels], [labels], [(x.shape, x.dtype)], linear=ALL)
    res = labels_result("dropout", [x], [labels], [labels], [(x.shape, x.dtype)], linear=None)
    return SpmdResult(res.inputs, res.outputs, "sharded_dropout", _slices(res.outputs[0]))


def _random(op, shape, dtype, default, mesh, placements):
    dt = normalize_dtype(dtype) if dtype is not None else default
    spec = created_spec(op, mesh, placements, _shape_arg(op, shape), dt)
    return SpmdResult((), (spec,), "sharded_random", _slices(spec))


@register_spmd_rule("rand")
def rand(shape, dtype=None, name=None, *, mesh=None, placements=None):
    return _random("rand", shape, dtype, "float32", mesh, placements)


@register_spmd_rule("randn")
def randn(shape, dtype=None, name=None, *, mesh=None, placements=None):
    return _random("randn", shape, dtype, "float32", mesh, placements)


@register_spmd_rule("uniform")
def uniform(shape, dtype=None, min=-1.0, max=1.0, seed=0, name=None, *, mesh=None, placements=None):
    return _random("uniform", shape, dtype, "float32", mesh, placements)


@register_spmd_rule("randint")
def randint(low=0, high=None, shape=(1,), dtype=None, name=None, *, mesh=None, placements=None):
    return _random("randint", shape, dtype, "int64", mesh, placements)
