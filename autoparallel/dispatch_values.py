"""Tensors standing for python numbers: paddle accepts a 0-d (or small 1-d) tensor where a creation op or a
shape argument wants a number (``paddle.arange(h)``, ``x.expand([-1, w])``, ``x.reshape([h // 2, 2])``, with
``h``, ``w`` read from a tensor such as a vision model's ``grid_thw``). A distributed tensor there is read as
its global value (``item()`` / ``tolist()``: gathered or reduced when sharded or Partial) before the op is
routed; when no distributed tensor remains the op runs as plain paddle, as it would on those numbers."""
from __future__ import annotations

import math

import paddle

from autoparallel.dist_tensor import as_dist, is_dist as _is_dist

# op -> how many leading positional arguments are tensors (the rest, and every keyword but these, are values)
VALUE_OPS = {"arange": 0, "full": 0, "zeros": 0, "ones": 0, "expand": 1, "reshape": 1, "view": 1, "tile": 1,
             "broadcast_to": 1, "pad": 1,
             "linspace": 0, "split": 1, "full_like": 1,
             "empty": 0, "rand": 0, "randn": 0, "standard_normal": 0, "randint": 0, "uniform": 0, "eye": 0,
             "topk": 1, "quantile": 1, "nanquantile": 1,
             "roll": 1,                           # shifts given as tensors (paddle reads their values)
             # an axis given as a tensor (``x.sum(axis=paddle.to_tensor(1))``, paddle reads its value)
             **dict.fromkeys(("sum", "mean", "max", "min", "amax", "amin", "prod", "logsumexp", "all", "any", "std",
                              "var", "nansum", "nanmean", "argmax", "argmin", "cumsum", "cumprod", "flip", "squeeze",
                              "unsqueeze", "count_nonzero"), 1),
             # slices with tensor bounds in an index (``x[s:e]``, ``x[:, s:e] = v``): only the bounds are values
             "getitem": 1, "setitem": 1}
_NUMBERS = ("arange", "linspace", "eye", "randint", "topk")      # one-element tensors there are numbers
_FILL = {"full": 1, "full_like": 1}       # the position of fill_value (also a number when one element)
_TENSOR_KW = ("x", "input", "self")


def _is_tensor(v) -> bool:
    """A distributed tensor, or a plain one (next to distributed arguments it would be taken as a replicated
    operand, where paddle reads it as a number)."""
    return _is_dist(v) or isinstance(v, paddle.Tensor)


def _holds_dist(v) -> bool:
    return _is_tensor(v) or (type(v) in (list, tuple) and any(_is_tensor(u) for u in v))


def _value(v, element=False):
    """A tensor's value: a number when 0-d (or one element inside a list, like paddle's shape lists), else
    a list."""
    if _is_tensor(v):
        t = as_dist(v) if _is_dist(v) else v
        shape = list(t.shape)
        return t.item() if not shape or (element and math.prod(shape) == 1) else t.tolist()
    if type(v) in (list, tuple) and any(_is_tensor(u) for u in v):
        return type(v)(_value(u, True) for u in v)
    return v


def resolve(op: str, args: tuple, kwargs: dict):
    """``(args, kwargs)`` with distributed tensors in value positions of ``op`` replaced by their values."""
    lead = VALUE_OPS.get(op)
    if lead is None:
        return args, kwargs
    if op in ("getitem", "setitem"):
        return _slice_bounds(args, kwargs)
    if not any(map(_holds_dist, args[lead:])) and \
            not any(_holds_dist(v) for k, v in kwargs.items() if k not in _TENSOR_KW):
        return args, kwargs              # the common case: numbers already
    one = op in _NUMBERS
    fill = _FILL.get(op)
    args = tuple(v if i < lead else _value(v, one or i == fill) for i, v in enumerate(args))
    kwargs = {k: (v if k in _TENSOR_KW else _value(v, one or k == "fill_value")) for k, v in kwargs.items()}
    return args, kwargs


def _bounds(it):
    """A slice whose start / stop / step are tensors (paddle reads their values: ``x[s:e]`` with 0-d or
    one-element tensors) as the same slice of python ints; any other index item as it is."""
    if type(it) is slice and any(_is_tensor(b) for b in (it.start, it.stop, it.step)):
        return slice(*(_value(b, True) for b in (it.start, it.stop, it.step)))
    return it


def _slice_bounds(args, kwargs):
    """getitem / setitem: tensor bounds of the index's slices read as ints; the index's tensors (advanced
    indices, masks) and the value stay operands."""
    index = args[1] if len(args) > 1 else kwargs.get("index", kwargs.get("item"))
    items = index if type(index) is tuple else (index,)
    if not any(type(it) is slice for it in items):
        return args, kwargs
    new = tuple(map(_bounds, items)) if type(index) is tuple else _bounds(index)
    if len(args) > 1:
        return (args[0], new) + tuple(args[2:]), kwargs
    return args, {**kwargs, ("index" if "index" in kwargs else "item"): new}


def nested_values(data):
    """A (nested) list or tuple with distributed tensors in it, those read as numbers or lists."""
    if type(data) in (list, tuple):
        return type(data)(nested_values(v) for v in data)
    return _value(data, True) if _is_dist(data) else data
