"""Steps paddle's python takes before its C op, taken on distributed tensors before the op's rule.

``F.embedding(x, w, max_norm=m)`` first rescales, in place, the rows of ``w`` that ``x`` looks up to a norm of at
most ``m`` (``F.embedding_renorm_``), then looks them up. On distributed tensors the renorm runs as paddle writes
it (each step routed: the norms are of whole rows, the write reaches the weight in whatever layout it has) and
the lookup's rule sees ``max_norm=None``; inside the rule a renorm of one rank's rows from one rank's ids would
leave the replicas apart, or rescale a gathered copy rather than the weight.

``x[index] = array`` with a numpy array: paddle casts the array to ``x``'s dtype and writes it as a tensor. Here it
becomes that (plain, replicated) tensor before the rule, which then lays it out like the region it fills; as a
constant the whole array reached every rank's shard (a region split over the mesh: paddle's shape error).
"""
from __future__ import annotations

import inspect

import numpy as np
import paddle
import paddle.nn.functional as F

from autoparallel.context import state as _ctx
from autoparallel.dist_tensor import is_dist
from spmd_rules.op_table import ARG_MAP


def _embedding_renorm_first(orig, args, kwargs):
    bound = inspect.signature(orig).bind(*args, **kwargs)
    arguments = bound.arguments
    max_norm = arguments.get("max_norm")
    weight = arguments.get("weight")
    if not max_norm or weight is None or _ctx.tracer is not None or _size(weight) == 0:
        return args, kwargs
    ids = arguments["x"]
    if not is_dist(weight) and is_dist(ids):      # a plain weight (replicated) renormed by every id on every rank
        ids = ids.full()
    F.embedding_renorm_(ids, weight, max_norm=max_norm, norm_type=arguments.get("norm_type", 2.0))
    arguments["max_norm"] = None
    return bound.args, bound.kwargs


def _size(t) -> int:
    n = 1
    for s in getattr(t, "global_shape", None) or t.shape:
        n *= s
    return n


def _array_value_as_tensor(orig, args, kwargs):
    if len(args) != 3 or kwargs or not isinstance(args[2], np.ndarray):
        return args, kwargs
    x, index, value = args
    return (x, index, paddle.cast(paddle.to_tensor(value), x.dtype)), kwargs


# op -> (paddle callable, args, kwargs) -> (args, kwargs)
PRE_STEPS = {"embedding": _embedding_renorm_first, "setitem": _array_value_as_tensor}


def pre_step(op, orig, args, kwargs):
    """The call's arguments after the op's pre-step (unchanged for an op without one)."""
    step = PRE_STEPS.get(op)
    return (args, kwargs) if step is None or orig is None else step(orig, args, kwargs)


# Python's operators on a distributed tensor (reflected ones included) take numpy operands as paddle's do
OPERATOR_PATHS = frozenset("paddle.Tensor.__" + n + "__" for n in (
    "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow matmul rmatmul "
    "eq ne lt le gt ge and or xor").split())


def numpy_operands(args):
    """``x + np_array`` (``np_array + x`` too: a DistTensor has ``__array_ufunc__ = None`` as paddle's Tensor, so
    numpy hands the operator back) and ``x * np.float32(2)``: a numpy array becomes the tensor paddle makes of it
    (its own dtype, promoted with x's as a tensor's is: float32 + float64 array is float64), a numpy scalar the
    python number it holds. paddle's C operator instead keeps x's dtype for any numpy scalar, truncating
    ``int_tensor + np.float32(0.5)`` to integers; here that is ``int_tensor + 0.5``, float32 as numpy has it."""
    if not any(isinstance(a, (np.ndarray, np.generic)) for a in args):
        return args
    return tuple(paddle.to_tensor(a) if isinstance(a, np.ndarray) else a.item() if isinstance(a, np.generic) else a
                 for a in args)


def map_args(path, args, kwargs):
    """The call of ``path`` in its rule's form (``op_table.ARG_MAP``)."""
    how = ARG_MAP.get(path)
    if how in ("swap", "swap_scalar_1d"):
        args = (args[1], args[0]) + args[2:]
        return (_scalar_1d(args, 1, 0) if how == "swap_scalar_1d" else args), kwargs
    if how == "scalar_1d":
        return _scalar_1d(args, 0, 1), kwargs
    if isinstance(how, dict) and "rename" in how:
        ren = how["rename"]
        kwargs = {ren.get(k, k): v for k, v in kwargs.items()}
    if isinstance(how, dict) and "fixed" in how:
        kwargs = {**kwargs, **how["fixed"]}
    return args, kwargs


def _scalar_1d(args, t, n):
    """A python number at ``n`` beside a 0-d distributed tensor at ``t`` as a [1] tensor (paddle: ``t // 2`` and
    ``2 // t`` are [1])."""
    v, x = args[n], args[t]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and is_dist(x) and not x.shape:
        return tuple(paddle.full([1], v, dtype=x.dtype) if i == n else a for i, a in enumerate(args))
    return args
