"""Pooling: max / avg pooling (1-d, 2-d, 3-d) and adaptive avg / max pooling.

Batch and channel dims pass through (any sharding kept); the pooled spatial dims are needed whole (a
sharded spatial dim is replicated first: windows would straddle shards). Average pooling is linear, so a
Partial(sum) input stays Partial; max pooling is not (a Partial input is reduced first). ``return_mask``
adds an int32 output laid out like the pooled values.
"""
from __future__ import annotations

from spmd_rules.einsum import ALL, labels_result
from spmd_rules.conv import _padding
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import check_spec

_FORMATS = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}


def _spatial(op, x, n, data_format):
    """Positions of the spatial dims, after checking rank and data_format."""
    if data_format not in _FORMATS[n]:
        raise ValueError(f"{op}: data_format must be one of {_FORMATS[n]}, got {data_format!r}")
    if x.ndim != n + 2:
        raise ValueError(f"{op}: x must be {n + 2}-D ({data_format}), got shape {list(x.shape)}")
    first = 1 if data_format.endswith("C") else 2
    return list(range(first, first + n))


def _ints(op, name, v, n):
    if isinstance(v, int):
        return [v] * n
    v = [int(a) for a in v]
    if len(v) == 1:
        return v * n
    if len(v) != n:
        raise ValueError(f"{op}: {name} must be an int or {n} ints, got {v!r}")
    return v


def _pads(op, padding, n, sizes, ksize, stride, channel_last):
    """[(before, after)] per spatial dim, for every padding form paddle accepts (a conv's, without dilation)."""
    return _padding(op, padding, ksize, stride, [1] * n, sizes, channel_last)


def _trunc_div(a: int, b: int) -> int:
    return a // b if a >= 0 else -((-a) // b)


def _pooled_shape(op, x, n, kernel_size, stride, padding, ceil_mode, data_format):
    dims = _spatial(op, x, n, data_format)
    sizes = [x.shape[d] for d in dims]
    k = _ints(op, "kernel_size", kernel_size, n)
    s = k if stride is None else _ints(op, "stride", stride, n)
    pads = _pads(op, padding, n, sizes, k, s, data_format.endswith("C"))
    out = []
    for i in range(n):
        span = sizes[i] + pads[i][0] + pads[i][1] - k[i]
        # paddle's kernels size the output with C's integer division (truncation toward zero): a window larger
        # than the padded input by less than a stride still gives one output (the window clipped to the input),
        # squeezenet's 3x3 / 2 max pool on a 2x2 map, for one
        o = _trunc_div(span + s[i] - 1 if ceil_mode else span, s[i]) + 1
        if o < 0:
            raise ValueError(f"{op}: kernel {k} with stride {s} and padding {pads} is larger than the input's "
                             f"spatial size {sizes} by more than a stride (paddle refuses it too)")
        out.append(o)
    return dims, out


def _result(op, x, dims, out_sizes, *, linear, mask=False):
    lab = tuple(None if d in dims else d for d in range(x.ndim))
    shape = list(x.shape)
    for d, o in zip(dims, out_sizes):
        shape[d] = o
    metas = [(tuple(shape), x.dtype)] + ([(tuple(shape), "int32")] if mask else [])
    return labels_result(op, [x], [lab], [lab] * len(metas), metas, linear=ALL if linear else None)


def _max_pool(n, fmt):
    op = f"max_pool{n}d"

    def rule(x, kernel_size, stride=None, padding=0, return_mask=False, ceil_mode=False, data_format=fmt,
             name=None):
        check_spec(op, "x", x)
        if return_mask and data_format.endswith("C"):
            raise ValueError(f"{op}: return_mask needs the channel-first layout, got data_format={data_format!r}")
        dims, out = _pooled_shape(op, x, n, kernel_size, stride, padding, ceil_mode, data_format)
        return _result(op, x, dims, out, linear=False, mask=return_mask)

    rule.__name__ = op
    register_spmd_rule(op, rule)


