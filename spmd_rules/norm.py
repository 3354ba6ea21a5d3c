"""layer_norm, rms_norm, batch_norm.

layer_norm / rms_norm: the normalized (trailing) dims must be whole; leading dims keep their sharding;
weight and bias are R; Partial inputs need R. paddle's ``rms_norm`` also returns ``invvar`` of shape
[rows] (the leading dims flattened, float32): only the FIRST leading dim may stay sharded there (when
its chunks line up with the flattened rows); other leading dims are required R. Models that want
sequence-parallel RMSNorm write it from basic ops (paddle has no CPU rms_norm kernel anyway).

batch_norm: the channel dim may be sharded (stats, weight and bias then shard dim 0 alike: channels are
independent) -- in training mode only where the running stats are split alike, since they are updated in
place (otherwise x's channels are gathered). In training mode (batch statistics) a sharded batch or
spatial dim needs statistics over the whole tensor: the local op is ``sync_batch_norm`` (the runtime
all-reduces the per-channel sum, sum of squares and count over ``local_attrs()['stat_mesh_dims']`` before
normalising and updating the running stats, which stay R or channel-sharded). In eval mode (or ``use_global_stats``) every dim may
stay sharded and the plain op runs locally.
"""
from __future__ import annotations

import math

from autoparallel.core.placement import Shard, chunk_range

from spmd_rules.einsum import label_reverse, label_rule, labels_result
from spmd_rules.expand import expand, expand_reverse, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import check_spec, int_list, numel


def _normalized(op, x, normalized_shape):
    ns = int_list(op, "normalized_shape", normalized_shape)
    k = len(ns)
    if k > x.ndim or list(x.shape[x.ndim - k:]) != ns:
        raise ValueError(f"{op}: normalized_shape {ns} does not match the trailing dims of x shape {list(x.shape)}")
    return k


def _param_check(op, name, p, ns_numel, shape):
    if p is None:
        return
    check_spec(op, name, p)
    if p.numel != ns_numel:
        raise ValueError(f"{op}: {name} must have {ns_numel} elements (normalized_shape {list(shape)}), "
                         f"got shape {list(p.shape)}")


def _layer_norm_labels(x, k):
    return tuple(d if d < x.ndim - k else None for d in range(x.ndim))


def _ln_reverse(outputs, x, normalized_shape, weight=None, bias=None, epsilon=1e-05, name=None):
    k = _normalized("layer_norm", x, normalized_shape)
    xl = _layer_norm_labels(x, k)
    labs = [xl] + [(None,) * p.ndim for p in (weight, bias) if p is not None]
    specs = [x] + [p for p in (weight, bias) if p is not None]
    return SpmdResult(expand_reverse("layer_norm", specs, outputs, label_reverse(labs, [xl], linear=None)), outputs)


@register_spmd_rule("layer_norm", reverse=_ln_reverse)
def layer_norm(x, normalized_shape, weight=None, bias=None, epsilon=1e-05, name=None):
    check_spec("layer_norm", "x", x)
    k = _normalized("layer_norm", x, normalized_shape)
    ns = x.shape[x.ndim - k:]
    _param_check("layer_norm", "weight", weight, math.prod(ns), ns)
    _param_check("layer_norm", "bias", bias, math.prod(ns), ns)
    xl = _layer_norm_labels(x, k)
    labs = [xl, (None,) * (weight.ndim if weight else 0), (None,) * (bias.ndim if bias else 0)]
    return labels_result("layer_norm", [x, weight, bias], labs, [xl], [(x.shape, x.dtype)], linear=None)


def _rows_aligned(x, lead: int, sizes) -> bool:
    rows = math.prod(x.shape[:lead])
    inner = rows // x.shape[0] if x.shape[0] else 0
    for k in sizes:
        for r in range(k):
            a, b = chunk_range(x.shape[0], k, r)
            if (a * inner, b * inner) != chunk_range(rows, k, r):
                return False
    return True


@register_spmd_rule("rms_norm")
def rms_norm(x, normalized_shape, weight=None, eps=1e-05, name=None):
    check_spec("rms_norm", "x", x)
    k = _normalized("rms_norm", x, normalized_shape)
    ns = x.shape[x.ndim - k:]
    _param_check("rms_norm", "weight", weight, math.prod(ns), ns)
    lead = x.ndim - k
    first_ok = lead >= 1 and _rows_aligned(x, lead, set(x.mesh.shape))
    xl = tuple(0 if (d == 0 and first_ok) else None for d in range(x.ndim))
    inner = label_rule([xl, (None,) * (weight.ndim if weight else 0)], [xl],
                       [numel(x), numel(weight)], linear=None)

    def rule(pl, dim):
        req, (o,) = inner(pl, dim)
        inv = Shard(0) if isinstance(o, Shard) else o
        return req, (o, inv)

    rows = math.prod(x.shape[:lead])
    required, outputs = expand("rms_norm", [x, weight], [(x.shape, x.dtype), ((rows,), "float32")], rule)
    return SpmdResult(present(required), outputs)


def _stats_share_channels(x, c, stats):
    """Training updates the running statistics in place. Where x's channels are split on a mesh dim but a
    running statistic is not (replicated stats after a channel-parallel conv), splitting the statistic would
    update a resharded copy, lost: x's channels are gathered on that dim instead (as if x were replicated)."""
    from autoparallel.core.placement import Replicate

    stats = [s for s in stats if s is not None]
    pl = list(x.placements)
    for m, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim == c and any(s.placements[m] != Shard(0) for s in stats):
            pl[m] = Replicate()
    return x if tuple(pl) == tuple(x.placements) else x.with_placements(pl)


@register_spmd_rule("batch_norm")
def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.9,
               epsilon=1e-05, data_format="NCHW", use_global_stats=None, name=None):
    op = "batch_norm"
    check_spec(op, "x", x)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2, got shape {list(x.shape)}")
    if not isinstance(data_format, str) or data_format not in ("NC", "NCL", "NCHW", "NCDHW", "NLC", "NHWC", "NDHWC"):
        raise ValueError(f"{op}: unsupported data_format {data_format!r}")
    c = 1 if data_format.startswith("NC") else x.ndim - 1
    C = x.shape[c]
    for name_, p in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                     ("bias", bias)):
        if p is None:
            continue
        check_spec(op, name_, p)
        if tuple(p.shape) != (C,):
            raise ValueError(f"{op}: {name_} must have shape [{C}] (channels of x {list(x.shape)}), got "
                             f"{list(p.shape)}")
    batch_stats = training and not use_global_stats
    if batch_stats:
        x = _stats_share_channels(x, c, (running_mean, running_var))
    xl = tuple("c" if d == c else d for d in range(x.ndim))
    params = [running_mean, running_var, weight, bias]
    labs = [xl] + [("c",) if p is not None else () for p in params]
    res = labels_result(op, [x] + params, labs, [xl], [(x.shape, x.dtype)], linear=None)
    req = res.inputs[0]
    stat_dims = tuple(m for m, p in enumerate(req.placements) if isinstance(p, Shard) and p.dim != c)
    if batch_stats and stat_dims:
        return SpmdResult(res.inputs, res.outputs, "sync_batch_norm", lambda coords: {"stat_mesh_dims": stat_dims})
    return res
