"""Plain tensors shadowed by a distributed value.

A plain tensor (replicated by convention) updated in place with distributed operands — e.g. a zeros buffer a
model ``index_add_``s expert outputs into — cannot hold the distributed result, so the tensor object is
shadowed by it: every later routed op reading the tensor uses the distributed value instead, and ``numpy()``,
``item()``, ``tolist()`` on it give that value. The shadow is side data (``compat.SideData``), dropped with
the tensor.
"""
from __future__ import annotations

from autoparallel.compat import SideData

SHADOWS = [False]        # set once some plain tensor was shadowed (before that, no op looks for shadows)
_SHADOW = SideData()


def shadow(tensor, value) -> bool:
    """Shadow ``tensor`` by ``value``; True when this is the first shadow (readers not yet installed)."""
    _SHADOW.set(tensor, value)
    first = not SHADOWS[0]
    SHADOWS[0] = True
    return first


def shadow_of(v):
    import paddle

    return _SHADOW.get(v) if v.__class__ is paddle.Tensor else None


def has_shadow(args, kwargs) -> bool:
    for v in list(args) + list(kwargs.values()):
        if shadow_of(v) is not None or (type(v) in (list, tuple) and any(shadow_of(u) is not None for u in v)):
            return True
    return False


def unshadow(args, kwargs):
    def sub(v):
        if type(v) in (list, tuple):
            return type(v)(sub(u) for u in v)
        sh = shadow_of(v)
        return v if sh is None else sh

    return tuple(sub(a) for a in args), {k: sub(v) for k, v in kwargs.items()}
