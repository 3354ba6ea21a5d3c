"""Ops a user module captured before dispatch was installed reach their routed (or guarded) wrapper.

A model module imported before the first ``shard_tensor`` / ``parallelize`` may hold paddle's raw op object in a
place that names it once, at import or at build:

* ``act = functools.partial(F.gelu, approximate=True)`` (a partial's ``func``, wherever the partial lives);
* ``def make(): fn = F.silu; return lambda x: fn(x)`` (a closure cell);
* ``def block(x, act=F.tanh)`` / ``def forward(self, x, k=F.sigmoid)`` (a default, positional or keyword-only);
* ``self.fn = F.silu`` on a plain (non-Layer) object, ``ACTS = [F.gelu, F.relu]`` / ``(F.gelu, F.relu)`` (a module-level list or tuple).

(Module attributes ``mm = paddle.matmul``, dict tables and Layer attributes are ``aliases``'s.) Called on a
DistTensor such a raw op failed with paddle's ``must be Tensor, but got DistTensor``; on a ``DistParameter`` (a
real paddle tensor holding its shard) it computed on the local shard: a wrong value. At install every such place
is repointed at the wrapper now standing under the op's paddle name (the routed op, its composite, or the guard
that raises naming the op); ``undo`` puts the originals back.
"""
from __future__ import annotations

import functools
import gc
import types

from autoparallel import patches

_SKIP_ROOTS = {"paddle", "autoparallel", "spmd_rules", "reshard", "builtins", "functools", "numpy"}
_EDITS: list = []           # (restore callable) of every place repointed, run newest first on undo


def wrappers() -> dict:
    """id(original) -> the wrapper now under its name, for every function patched on a module."""
    out = {}
    for owner, name, raw in patches.recorded():
        if not isinstance(owner, types.ModuleType) or not callable(raw):
            continue
        cur = getattr(owner, name, None)
        if cur is not raw and (getattr(cur, "_ap_wrapper", False) or getattr(cur, "_ap_guard", False)):
            out.setdefault(id(raw), cur)
    return out


def repoint_captured(mapping: dict | None = None) -> int:
    """Repoint every captured original (see the module doc); returns how many places changed."""
    mapping = wrappers() if mapping is None else mapping
    if not mapping:
        return 0
    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, functools.partial):
            n += _partial(obj, mapping)
        elif isinstance(obj, types.FunctionType):
            n += _function(obj, mapping) if _user(obj.__module__) else 0
        elif isinstance(obj, types.ModuleType):
            n += _module_lists(obj, mapping) if _user(obj.__name__) else 0
        elif getattr(type(obj), "__dictoffset__", 0) and not isinstance(obj, type) \
                and _user(getattr(type(obj), "__module__", None)):     # no attribute lookup on the object itself
            n += _instance(obj, mapping)
    return n


def _user(module) -> bool:
    return isinstance(module, str) and module.split(".", 1)[0] not in _SKIP_ROOTS


def _swap(value, mapping):
    w = mapping.get(id(value)) if callable(value) else None
    return value if w is None else w


def _partial(p, mapping) -> int:
    func = p.func
    w = _swap(func, mapping)
    if w is func:
        return 0
    state = p.__reduce__()[2]
    p.__setstate__((w,) + tuple(state[1:]))
    _EDITS.append(lambda: p.__setstate__((func,) + tuple(p.__reduce__()[2][1:])) if p.func is w else None)
    return 1


def _function(fn, mapping) -> int:
    n = 0
    defaults = fn.__defaults__
    if defaults and any(_swap(v, mapping) is not v for v in defaults):
        fn.__defaults__ = tuple(_swap(v, mapping) for v in defaults)
        _EDITS.append(lambda: setattr(fn, "__defaults__", defaults))
        n += 1
    kw = fn.__kwdefaults__
    if kw and any(_swap(v, mapping) is not v for v in kw.values()):
        fn.__kwdefaults__ = {k: _swap(v, mapping) for k, v in kw.items()}
        _EDITS.append(lambda: setattr(fn, "__kwdefaults__", kw))
        n += 1
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:          # an empty cell (a name assigned later in the enclosing function)
            continue
        w = _swap(v, mapping)
        if w is not v:
            cell.cell_contents = w
            _EDITS.append(lambda cell=cell, v=v, w=w: setattr(cell, "cell_contents", v)
                          if cell.cell_contents is w else None)
            n += 1
    return n


def _instance(obj, mapping) -> int:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (TypeError, AttributeError):
        return 0
    if not isinstance(d, dict):
        return 0
    n = 0
    for k, v in list(d.items()):
        w = _swap(v, mapping)
        if w is not v:
            d[k] = w
            _EDITS.append(lambda d=d, k=k, v=v, w=w: d.__setitem__(k, v) if d.get(k) is w else None)
            n += 1
    return n


def _module_lists(mod, mapping) -> int:
    """Entries of a module's lists (edited in place) and tuples (the module attribute replaced)."""
    n = 0
    for k, lst in list(vars(mod).items()):
        if type(lst) is tuple and not k.startswith("__") and any(_swap(v, mapping) is not v for v in lst):
            patches.patch(mod, k, tuple(_swap(v, mapping) for v in lst))
            n += 1
        if not isinstance(lst, list) or k.startswith("__"):
            continue
        for i, v in enumerate(lst):
            w = _swap(v, mapping)
            if w is not v:
                lst[i] = w
                _EDITS.append(lambda lst=lst, i=i, v=v, w=w: lst.__setitem__(i, v)
                              if i < len(lst) and lst[i] is w else None)
                n += 1
    return n


def _restore() -> None:
    while _EDITS:
        _EDITS.pop()()


patches.on_undo(_restore)
