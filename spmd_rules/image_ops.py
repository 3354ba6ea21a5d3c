"""Sliding-window and sampling ops of vision models: ``unfold`` (im2col), ``fold`` (col2im) and
``grid_sample`` (spatial transformers, deformable sampling).

The batch dim is shardable (each sample is independent) and, for ``grid_sample``, the channels of ``x`` too
(every channel is sampled at the same grid points); the sliding or sampled spatial dims are whole.
``unfold`` / ``fold`` interleave channels with kernel offsets in dim 1, kept whole. ``grid_sample`` is linear in
``x`` (a Partial x stays Partial) but not in ``grid``.
"""
from __future__ import annotations

from spmd_rules.einsum import labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec


def _pair(op, name, v, n=2):
    if isinstance(v, int) and not isinstance(v, bool):
        return [v] * n
    v = [int(a) for a in v]
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise ValueError(f"{op}: {name} must be an int or {n} ints, got {v!r}")
    return v


def _pads(op, paddings):
    """(top, left, bottom, right) from paddle's Size2 / Size4 forms."""
    if isinstance(paddings, int) and not isinstance(paddings, bool):
        return [paddings] * 4
    p = [int(a) for a in paddings]
    if len(p) == 2:
        return [p[0], p[1], p[0], p[1]]
    if len(p) == 4:
        return p
    raise ValueError(f"{op}: paddings must be an int, 2 or 4 ints, got {paddings!r}")


def _blocks(op, sizes, k, s, p, d):
    out = []
    for i in range(2):
        span = sizes[i] + p[i] + p[i + 2] - (d[i] * (k[i] - 1) + 1)
        if span < 0:
            raise ValueError(f"{op}: kernel {k} with dilation {d} does not fit the padded size {sizes}")
        out.append(span // s[i] + 1)
    return out


@register_spmd_rule("unfold")
def unfold(x, kernel_sizes, strides=1, paddings=0, dilations=1, name=None):
    op = "unfold"
    check_spec(op, "x", x)
    if x.ndim != 4:
        raise ValueError(f"{op}: x must be 4-D (NCHW), got shape {list(x.shape)}")
    k, s, d = _pair(op, "kernel_sizes", kernel_sizes), _pair(op, "strides", strides), _pair(op, "dilations", dilations)
    n, c, h, w = x.shape
    bh, bw = _blocks(op, [h, w], k, s, _pads(op, paddings), d)
    shape = (n, c * k[0] * k[1], bh * bw)
    return labels_result(op, [x], [("n", None, None, None)], [("n", None, None)], [(shape, x.dtype)])


@register_spmd_rule("fold")
def fold(x, output_sizes, kernel_sizes, strides=1, paddings=0, dilations=1, name=None):
    op = "fold"
    check_spec(op, "x", x)
    if x.ndim != 3:
        raise ValueError(f"{op}: x must be 3-D [N, C*kh*kw, L], got shape {list(x.shape)}")
    k, s, d = _pair(op, "kernel_sizes", kernel_sizes), _pair(op, "strides", strides), _pair(op, "dilations", dilations)
    out = _pair(op, "output_sizes", output_sizes)
    n, ckk, blocks = x.shape
    bh, bw = _blocks(op, out, k, s, _pads(op, paddings), d)
    if ckk % (k[0] * k[1]) or blocks != bh * bw:
        raise ValueError(f"{op}: x of shape {list(x.shape)} does not hold {bh}x{bw} blocks of kernel {k} "
                         f"(dim 1 a multiple of {k[0] * k[1]}, dim 2 = {bh * bw})")
    shape = (n, ckk // (k[0] * k[1]), out[0], out[1])
    return labels_result(op, [x], [("n", None, None)], [("n", None, None, None)], [(shape, x.dtype)])


@register_spmd_rule("grid_sample")
def grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True, name=None):
    op = "grid_sample"
    check_spec(op, "x", x)
    check_spec(op, "grid", grid)
    nsp = x.ndim - 2
    if nsp not in (2, 3) or grid.ndim != x.ndim or grid.shape[-1] != nsp or grid.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: x [N, C, (D,) H, W] and grid [N, (D,) H, W, {max(nsp, 2)}] expected, got "
                         f"{list(x.shape)} and {list(grid.shape)}")
    shape = tuple(x.shape[:2]) + tuple(grid.shape[1:-1])
    whole = (None,) * nsp
    return labels_result(op, [x, grid], [("n", "c") + whole, ("n",) + whole + (None,)], [("n", "c") + whole],
                         [(shape, x.dtype)], linear=None)
