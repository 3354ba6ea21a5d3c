"""Transposed convolutions (conv1d_transpose, conv2d_transpose, conv3d_transpose; both layouts) and max
unpooling (max_unpool1d/2d/3d): the up-sampling halves of UNets, decoders and GAN generators.

Transposed conv labels: batch ``n`` (shardable), input channels ``ci`` (weight dim 0, contracted: sharded x
and weight give Partial(sum), the bias then Partial), output channels ``co`` (weight dim 1, the output's
channel dim, bias dim 0). Spatial dims are whole. With ``groups > 1`` the channel dims are whole too. The
output size is paddle's: ``(in - 1) * stride - pad_before - pad_after + dilation * (k - 1) + output_padding
+ 1`` per spatial dim ('SAME' pads as the forward conv of the input would), or ``output_size`` when given.

Max unpooling scatters each value to the flat position its mask names within its own (n, c) plane: batch
and channel dims pass through with their sharding (x and indices laid out alike), spatial dims are whole.
"""
from __future__ import annotations

from spmd_rules.conv import _LAYOUTS, _ints, _padding, conv_inputs, conv_result
from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec


def _out_sizes(op, nsp, spatial, ksize, stride, padding, output_padding, dilation, output_size, cl):
    s, d = _ints(op, "stride", stride, nsp), _ints(op, "dilation", dilation, nsp)
    pads = _padding(op, padding, ksize, s, d, spatial, cl)       # 'SAME': paddle pads as the forward conv would
    op_ = _ints(op, "output_padding", output_padding, nsp)
    computed = [(spatial[i] - 1) * s[i] - pads[i][0] - pads[i][1] + d[i] * (ksize[i] - 1) + op_[i] + 1
                for i in range(nsp)]
    if output_size is None:
        return computed
    want = _ints(op, "output_size", output_size, nsp)
    for i in range(nsp):
        if not computed[i] <= want[i] < computed[i] + s[i]:
            raise ValueError(f"{op}: output_size {want} is not reachable from input size {spatial} with stride "
                             f"{s} (dim {i} must be in [{computed[i]}, {computed[i] + s[i]}))")
    return want


def _conv_transpose(op, nsp, x, weight, bias, stride, padding, output_padding, groups, dilation, output_size,
                    data_format):
    cl, n, cin, spatial = conv_inputs(op, nsp, x, weight, bias, data_format)
    w_cin, cout_g, ksize = weight.shape[0], weight.shape[1], list(weight.shape[2:])
    if not isinstance(groups, int) or groups < 1 or cin != w_cin or cin % groups:
        raise ValueError(f"{op}: x has {cin} input channels but weight shape {list(weight.shape)} with "
                         f"groups={groups!r} expects {w_cin} (weight dim 0) divisible by groups")
    cout = cout_g * groups
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"{op}: bias must have shape [{cout}], got {list(bias.shape)}")
    out_sp = _out_sizes(op, nsp, spatial, ksize, stride, padding, output_padding, dilation, output_size, cl)
    return conv_result(op, x, weight, bias, cl, (n, cin, cout), out_sp, groups, ("ci", "co"))


def _register_transpose(nsp):
    op = f"conv{nsp}d_transpose"

    def rule(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1,
             output_size=None, data_format=_LAYOUTS[nsp][0], name=None):
        return _conv_transpose(op, nsp, x, weight, bias, stride, padding, output_padding, groups, dilation,
                               output_size, data_format)

    def rule2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
               output_size=None, data_format="NCHW", name=None):     # paddle's 2-D order: dilation, groups
        return _conv_transpose(op, nsp, x, weight, bias, stride, padding, output_padding, groups, dilation,
                               output_size, data_format)

    rule = rule2d if nsp == 2 else rule

    rule.__name__ = op
    register_spmd_rule(op, rule)


def _register_unpool(nsp):
    op = f"max_unpool{nsp}d"

    def rule(x, indices, kernel_size, stride=None, padding=0, data_format=_LAYOUTS[nsp][0], output_size=None,
             name=None):
        check_spec(op, "x", x)
        check_spec(op, "indices", indices)
        if data_format != _LAYOUTS[nsp][0]:
            raise ValueError(f"{op}: data_format must be {_LAYOUTS[nsp][0]!r}, got {data_format!r}")
        if x.ndim != nsp + 2 or tuple(indices.shape) != tuple(x.shape):
            raise ValueError(f"{op}: x must be {nsp + 2}-D and indices of the same shape, got {list(x.shape)} "
                             f"and {list(indices.shape)}")
        k = _ints(op, "kernel_size", kernel_size, nsp)
        s = k if stride is None else _ints(op, "stride", stride, nsp)
        p = _ints(op, "padding", padding, nsp)
        sizes = [(x.shape[2 + i] - 1) * s[i] - 2 * p[i] + k[i] for i in range(nsp)]
        if output_size is not None:
            given = [int(v) for v in output_size]
            sizes = given[-nsp:] if len(given) in (nsp, nsp + 2) else sizes
        lab = ("n", "c") + (None,) * nsp
        shape = tuple(x.shape[:2]) + tuple(sizes)
        return labels_result(op, [x, indices], [lab, lab], [lab], [(shape, x.dtype)], linear=None)

    rule.__name__ = op
    register_spmd_rule(op, rule)


for _n in (1, 2, 3):
    _register_transpose(_n)
    _register_unpool(_n)
