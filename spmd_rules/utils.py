"""Shared small functions: axes, broadcasting, dtype promotion, argument checks."""
from __future__ import annotations

import math
import numbers

from autoparallel.core.placement import Partial, Replicate
from autoparallel.core.spec import DistSpec, normalize_dtype

R = Replicate()
LINEAR_REDUCE = ("sum", "avg")          # Partial types that commute with linear maps

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_ORDER = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")
REAL_OF = {"complex64": "float32", "complex128": "float64"}        # a complex dtype's real and imaginary parts
COMPLEX_OF = {"float32": "complex64", "float64": "complex128"}     # the complex dtype of a real one


def is_float(dtype) -> bool:
    return normalize_dtype(dtype) in _FLOATS


def is_linear_partial(p) -> bool:
    return isinstance(p, Partial) and p.reduce_type in LINEAR_REDUCE


def promote(*dtypes) -> str:
    """Result dtype of a binary op on tensors of these dtypes (the wider one wins)."""
    ds = [normalize_dtype(d) for d in dtypes]
    return max(ds, key=_ORDER.index)



def check_spec(op: str, name: str, v, *, optional: bool = False):
    if v is None and optional:
        return None
    if not isinstance(v, DistSpec):
        raise TypeError(f"{op}: argument {name!r} must be a DistSpec, got {type(v).__name__} {v!r}")
    return v


def same_mesh(op: str, specs) -> object:
    specs = [s for s in specs if s is not None]
    if not specs:
        raise TypeError(f"{op}: needs at least one DistSpec argument")
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise ValueError(f"{op}: all inputs must be on one mesh, got {mesh!r} and {s.mesh!r}; "
                             f"reshard them onto one mesh first")
    return mesh


def norm_axis(op: str, axis, ndim: int, *, allow_end: bool = False) -> int:
    """Normalise one axis into [0, ndim) (or [0, ndim] with ``allow_end``)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__} {axis!r}")
    axis = int(axis)
    hi = ndim + 1 if allow_end else ndim
    if not -hi <= axis < hi:
        raise ValueError(f"{op}: axis {axis} is out of range for a tensor of rank {ndim} "
                         f"(expected {-hi} <= axis < {hi})")
    return axis % hi if hi else 0


def norm_axes(op: str, axis, ndim: int) -> tuple:
    """``None`` (or []) -> every axis; an int or a sequence -> sorted unique normalised axes."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        if len(axis) == 0:
            return tuple(range(ndim))
        axes = [norm_axis(op, a, ndim) for a in axis]
        if len(set(axes)) != len(axes):
            raise ValueError(f"{op}: repeated axis in {list(axis)}")
        return tuple(sorted(axes))
    return (norm_axis(op, axis, ndim),) if ndim else ()


def broadcast_shapes(op: str, *shapes) -> tuple:
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        sizes = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0}
        big = {x for x in sizes if x != 1}
        if len(big) > 1:
            raise ValueError(f"{op}: shapes {[list(s) for s in shapes]} cannot be broadcast together "
                             f"(dim {i - nd} has sizes {sorted(sizes)})")
        out.append(big.pop() if big else 1)
    return tuple(out)


def int_list(op: str, name: str, value) -> list:
    if isinstance(value, DistSpec):
        raise NotImplementedError(f"{op}: {name} given as a tensor is not supported; pass python ints")
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    try:
        out = [int(v) for v in value]
    except (TypeError, ValueError):
        raise TypeError(f"{op}: {name} must be an int or a sequence of ints, got {value!r}") from None
    return out



def int_arg(op: str, name: str, value) -> int:
    """A python int argument (``int_list``'s one-value form): a tensor is not supported, anything else a TypeError."""
    if isinstance(value, DistSpec):
        raise NotImplementedError(f"{op}: {name} given as a tensor is not supported; pass a python int")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    return value


def keep_but(x, axes) -> tuple:
    """x's dims as their own labels (``labels_result``), ``None`` (whole) for ``axes``."""
    return tuple(None if d in axes else d for d in range(x.ndim))


def numel(spec) -> int:
    return math.prod(spec.shape) if spec is not None else 0
