"""transpose, t, unsqueeze, squeeze, expand, broadcast_to: label-based, linear (Partials pass).

A squeezed dim and a dim that expand broadcasts must be whole; new dims are R. expand's local target
shape is rank-dependent with shards: ``local_attrs(coords)`` gives it. squeeze on a sharded tensor reshapes
to its local output shape (``squeeze_to``): paddle would also drop a kept dim whose shard has one row.
"""
from __future__ import annotations

import itertools

from autoparallel.core.placement import Shard

from spmd_rules.blocks import block_aware
from spmd_rules.einsum import ALL, label_reverse, labels_result
from spmd_rules.expand import expand_reverse
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec, int_list, norm_axis


def _perm(op, x, perm):
    perm = int_list(op, "perm", perm)
    if sorted(p % x.ndim if x.ndim else p for p in perm) != list(range(x.ndim)) or len(perm) != x.ndim:
        raise ValueError(f"{op}: perm {perm} is not a permutation of the {x.ndim} dims of shape {list(x.shape)}")
    return [p % x.ndim for p in perm]


def _transpose_reverse(outputs, x, perm, name=None):
    perm = _perm("transpose", x, perm)
    return SpmdResult(expand_reverse("transpose", [x], outputs,
                                     label_reverse([tuple(range(x.ndim))], [tuple(perm)])), outputs)


@register_spmd_rule("transpose", reverse=_transpose_reverse)
@block_aware
def transpose(x, perm, name=None):
    check_spec("transpose", "x", x)
    perm = _perm("transpose", x, perm)
    shape = tuple(x.shape[p] for p in perm)
    return labels_result("transpose", [x], [tuple(range(x.ndim))], [tuple(perm)], [(shape, x.dtype)], linear=ALL)


@register_spmd_rule("t")
@block_aware
def t(x, name=None):
    check_spec("t", "x", x)
    if x.ndim > 2:
        raise ValueError(f"t: expects a tensor of rank <= 2, got shape {list(x.shape)}")
    return transpose(x, list(range(x.ndim))[::-1])


@register_spmd_rule("unsqueeze")
@block_aware
def unsqueeze(x, axis, name=None):
    check_spec("unsqueeze", "x", x)
    axes = int_list("unsqueeze", "axis", axis)
    nd = x.ndim + len(axes)
    out = list(range(x.ndim))
    shape = list(x.shape)
    for a in axes:                       # paddle inserts in order, each axis relative to the current rank
        a = norm_axis("unsqueeze", a, len(out), allow_end=True)
        out.insert(a, None)
        shape.insert(a, 1)
    if len(out) != nd:
        raise ValueError(f"unsqueeze: bad axis {axis!r}")
    return labels_result("unsqueeze", [x], [tuple(range(x.ndim))], [tuple(out)], [(tuple(shape), x.dtype)],
                         linear=ALL)


@register_spmd_rule("squeeze")
@block_aware
def squeeze(x, axis=None, name=None):
    check_spec("squeeze", "x", x)
    if axis is not None and not int_list("squeeze", "axis", axis):
        axis = None                                          # paddle: an empty axis list squeezes every 1
    if axis is None:
        axes = {d for d in range(x.ndim) if x.shape[d] == 1}
    else:
        axes = {norm_axis("squeeze", a, x.ndim) for a in int_list("squeeze", "axis", axis)}
        axes = {a for a in axes if x.shape[a] == 1}          # paddle ignores non-1 dims
    xl = tuple(None if d in axes else d for d in range(x.ndim))
    ol = tuple(d for d in range(x.ndim) if d not in axes)
    shape = tuple(x.shape[d] for d in ol)
    res = labels_result("squeeze", [x], [xl], [ol], [(shape, x.dtype)], linear=ALL)
    out = res.outputs[0]
    if not _squeezes_a_kept_dim(res.inputs[0], out, axis):
        return res
    # a kept dim split down to one row on some rank would be squeezed there too: reshape to the local shape
    return SpmdResult(res.inputs, res.outputs, "squeeze_to", lambda coords: {"shape": list(out.local_shape(coords))})


def _squeezes_a_kept_dim(x, out, axis) -> bool:
    """True when paddle's squeeze of some rank's shard of ``x`` would not give that rank's shard of ``out``."""
    if not any(isinstance(p, Shard) for p in out.placements):
        return False
    asked = None if axis is None else {a % x.ndim for a in int_list("squeeze", "axis", axis)}
    for coords in itertools.product(*(range(n) for n in x.mesh.shape)):
        local = x.local_shape(coords)
        kept = tuple(n for d, n in enumerate(local) if n != 1 or (asked is not None and d not in asked))
        if kept != tuple(out.local_shape(coords)):
            return True
    return False


def _expand_shape(op, x, shape):
    shape = int_list(op, "shape", shape)
    if len(shape) < x.ndim:
        raise ValueError(f"{op}: target shape {shape} has fewer dims than x {list(x.shape)}")
    off = len(shape) - x.ndim
    out = []
    for i, s in enumerate(shape):
        src = x.shape[i - off] if i >= off else None
        if s == -1:
            if src is None:
                raise ValueError(f"{op}: -1 in a new leading dim of target shape {shape}")
            s = src
        if src is not None and src != 1 and src != s:
            raise ValueError(f"{op}: cannot expand shape {list(x.shape)} to {shape}")
        out.append(s)
    xl = tuple(off + j if x.shape[j] == out[off + j] else None for j in range(x.ndim))
    return tuple(out), xl


def _expand(op, x, shape, kw):
    check_spec(op, "x", x)
    out_shape, xl = _expand_shape(op, x, shape)
    res = labels_result(op, [x], [xl], [tuple(range(len(out_shape)))], [(out_shape, x.dtype)], linear=ALL)
    out = res.outputs[0]
    if not any(isinstance(p, Shard) for p in out.placements):
        return res
    return SpmdResult(res.inputs, res.outputs, None, lambda coords: {kw: list(out.local_shape(coords))})


@register_spmd_rule("expand")
def expand(x, shape, name=None):
    return _expand("expand", x, shape, "shape")


@register_spmd_rule("broadcast_to")
def broadcast_to(x, shape, name=None):
    return _expand("broadcast_to", x, shape, "shape")
