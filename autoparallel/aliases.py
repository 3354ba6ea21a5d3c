"""Every name paddle exports for a routed op reaches its rule.

* **Aliases**: the same function object under another name in any paddle module, the top-level ``paddle``
  included (``paddle.cat`` is ``paddle.concat``), or as a ``paddle.Tensor`` method, is replaced by the
  routed wrapper wherever it is found.
* **In-place forms** ``op_`` (``paddle.reshape_``, ``x.add_(y)``, ``x.scale_()``...) of a routed ``op`` run
  the out-of-place rule and local op, then rebind: a DistTensor takes the result's shards and spec (the
  Python object the caller holds is updated, as paddle's in-place op updates the tensor); a DistParameter
  stays the same Parameter, its shards overwritten in place, and keeps its layout (an in-place op that
  would change a parameter's layout is refused).
* **Cast spellings**: ``float()``, ``half()``, ``bfloat16()``, ``double()``, ``int()``, ``long()``,
  ``bool()`` (whatever conversion methods paddle defines: the dtype each produces is read by running
  paddle's own method on a 0-d tensor), ``type_as(y)``, ``to(...)`` (paddle's own parser decides the dtype
  and device), next to ``astype``/``cast`` which are rules already.
"""
from __future__ import annotations

import sys
import types

import paddle

from autoparallel import patches
from autoparallel.compat import C_OP_NAMESPACES as _OP_NAMESPACES
from autoparallel.compat import forwarded_c_op
from autoparallel.dist_tensor_ops import CONVERSIONS as _CONVERSIONS
from autoparallel.dist_tensor_ops import conversion_dtype, original  # noqa: F401  (re-exported)

_OWN = {"autoparallel", "spmd_rules", "reshard"}
_ROUTED: dict = {}          # id(original) -> routed wrapper, while dispatch is installed
_TABLE_EDITS: list = []     # (dict, key, original) of the user tables repointed, restored on undo


def patch_aliases(routed: dict) -> dict:
    """Replace every other name of a routed function (``routed``: id(original) -> wrapper) by its wrapper
    in every loaded module (``paddle`` and its submodules, and modules that imported a function by name
    before dispatch was installed, e.g. ``from paddle.nn.functional import swiglu as fused_swiglu`` in a
    model library) and on ``paddle.Tensor``; returns {Tensor method name: wrapper}. Modules imported later
    get the wrappers from paddle itself."""
    routed = dict(routed)
    routed.update(_c_op_aliases(routed))
    _ROUTED.clear()
    _ROUTED.update(routed)
    repoint_modules(routed)
    _repoint_tables(routed)
    _repoint_layers(routed)
    methods = {}
    for attr in dir(paddle.Tensor):
        if attr.startswith("__"):
            continue
        val = getattr(paddle.Tensor, attr, None)
        w = routed.get(id(val))
        if w is not None:
            try:
                patches.patch(paddle.Tensor, attr, w)
            except (AttributeError, TypeError):
                continue
        if getattr(getattr(paddle.Tensor, attr, None), "_ap_routed", None):
            methods[attr] = getattr(paddle.Tensor, attr)
    return methods


def repoint_modules(mapping: dict) -> None:
    """Every module attribute that is one of ``mapping``'s originals (id -> replacement) is replaced."""
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".", 1)[0] in _OWN or name in _OP_NAMESPACES \
                or name.startswith("paddle.base.libpaddle"):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, val in items:
            w = mapping.get(id(val))
            if w is not None and not attr.startswith("__"):
                try:
                    patches.patch(mod, attr, w)
                except (AttributeError, TypeError):
                    pass


def _repoint_layers(routed: dict) -> None:
    """Layers built before dispatch was installed may hold an op as an attribute (``self.activation =
    getattr(F, "relu")`` in paddle's TransformerEncoderLayer): those attributes are repointed too (one walk
    over the live objects, once)."""
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, paddle.nn.Layer):
            d = obj.__dict__
            for k, v in list(d.items()):
                w = routed.get(id(v))
                if w is not None:
                    patches.patch(obj, k, w)


def _repoint_tables(routed: dict) -> None:
    """A module-level table of ops in user code, written before dispatch was installed (``ACTS = {"gelu":
    F.gelu, "tanh": paddle.tanh}``, looked up in ``forward``), holds the originals: its entries are repointed
    too (dicts of modules outside paddle; restored on undo)."""
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".", 1)[0] in _OWN | {"paddle"}:
            continue
        try:
            tables = [v for k, v in vars(mod).items() if isinstance(v, dict) and not k.startswith("__")]
        except TypeError:
            continue
        for table in tables:
            for key, val in list(table.items()):
                w = routed.get(id(val)) if callable(val) else None
                if w is not None:
                    _TABLE_EDITS.append((table, key, val))
                    table[key] = w


