"""``paddle.fft``: the 1-D (``fft ifft rfft irfft hfft ihfft``), 2-D (``fft2`` ...) and n-D (``fftn`` ...)
transforms. The transformed axes are whole; every other dim keeps its sharding. A transform is linear, so a
Partial(sum) input stays Partial (the transform of a sum is the sum of the transforms).

Output sizes along the transformed axes, as paddle gives them (``n`` / ``s`` default to the input's sizes):
``fft``/``ifft`` n; ``rfft``/``ihfft`` n // 2 + 1 on the last transformed axis; ``irfft``/``hfft`` n, by default
2 (m - 1) on the last transformed axis. Complex output for ``fft ifft rfft ihfft`` (complex64 of float32),
real for ``irfft hfft``.
"""
from __future__ import annotations

from spmd_rules.einsum import ALL, labels_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import COMPLEX_OF, REAL_OF, check_spec, norm_axis

_NORMS = ("backward", "ortho", "forward")
KINDS = {"fft": "c2c", "ifft": "c2c", "rfft": "r2c", "ihfft": "r2c", "irfft": "c2r", "hfft": "c2r"}


def _sizes(op, kind, x, axes, s):
    """{axis: output size} of the transformed axes."""
    if s is not None and len(s) != len(axes):
        raise ValueError(f"{op}: s and axes must have the same length, got s={list(s)} and axes={list(axes)}")
    out = {}
    for i, a in enumerate(axes):
        n = None if s is None else s[i]
        if n is not None and (not isinstance(n, int) or n <= 0):
            raise ValueError(f"{op}: every transform size must be a positive int, got {n!r}")
        last = i == len(axes) - 1
        if kind == "r2c" and last:
            out[a] = (n or x.shape[a]) // 2 + 1
        elif kind == "c2r" and last:
            out[a] = n or 2 * (x.shape[a] - 1)
        else:
            out[a] = n or x.shape[a]
    return out


def _transform(op, x, axes, s, norm):
    check_spec(op, "x", x)
    if norm not in _NORMS:
        raise ValueError(f"{op}: norm must be one of {list(_NORMS)}, got {norm!r}")
    kind = KINDS[op.rstrip("2n")]              # fft2 / fftn -> fft
    axes = [norm_axis(op, a, x.ndim) for a in axes]
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: axes must be distinct, got {axes}")
    dtype = str(x.dtype)
    if dtype not in COMPLEX_OF and dtype not in REAL_OF:
        raise TypeError(f"{op}: expects a float or complex tensor, got {x.dtype}")
    if kind == "r2c" and dtype in REAL_OF:
        raise TypeError(f"{op}: expects a real tensor, got {x.dtype}")
    sizes = _sizes(op, kind, x, axes, s)
    lab = tuple(None if d in sizes else d for d in range(x.ndim))
    shape = tuple(sizes.get(d, x.shape[d]) for d in range(x.ndim))
    out = REAL_OF.get(dtype, dtype) if kind == "c2r" else COMPLEX_OF.get(dtype, dtype)
    return labels_result(op, [x], [lab], [lab], [(shape, out)], linear=ALL)


def _one_d(op):
    def rule(x, n=None, axis=-1, norm="backward", name=None):
        return _transform(op, x, [axis], None if n is None else [n], norm)

    rule.__name__ = op
    register_spmd_rule(op, rule)


def _two_d(op):
    def rule(x, s=None, axes=(-2, -1), norm="backward", name=None):
        return _transform(op, x, list(axes), None if s is None else list(s), norm)

    rule.__name__ = op
    register_spmd_rule(op, rule)


def _n_d(op):
    def rule(x, s=None, axes=None, norm="backward", name=None):
        check_spec(op, "x", x)
        if axes is None:
            axes = list(range(x.ndim)) if s is None else list(range(x.ndim - len(s), x.ndim))
        return _transform(op, x, list(axes), None if s is None else list(s), norm)

    rule.__name__ = op
    register_spmd_rule(op, rule)


for _op in KINDS:
    _one_d(_op)
    _two_d(_op + "2")
    _n_d(_op + "n")
