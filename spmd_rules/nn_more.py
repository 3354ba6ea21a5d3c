"""``interpolate`` / ``upsample`` and the order statistics ``quantile`` / ``nanquantile`` / ``kthvalue`` /
``mode``.

Interpolation: batch and channel dims keep their sharding, the resized spatial dims are needed whole; every
mode is linear in ``x`` (a weighted sum of input pixels), so P(sum) passes. Order statistics need the
reduced axes whole; other dims keep their sharding.
"""
from __future__ import annotations

import numbers

from autoparallel.core.spec import DistSpec

from spmd_rules.einsum import ALL, labels_result
from spmd_rules.reduction import reduce_labels
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec, is_float, norm_axes, norm_axis

_DEFAULT = {3: "NCW", 4: "NCHW", 5: "NCDHW"}
_FORMATS = {3: ("NCW", "NWC"), 4: ("NCHW", "NHWC"), 5: ("NCDHW", "NDHWC")}


def _per_dim(op, name, v, n):
    if isinstance(v, DistSpec):
        raise NotImplementedError(f"{op}: {name} given as a tensor is not supported on distributed tensors; pass "
                                  f"python numbers")
    if isinstance(v, numbers.Number):
        return [v] * n
    v = list(v)
    if any(isinstance(a, DistSpec) for a in v):
        raise NotImplementedError(f"{op}: {name} given as tensors is not supported on distributed tensors")
    if len(v) != n:
        raise ValueError(f"{op}: {name} must have {n} entries for a {n + 2}-D input, got {v!r}")
    return v


def _interpolate(op, x, size, scale_factor, data_format):
    check_spec(op, "x", x)
    if x.ndim not in _FORMATS:
        raise ValueError(f"{op}: x must be 3-D, 4-D or 5-D, got shape {list(x.shape)}")
    fmt = data_format or _DEFAULT[x.ndim]
    if fmt not in _FORMATS[x.ndim]:
        raise ValueError(f"{op}: data_format for a {x.ndim}-D input must be one of {_FORMATS[x.ndim]}, got {fmt!r}")
    n = x.ndim - 2
    dims = list(range(1, 1 + n)) if fmt.endswith("C") else list(range(2, 2 + n))
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{op}: exactly one of size and scale_factor must be set")
    if size is not None:
        out = [int(s) for s in _per_dim(op, "size", size, n)]
    else:
        out = [int(x.shape[d] * float(f)) for d, f in zip(dims, _per_dim(op, "scale_factor", scale_factor, n))]
    lab = tuple(None if d in dims else d for d in range(x.ndim))
    shape = list(x.shape)
    for d, o in zip(dims, out):
        shape[d] = o
    return labels_result(op, [x], [lab], [lab], [(tuple(shape), x.dtype)], linear=ALL)


@register_spmd_rule("interpolate")
def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=False, align_mode=0,
                data_format=None, recompute_scale_factor=None, antialias=False, name=None):
    return _interpolate("interpolate", x, size, scale_factor, data_format)


@register_spmd_rule("upsample")
def upsample(x, size=None, scale_factor=None, mode="nearest", align_corners=False, align_mode=0, data_format=None,
             name=None):
    return _interpolate("upsample", x, size, scale_factor, data_format)


# ---- order statistics ------------------------------------------------------------------------------------------------
def _quantile(op):
    def rule(x, q, axis=None, keepdim=False, interpolation="linear", name=None, *, out=None):
        check_spec(op, "x", x)
        if isinstance(q, DistSpec):
            raise NotImplementedError(f"{op}: q given as a tensor is not supported on distributed tensors; pass "
                                      f"python floats")
        if interpolation not in ("linear", "lower", "higher", "nearest", "midpoint"):
            raise ValueError(f"{op}: unknown interpolation {interpolation!r}")
        axes = norm_axes(op, axis, x.ndim)
        xl, ol, shape = reduce_labels(x, axes, keepdim, reducible=False)
        dtype = x.dtype if is_float(x.dtype) else "float32"
        if isinstance(q, (list, tuple)) and len(q) > 1:        # paddle gives one q no leading dim, as a number
            ol, shape = (None,) + tuple(ol), (len(q),) + tuple(shape)
        return labels_result(op, [x], [xl], [ol], [(shape, dtype)], linear=None)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_quantile("quantile")
_quantile("nanquantile")


def _select(op, x, axis, keepdim):
    a = norm_axis(op, -1 if axis is None else axis, x.ndim)
    xl, ol, shape = reduce_labels(x, (a,), keepdim, reducible=False)
    return labels_result(op, [x], [xl], [ol, ol], [(shape, x.dtype), (shape, "int64")], linear=None), a


@register_spmd_rule("kthvalue")
def kthvalue(x, k, axis=None, keepdim=False, name=None):
    check_spec("kthvalue", "x", x)
    res, a = _select("kthvalue", x, axis, keepdim)
    if not 1 <= int(k) <= x.shape[a]:
        raise ValueError(f"kthvalue: k={k} is out of range for axis {a} of size {x.shape[a]}")
    return res


@register_spmd_rule("mode")
def mode(x, axis=-1, keepdim=False, name=None):
    check_spec("mode", "x", x)
    return _select("mode", x, axis, keepdim)[0]