def _restore_tables() -> None:
    while _TABLE_EDITS:
        table, key, val = _TABLE_EDITS.pop()
        if table.get(key) is not val:
            table[key] = val
    _ROUTED.clear()


patches.on_undo(_restore_tables)


def repoint_layer_ops(layer) -> None:
    """The sublayers of ``layer`` built after dispatch was installed may hold an op captured before it (a
    default argument ``act=F.gelu``, an entry of a table built at import): repointed when the model is
    distributed (``shard_layer``, ``parallelize``), as ``_repoint_layers`` does at install."""
    routed = _unwrapped({**_live_wrappers(), **_ROUTED})
    for sub in layer.sublayers(include_self=True) if routed else ():
        for k, v in list(sub.__dict__.items()):
            w = routed.get(id(v)) if callable(v) else None
            if w is not None and w is not v:
                patches.patch(sub, k, w)


def _unwrapped(routed: dict) -> dict:
    """``routed`` with every level below each wrapper (``__wrapped__``) mapped to it too: a function captured
    while an earlier install was active holds that install's wrapper (or paddle's original under it), and both
    stand for the live wrapper."""
    out = dict(routed)
    for w in routed.values():
        inner = w
        while isinstance(inner, types.FunctionType) and inner.__dict__.get("_ap_wrapper") is True:
            inner = inner.__dict__.get("__wrapped__")
            if inner is None:
                break
            out.setdefault(id(inner), w)
    return out


def _live_wrappers() -> dict:
    """id(original) -> routed wrapper, read off paddle's namespaces (``_ROUTED`` is emptied by an undo the
    install that followed did not refill)."""
    import paddle.nn.functional as F

    out = {}
    for owner in (paddle, F, paddle.linalg):
        for attr in dir(owner):
            w = getattr(owner, attr, None)
            if getattr(w, "_ap_routed", None) and getattr(w, "__wrapped__", None) is not None:
                out[id(w.__wrapped__)] = w
    return out


def _c_op_aliases(routed: dict) -> dict:
    """A routed function paddle generates as ``def _matmul(*args, **kwargs): return _C_ops.matmul(...)``
    and the C op ``paddle._C_ops.matmul`` it forwards to are one op with one argument parser; some modules
    export the C op itself (``paddle.tensor.matmul``, ``paddle.linalg.matmul``): those names route too."""
    out = {}
    for w in set(routed.values()):
        target = forwarded_c_op(getattr(w, "__wrapped__", None))
        if target is not None and id(target) not in routed:
            out[id(target)] = w
    return out


def patch_inplace(make_inplace) -> dict:
    """``op_`` next to a routed ``op`` (in ``paddle``, ``paddle.nn.functional`` and on ``paddle.Tensor``)
    becomes ``make_inplace(op, path, original)``; returns {Tensor method name: wrapper}."""
    methods = {}
    import paddle.nn.functional as F

    for owner, prefix in ((paddle, "paddle"), (F, "paddle.nn.functional"), (paddle.Tensor, "paddle.Tensor")):
        for attr in dir(owner):
            if not attr.endswith("_") or attr.startswith("_"):
                continue
            base = getattr(owner, attr[:-1], None)
            op = getattr(base, "_ap_routed", None)
            cur = getattr(owner, attr, None)
            if op is None or cur is None or getattr(cur, "_ap_routed", None) or getattr(cur, "_ap_guard", None):
                continue
            w = make_inplace(op, base._ap_path, cur)
            try:
                patches.patch(owner, attr, w)
            except (AttributeError, TypeError):
                continue
            if owner is paddle.Tensor:
                methods[attr] = w
    return methods


def to_dtype(self_dtype, args, kwargs):
    """The dtype ``Tensor.to(*args, **kwargs)`` gives a tensor of ``self_dtype`` (a distributed ``other``
    stands in as a 0-d tensor of its dtype); see dist_tensor_ops.to_dtype."""
    from autoparallel.dist_tensor import DistTensor
    from autoparallel.dist_tensor_ops import to_dtype as _to_dtype

    return _to_dtype(self_dtype, args, kwargs, DistTensor)
