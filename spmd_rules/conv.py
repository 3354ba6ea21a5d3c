"""Convolutions (conv1d, conv2d, conv3d; every layout paddle accepts) for data-parallel (batch sharded) and
channel-parallel models.

Labels: batch ``n`` (shardable), input channels ``ci`` (contracted: sharded x and weight give
Partial(sum), the bias then Partial like ``linear``'s), output channels ``co`` (weight dim 0, output
channel dim, bias dim 0). Spatial dims are whole (halos are not exchanged). With ``groups > 1`` (a
depthwise conv, e.g. the causal conv of linear-attention layers) the channel dims are whole too.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial, Shard

from spmd_rules.einsum import label_rule
from spmd_rules.expand import expand, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, promote, numel

_LAYOUTS = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}


def _ints(op, name, v, n):
    """An int or n ints (one int stands for every spatial dim) -> list of n ints."""
    if isinstance(v, int) and not isinstance(v, bool):
        return [v] * n
    v = list(v)
    if len(v) == 1:
        v = v * n
    if len(v) != n or not all(isinstance(i, int) for i in v):
        raise ValueError(f"{op}: {name} must be an int or {n} ints, got {v!r}")
    return v


def _padding(op, padding, ksize, stride, dilation, spatial, channel_last):
    """(before, after) per spatial dim, for every padding form paddle's convs accept."""
    n = len(spatial)
    if isinstance(padding, str):
        p = padding.upper()
        if p == "VALID":
            return [(0, 0)] * n
        if p == "SAME":
            out = []
            for i in range(n):
                o = -(-spatial[i] // stride[i])
                total = max(0, (o - 1) * stride[i] + dilation[i] * (ksize[i] - 1) + 1 - spatial[i])
                out.append((total // 2, total - total // 2))
            return out
        raise ValueError(f"{op}: padding string must be 'SAME' or 'VALID', got {padding!r}")
    if isinstance(padding, int):
        return [(padding, padding)] * n
    pad = list(padding)
    if len(pad) == n + 2 and all(isinstance(v, (list, tuple)) for v in pad):
        sp = pad[1:n + 1] if channel_last else pad[2:]
        return [tuple(v) for v in sp]
    if len(pad) == 2 * n and all(isinstance(v, int) for v in pad) and n > 1:
        return [(pad[2 * i], pad[2 * i + 1]) for i in range(n)]
    if len(pad) in (1, n) and all(isinstance(v, int) for v in pad):
        return [(v, v) for v in (pad * n if len(pad) == 1 else pad)]
    if n == 1 and len(pad) == 2 and all(isinstance(v, int) for v in pad):
        return [(pad[0], pad[1])]
    raise ValueError(f"{op}: unsupported padding {padding!r}")


def _leaves_empty(n: int, k: int) -> bool:
    """Ceil-division shards of ``n`` over ``k`` leave a rank without any (6 over 4 -> 2, 2, 2, 0)."""
    return -(-n // k) * (k - 1) >= n


def conv_inputs(op, nsp, x, weight, bias, data_format):
    """The checks every (transposed) convolution makes of its operands; (channel_last, n, in channels,
    spatial sizes)."""
    check_spec(op, "x", x)
    check_spec(op, "weight", weight)
    check_spec(op, "bias", bias, optional=True)
    if data_format not in _LAYOUTS[nsp]:
        raise ValueError(f"{op}: data_format must be one of {_LAYOUTS[nsp]}, got {data_format!r}")
    if x.ndim != nsp + 2 or weight.ndim != nsp + 2:
        raise ValueError(f"{op}: x and weight must be {nsp + 2}-D, got shapes {list(x.shape)} and "
                         f"{list(weight.shape)}")
    cl = data_format == _LAYOUTS[nsp][1]
    return cl, x.shape[0], x.shape[-1 if cl else 1], (list(x.shape[1:-1]) if cl else list(x.shape[2:]))


def _conv(op, nsp, x, weight, bias, stride, padding, dilation, groups, data_format):
    cl, n, cin, spatial = conv_inputs(op, nsp, x, weight, bias, data_format)
    cout, cin_g, ksize = weight.shape[0], weight.shape[1], list(weight.shape[2:])
    if not isinstance(groups, int) or groups < 1 or cin != cin_g * groups:
        raise ValueError(f"{op}: x has {cin} input channels but weight shape {list(weight.shape)} with "
                         f"groups={groups!r} expects {cin_g * groups if isinstance(groups, int) else '?'}")
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"{op}: bias must have shape [{cout}], got {list(bias.shape)}")
    s, d = _ints(op, "stride", stride, nsp), _ints(op, "dilation", dilation, nsp)
    pads = _padding(op, padding, ksize, s, d, spatial, cl)
    out_sp = [(spatial[i] + pads[i][0] + pads[i][1] - d[i] * (ksize[i] - 1) - 1) // s[i] + 1 for i in range(nsp)]
    return conv_result(op, x, weight, bias, cl, (n, cin, cout), out_sp, groups, ("co", "ci"))


def conv_result(op, x, weight, bias, cl, sizes, out_sp, groups, w_labels):
    """The rule of a (transposed) convolution: batch ``n`` shardable, spatial dims whole, x's channels ``ci``
    contracted with the weight's (Partial(sum)), the weight's ``co`` the output's channel dim; the weight's two
    leading dims carry ``w_labels`` (("co", "ci") forward, ("ci", "co") transposed). With ``groups > 1`` the
    channel dims are whole too. A channel split that would leave a shard empty is gathered; the bias follows the
    output's channel label, or its Partial. ``sizes`` = (n, in channels, out channels)."""
    n, cin, cout = sizes
    whole = (None,) * len(out_sp)
    ci, co = ("ci", "co") if groups == 1 else (None, None)
    if cl:
        xl, ol, shape = ("n",) + whole + (ci,), ("n",) + whole + (co,), (n, *out_sp, cout)
    else:
        xl, ol, shape = ("n", ci) + whole, ("n", co) + whole, (n, cout, *out_sp)
    wl = tuple({"ci": ci, "co": co}[w] for w in w_labels) + whole
    channels = {(0, xl.index(ci)): cin, (1, 0): weight.shape[0], (1, 1): weight.shape[1]} if ci else {}
    inner = label_rule([xl, wl], [ol], [numel(x), numel(weight)])
    ch = ol.index(co) if co else None

    def rule(pl, dim):
        pl = list(pl)
        for i in (0, 1):      # paddle's conv kernels refuse an empty channel shard: such a split is gathered
            p = pl[i]
            if isinstance(p, Shard) and (i, p.dim) in channels and _leaves_empty(channels[(i, p.dim)], dim.size):
                pl[i] = R
        (rx, rw), (o,) = inner(pl[:2], dim)
        if pl[2] is None:
            rb = None
        elif isinstance(o, Partial):
            rb = o
        elif isinstance(o, Shard) and o.dim == ch:
            rb = Shard(0)
        else:
            rb = R
        return (rx, rw, rb), (o,)

    dtype = promote(x.dtype, weight.dtype)
    required, outputs = expand(op, [x, weight, bias], [(shape, dtype)], rule, nested=True)
    return SpmdResult(present(required), outputs)


@register_spmd_rule("conv1d")
def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, data_format="NCL", name=None):
    return _conv("conv1d", 1, x, weight, bias, stride, padding, dilation, groups, data_format)


@register_spmd_rule("conv2d")
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, data_format="NCHW", name=None):
    return _conv("conv2d", 2, x, weight, bias, stride, padding, dilation, groups, data_format)


@register_spmd_rule("conv3d")
def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, data_format="NCDHW", name=None):
    return _conv("conv3d", 3, x, weight, bias, stride, padding, dilation, groups, data_format)
