"""conv2d for data-parallel (batch sharded) and channel-parallel CNNs.

Labels: batch ``n`` (shardable), input channels ``ci`` (contracted: sharded x and weight give
Partial(sum), the bias then Partial like ``linear``'s), output channels ``co`` (weight dim 0, output
channel dim, bias dim 0). Spatial dims are whole (halos are not exchanged). With ``groups > 1`` the
channel dims are whole too.
"""
from __future__ import annotations

from autoparallel.core.placement import Partial, Shard

from spmd_rules.einsum import label_rule
from spmd_rules.expand import expand, present
from spmd_rules.registry import register_spmd_rule
from spmd_rules.result import SpmdResult
from spmd_rules.utils import R, check_spec, promote, numel


def _pair(op, name, v):
    if isinstance(v, int):
        return [v, v]
    v = list(v)
    if len(v) == 1:
        return [v[0], v[0]]
    if len(v) != 2:
        raise ValueError(f"{op}: {name} must be an int or two ints, got {v!r}")
    return v


def _padding(op, padding, ksize, stride, dilation, in_hw, channel_last):
    if isinstance(padding, str):
        p = padding.upper()
        if p == "VALID":
            return [(0, 0), (0, 0)]
        if p == "SAME":
            out = []
            for i in range(2):
                o = -(-in_hw[i] // stride[i])
                total = max(0, (o - 1) * stride[i] + dilation[i] * (ksize[i] - 1) + 1 - in_hw[i])
                out.append((total // 2, total - total // 2))
            return out
        raise ValueError(f"{op}: padding string must be 'SAME' or 'VALID', got {padding!r}")
    if isinstance(padding, int):
        return [(padding, padding)] * 2
    pad = list(padding)
    if len(pad) == 2 and all(isinstance(v, int) for v in pad):
        return [(pad[0], pad[0]), (pad[1], pad[1])]
    if len(pad) == 4 and all(isinstance(v, int) for v in pad):
        return [(pad[0], pad[1]), (pad[2], pad[3])]
    if len(pad) == 4 and all(isinstance(v, (list, tuple)) for v in pad):
        sp = pad[1:3] if channel_last else pad[2:4]
        return [tuple(sp[0]), tuple(sp[1])]
    raise ValueError(f"{op}: unsupported padding {padding!r}")


@register_spmd_rule("conv2d")
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, data_format="NCHW", name=None):
    op = "conv2d"
    check_spec(op, "x", x)
    check_spec(op, "weight", weight)
    check_spec(op, "bias", bias, optional=True)
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"{op}: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    if x.ndim != 4 or weight.ndim != 4:
        raise ValueError(f"{op}: x and weight must be 4-D, got shapes {list(x.shape)} and {list(weight.shape)}")
    cl = data_format == "NHWC"
    n, cin = x.shape[0], x.shape[3 if cl else 1]
    hw = [x.shape[1], x.shape[2]] if cl else [x.shape[2], x.shape[3]]
    cout, cin_g, kh, kw = weight.shape
    if cin != cin_g * groups:
        raise ValueError(f"{op}: x has {cin} input channels but weight shape {list(weight.shape)} with "
                         f"groups={groups} expects {cin_g * groups}")
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"{op}: bias must have shape [{cout}], got {list(bias.shape)}")
    s, d = _pair(op, "stride", stride), _pair(op, "dilation", dilation)
    pads = _padding(op, padding, [kh, kw], s, d, hw, cl)
    out_hw = [(hw[i] + pads[i][0] + pads[i][1] - d[i] * ((kh, kw)[i] - 1) - 1) // s[i] + 1 for i in range(2)]
    ci, co = ("ci", "co") if groups == 1 else (None, None)
    if cl:
        xl, ol, shape = ("n", None, None, ci), ("n", None, None, co), (n, out_hw[0], out_hw[1], cout)
    else:
        xl, ol, shape = ("n", ci, None, None), ("n", co, None, None), (n, cout, out_hw[0], out_hw[1])
    wl = (co, ci, None, None)
    inner = label_rule([xl, wl], [ol], [numel(x), numel(weight)])
    ch = ol.index(co) if co else None

    def rule(pl, dim):
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
