"""A layer's own python containers holding its parameters (``self.penalized = [self.fc1.weight, ...]`` for a
regulariser, ``self.cfg = {"scale": self.fc2.bias}``): repointed to the distributed replacements.

Laying a model out replaces each parameter by a new object in the layers' parameter slots (ties.repoint); a
list, tuple or dict the layer keeps as a plain attribute still held the original, so the forward read a
parameter no optimizer updates (the loss stayed where it was, no error). ``rebind`` walks every sublayer's plain
attributes, containers nested up to ``_DEPTH`` levels, and swaps each replaced parameter for its replacement.
References held outside the model (a user's variable) cannot be reached: docs/api_user_forms.md says so.
"""
from __future__ import annotations

from autoparallel.compat import EagerParamBase

_SLOTS = ("_parameters", "_sub_layers", "_buffers")     # paddle's own registries: ties.repoint sets them
_DEPTH = 3                                               # containers inside containers followed this deep


def rebind(model, replaced: dict) -> None:
    """Swap every original parameter held in ``model``'s layers' plain attributes for its replacement
    (``replaced``: {id(original): replacement})."""
    if not replaced:
        return
    for layer in model.sublayers(include_self=True):
        attrs = vars(layer)
        for name in [n for n in attrs if n not in _SLOTS]:
            value = attrs[name]
            new = _swapped(value, replaced, _DEPTH)
            if new is not value:
                object.__setattr__(layer, name, new)


def _swapped(value, replaced: dict, depth: int):
    """``value`` with replaced parameters swapped: lists and dicts in place (the same object returned), a tuple
    rebuilt (a new object when something changed), anything else returned as it is."""
    if isinstance(value, EagerParamBase):
        return replaced.get(id(value), value)
    if depth == 0:
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            value[i] = _swapped(v, replaced, depth - 1)
        return value
    if isinstance(value, dict):
        for k in list(value):
            value[k] = _swapped(value[k], replaced, depth - 1)
        return value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):      # a namedtuple is left as built
        items = tuple(_swapped(v, replaced, depth - 1) for v in value)
        return items if any(a is not b for a, b in zip(items, value)) else value
    return value
