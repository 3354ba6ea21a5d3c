"""A model's own activation recompute, when its inputs are distributed.

Library models call paddle's recompute themselves: PaddleFormers with ``config.recompute=True`` (and
``recompute_granularity`` "full" / "full_attn" / "core_attn") runs ``paddle.distributed.fleet.utils.recompute(
layer, ...)``, reentrant by default, i.e. through the PyLayer ``RecomputeFunction``, whose forward may return
only paddle Tensors -- a distributed activation is refused there with paddle's "At least one output of
``PyLayer.forward`` is a ``Tensor``". While autoparallel is installed, a reentrant recompute whose inputs include
a distributed tensor runs through paddle's non-reentrant recompute instead (saved-tensor hooks, the one
``Strategy.recompute`` uses): the same function on the same arguments, the same values, activations dropped in
forward and recomputed in backward just the same, and the re-run repeats none of the forward's effects on a
cache or a layer's attributes (``recompute_state``). Calls on plain tensors are untouched. Paddle's input offload
(``offload_indices``, reentrant only) has no distributed form: asking for it raises.

A recompute call (reentrant or not, on plain or distributed tensors) nested in a running recompute region
(``Strategy.recompute``, ``ap.recompute_layers``, ``apply_ac``, or another recompute call) runs as a plain call:
paddle allows one pair of saved-tensor hooks at a time, and the outer region already drops and recomputes the
inner part. A non-reentrant call on distributed tensors gets the same state guard as a reentrant one.
"""
from __future__ import annotations

from autoparallel import compat, patches

_installed = False


def _has_dist(args, depth: int = 0) -> bool:
    """A distributed tensor among ``args``, also inside (nested) lists, tuples and dicts."""
    from autoparallel.dispatch import is_dist

    for a in args:
        if is_dist(a):
            return True
        if depth < 4 and isinstance(a, (list, tuple, dict)):
            if _has_dist(a.values() if isinstance(a, dict) else a, depth + 1):
                return True
    return False


def install() -> None:
    """Patch ``RecomputeFunction.apply`` and paddle's non-reentrant recompute once (idempotent; undone with the
    other patches)."""
    global _installed
    if _installed:
        return
    cls, without_reentrant = compat.reentrant_recompute()
    original = cls.apply

    def apply(_cls, function, preserve, offload_indices, get_state, set_state, *args):
        from autoparallel.parallel.recompute_state import guarded, roots_of, running

        if running():           # inside a Strategy.recompute region, which recomputes this call already
            return function(*args)
        if not _has_dist(args):
            return original(function, preserve, offload_indices, get_state, set_state, *args)
        if offload_indices:
            raise NotImplementedError(
                f"recompute(..., offload_indices={list(offload_indices)}) on distributed tensors: paddle's input "
                f"offload exists only in its reentrant recompute; drop offload_indices (Strategy.sharding.offload "
                f"offloads optimizer states)")
        where = getattr(function, "__qualname__", type(function).__name__)
        function = guarded(function, where, roots_of(function, args, {}))   # the re-run repeats no side effect
        return without_reentrant(function, get_state, set_state, preserve, *args)

    def without(function, get_state, set_state, preserve_rng_state=True, *args, **kwargs):
        from autoparallel.parallel.recompute_state import guarded, marked, roots_of, running

        if running():           # nested in a region: paddle allows one pair of saved-tensor hooks at a time
            return function(*args, **kwargs)
        if _has_dist(list(args) + list(kwargs.values())):       # the re-run repeats no side effect
            where = getattr(function, "__qualname__", type(function).__name__)
            function = guarded(function, where, roots_of(function, args, kwargs))
        else:                   # a region nested in this call runs plainly
            function = marked(function)
        return without_reentrant(function, get_state, set_state, preserve_rng_state, *args, **kwargs)

    patches.patch(cls, "apply", classmethod(apply))
    patches.patch(*compat.non_reentrant_recompute_owner(), without)
    _installed = True


def _reset() -> None:
    global _installed
    _installed = False


patches.on_undo(_reset)