def _avg_pool(n, fmt):
    op = f"avg_pool{n}d"

    def rule(x, kernel_size, stride=None, padding=0, ceil_mode=False, exclusive=True, divisor_override=None,
             data_format=fmt, name=None):
        check_spec(op, "x", x)
        dims, out = _pooled_shape(op, x, n, kernel_size, stride, padding, ceil_mode, data_format)
        return _result(op, x, dims, out, linear=True)

    rule.__name__ = op
    register_spmd_rule(op, rule)


@register_spmd_rule("max_pool1d")
def max_pool1d(x, kernel_size, stride=None, padding=0, return_mask=False, ceil_mode=False, name=None):
    check_spec("max_pool1d", "x", x)
    dims, out = _pooled_shape("max_pool1d", x, 1, kernel_size, stride, padding, ceil_mode, "NCL")
    return _result("max_pool1d", x, dims, out, linear=False, mask=return_mask)


@register_spmd_rule("avg_pool1d")
def avg_pool1d(x, kernel_size, stride=None, padding=0, exclusive=True, ceil_mode=False, name=None):
    check_spec("avg_pool1d", "x", x)
    dims, out = _pooled_shape("avg_pool1d", x, 1, kernel_size, stride, padding, ceil_mode, "NCL")
    return _result("avg_pool1d", x, dims, out, linear=True)


_max_pool(2, "NCHW")
_max_pool(3, "NCDHW")
_avg_pool(2, "NCHW")
_avg_pool(3, "NCDHW")


def _adaptive_sizes(op, x, dims, output_size):
    n = len(dims)
    sizes = [output_size] * n if isinstance(output_size, int) or output_size is None else list(output_size)
    if len(sizes) == 1 and n > 1:
        sizes = sizes * n
    if len(sizes) != n:
        raise ValueError(f"{op}: output_size must be an int or {n} ints, got {output_size!r}")
    return [x.shape[d] if s is None else int(s) for d, s in zip(dims, sizes)]


def _adaptive(op, n, kind):
    fmt = _FORMATS[n][0]
    if kind == "avg":
        def rule(x, output_size, data_format=fmt, name=None):
            check_spec(op, "x", x)
            dims = _spatial(op, x, n, data_format)
            return _result(op, x, dims, _adaptive_sizes(op, x, dims, output_size), linear=True)
    else:
        def rule(x, output_size, return_mask=False, name=None):
            check_spec(op, "x", x)
            dims = _spatial(op, x, n, fmt)
            return _result(op, x, dims, _adaptive_sizes(op, x, dims, output_size), linear=False, mask=return_mask)
    rule.__name__ = op
    register_spmd_rule(op, rule)


@register_spmd_rule("adaptive_avg_pool1d")
def adaptive_avg_pool1d(x, output_size, name=None):
    check_spec("adaptive_avg_pool1d", "x", x)
    dims = _spatial("adaptive_avg_pool1d", x, 1, "NCL")
    return _result("adaptive_avg_pool1d", x, dims, _adaptive_sizes("adaptive_avg_pool1d", x, dims, output_size),
                   linear=True)


_adaptive("adaptive_avg_pool2d", 2, "avg")
_adaptive("adaptive_avg_pool3d", 3, "avg")
for _n in (1, 2, 3):
    _adaptive(f"adaptive_max_pool{_n}d", _n, "max")


def _lp_pool(n, fmt):
    op = f"lp_pool{n}d"

    def rule(x, norm_type, kernel_size, stride=None, padding=0, ceil_mode=False, data_format=fmt, name=None):
        check_spec(op, "x", x)
        dims, out = _pooled_shape(op, x, n, kernel_size, stride, padding, ceil_mode, data_format)
        return _result(op, x, dims, out, linear=False)

    rule.__name__ = op
    register_spmd_rule(op, rule)


_lp_pool(1, "NCL")
_lp_pool(2, "NCHW")
