"""Complex numbers: ``as_complex`` / ``view_as_complex`` (a last dim of 2 becomes one complex element),
``as_real`` / ``view_as_real`` (the reverse), ``real``, ``imag``, ``conj``, ``angle``, ``complex(real, imag)``
and ``polar(abs, angle)``. A rotary embedding written with complex numbers (``x`` paired into complex, times a
complex ``freqs_cis``, back to real) runs on a tensor sharded along any dim but the pair dim.

All keep the sharding of every dim they keep. ``as_complex`` needs the pair dim whole; ``as_real`` adds a whole
pair dim. Partial: ``as_complex``, ``as_real``, ``real``, ``imag``, ``conj`` are linear (keep P(sum));
``complex(re, im)`` is linear in both operands together (each the same linear Partial); ``angle`` and ``polar``
are not.
"""
from __future__ import annotations

from spmd_rules.einsum import ALL, labels_result
from spmd_rules.elementwise import _unary, _unary_reverse, elementwise_result
from spmd_rules.registry import register_spmd_rule
from spmd_rules.utils import COMPLEX_OF, REAL_OF, check_spec, keep_but, promote


def _complex_dtype(op, dtype) -> str:
    if str(dtype) not in COMPLEX_OF:
        raise TypeError(f"{op}: expects a float32 or float64 tensor, got {dtype}")
    return COMPLEX_OF[str(dtype)]


def as_complex(x, name=None):
    op = "as_complex"
    check_spec(op, "x", x)
    if x.ndim < 1 or x.shape[-1] != 2:
        raise ValueError(f"{op}: the last dim of x must have size 2 (real, imaginary), got shape {list(x.shape)}")
    lab = keep_but(x, {x.ndim - 1})
    return labels_result(op, [x], [lab], [lab[:-1]], [(tuple(x.shape[:-1]), _complex_dtype(op, x.dtype))], linear=ALL)


def as_real(x, name=None):
    op = "as_real"
    check_spec(op, "x", x)
    if str(x.dtype) not in REAL_OF:
        raise TypeError(f"{op}: expects a complex64 or complex128 tensor, got {x.dtype}")
    lab = tuple(range(x.ndim))
    return labels_result(op, [x], [lab], [lab + (None,)], [(tuple(x.shape) + (2,), REAL_OF[str(x.dtype)])],
                         linear=ALL)


def _to_real(op, linear):
    def rule(x, name=None):
        check_spec(op, "x", x)
        return _unary(op, x, linear=linear, dtype=REAL_OF.get(str(x.dtype), str(x.dtype)))

    rule.__name__ = op
    register_spmd_rule(op, rule, reverse=_unary_reverse(op, linear))


def _pair(op, x, y, linear, out):
    if out is not None:
        raise NotImplementedError(f"{op}(out=...) is not supported on distributed tensors; use the result")
    check_spec(op, "x", x)
    check_spec(op, "y", y)
    return elementwise_result(op, [x, y], linear="additive" if linear else None,
                              out_dtype=_complex_dtype(op, promote(x.dtype, y.dtype)))


@register_spmd_rule("complex")
def complex_(real, imag, name=None, *, out=None):
    return _pair("complex", real, imag, True, out)


@register_spmd_rule("polar")
def polar(abs, angle, name=None, *, out=None):
    return _pair("polar", abs, angle, False, out)


@register_spmd_rule("conj", reverse=_unary_reverse("conj", True))
def conj(x, name=None):
    return _unary("conj", x, linear=True)


@register_spmd_rule("view_as_complex")
def view_as_complex(input):
    return as_complex(input)


@register_spmd_rule("view_as_real")
def view_as_real(input):
    return as_real(input)


register_spmd_rule("as_complex", as_complex)
register_spmd_rule("as_real", as_real)
_to_real("real", True)
_to_real("imag", True)
_to_real("angle", False)
