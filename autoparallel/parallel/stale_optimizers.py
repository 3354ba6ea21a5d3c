"""Optimizers built before ``ap.shard_layer``: point them at the distributed parameters.

``shard_layer`` replaces each parameter of the layer with its distributed version. An optimizer built
before holds the originals, which get no gradient any more: its ``step()`` would skip them and the model
would silently not train. After replacing, ``shard_layer`` finds every live paddle optimizer holding a
replaced parameter and points it at the new one (as ``ap.parallelize`` does for the optimizer it is given).
An optimizer that already keeps state for a replaced parameter (it has stepped) cannot be moved to the new
layout: that is a typed error naming the parameter.
"""
from __future__ import annotations

import gc
import weakref

from autoparallel.parallel.param_list import flat_params, rebind_params as _rebind


class StaleOptimizerError(ValueError):
    """An optimizer that has already stepped holds parameters that distribution replaced."""


def replaced_params(before: list) -> dict:
    """{id(original): distributed} for every slot whose parameter ``shard_layer`` replaced."""
    out = {}
    for s in before:
        cur = s.current()
        if cur is not None and cur is not s.param:
            out[id(s.param)] = cur
    return out


_LIVE = weakref.WeakSet()          # every paddle optimizer made since the first lookup (and those before it)


def _register_new(cls, *args, **kwargs):
    """``Optimizer.__new__``: record the new optimizer (any subclass, whatever its ``__init__`` does)."""
    obj = object.__new__(cls)
    _LIVE.add(obj)
    return obj


def live_optimizers():
    """Every live paddle optimizer. The first call walks the collector's objects once and makes
    ``Optimizer.__new__`` record each later optimizer; after it, a lookup costs the optimizers alone (the walk
    was 30 ms per layout in a process holding a test suite's objects, seconds in a large one)."""
    import paddle

    base = paddle.optimizer.Optimizer
    own = base.__dict__.get("__new__")
    if own is None:
        base.__new__ = staticmethod(_register_new)
        _LIVE.update(o for o in gc.get_objects() if isinstance(o, base))
    elif getattr(own, "__func__", own) is not _register_new:     # a paddle with a __new__ of its own: walk each time
        return [o for o in gc.get_objects() if isinstance(o, base)]
    return list(_LIVE)


def _state_names(opt) -> set:
    """Names of the parameters the optimizer keeps accumulators (moments, master weights) for."""
    names = set()
    for per_param in (getattr(opt, "_accumulators", None) or {}).values():
        names.update(per_param)
    names.update(getattr(opt, "_master_weights", None) or {})
    return names


def repoint_optimizers(replaced: dict, stepped: str = "raise", within=None) -> int:
    """Point every live optimizer holding a replaced parameter at its distributed version; returns how many
    optimizers were changed. ``ap.parallelize`` passes ``stepped="skip"`` (an optimizer that already keeps state
    for one of them, say of an earlier single-process run, is left as it is) and ``within``, the ids of the
    model's parameters: an optimizer holding others too (another model's, sharing one parameter) is left to
    that model's own build."""
    if not replaced:
        return 0
    changed = 0
    for opt in live_optimizers():
        params = list(flat_params(opt))
        stale = [p for p in params if id(p) in replaced]
        if not stale or (within is not None and any(id(p) not in within for p in params)):
            continue
        kept = _state_names(opt) & {p.name for p in stale}
        if kept and stepped == "skip":
            continue
        if kept:
            raise StaleOptimizerError(
                f"an optimizer ({type(opt).__name__}) that has already stepped holds {len(stale)} parameter(s) "
                f"that ap.shard_layer replaced by distributed ones (with state for {sorted(kept)[:3]}); its state "
                f"cannot follow the new layout: build the optimizer after ap.shard_layer, or use ap.parallelize")
        _rebind(opt, replaced)
        changed += 1
    return changed


def repoint_stale(opt) -> None:
    """Point ``opt`` (built after a layout from parameters taken before it) at the distributed parameters that
    replaced its parameters (param_carry.successor); an optimizer that stepped on the originals is refused."""
    from autoparallel import param_carry

    replaced = param_carry.stale_map(flat_params(opt))
    if not replaced:
        return
    kept = _state_names(opt) & {p.name for p in flat_params(opt) if id(p) in replaced}
    if kept:
        raise StaleOptimizerError(
            f"an optimizer ({type(opt).__name__}) that has already stepped holds {len(replaced)} parameter(s) that "
            f"a layout replaced by distributed ones (with state for {sorted(kept)[:3]}); its state cannot follow "
            f"the new layout: build the optimizer from model.parameters() after the layout")
    _rebind(opt, replaced)
