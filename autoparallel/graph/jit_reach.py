"""What a function decorated with ``paddle.jit.to_static`` reaches: distributed tensors among its arguments,
its bound instance, the globals it reads and its closure (then autoparallel lowers or runs it)."""
from __future__ import annotations

import types

from autoparallel import compat, layer_state


def _dist(x) -> bool:
    from autoparallel.dist_tensor import is_dist

    return is_dist(x)


def _layer_is_dist(layer) -> bool:
    if layer_state.mesh_of(layer) is not None:
        return True
    return any(_dist(p) for p in layer.parameters())


def _value_is_dist(v, depth: int = 0) -> bool:
    from paddle import nn

    if _dist(v):
        return True
    if isinstance(v, nn.Layer):
        return _layer_is_dist(v)
    if depth < 2 and isinstance(v, (list, tuple)):
        return any(_value_is_dist(u, depth + 1) for u in v)
    if depth < 2 and isinstance(v, dict):
        return any(_value_is_dist(u, depth + 1) for u in v.values())
    inner = getattr(v, "_layers", None) or getattr(v, "_model", None)     # DataParallel-style wrappers
    if depth < 2 and inner is not None and inner is not v:
        return _value_is_dist(inner, depth + 1)
    return False


def _code_names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _referenced(fn) -> list:
    """Values the function's code names: globals it reads and its closure cells."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    g = getattr(fn, "__globals__", {})
    out = [g[n] for n in _code_names(code) if n in g and not isinstance(g[n], types.ModuleType)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:                                # an empty cell
            pass
    return out


def touches_dist(sf, args, kwargs) -> bool:
    """Whether the decorated function reaches distributed tensors (module docstring)."""
    if any(_value_is_dist(a) for a in args) or any(_value_is_dist(v) for v in kwargs.values()):
        return True
    inst = getattr(sf, "_class_instance", None)
    inst = inst() if callable(inst) else inst
    if inst is not None and _value_is_dist(inst):
        return True
    return any(_value_is_dist(v) for v in _referenced(compat.dygraph_function(sf)))
