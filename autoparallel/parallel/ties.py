"""Tied parameters stay tied: one Parameter object held by several layers (``lm_head.weight is
embed_tokens.weight``) is replaced by one distributed parameter, seen by every holder.

    before = holders(model)                 # every (layer, slot) holding a parameter, ties included
    ... styles / shard_fn replace parameters in some slots ...
    replaced = repoint(model, before)       # {id(original): replacement}; every holder of it repointed
    check_replaced(model, before)           # no original parameter left reachable; one object per tie

A tie whose holders ask for different layouts is a ``TiedLayoutError`` naming the holders, the layouts and
what works; two replacements with the same layout are merged into one (never two copies).
"""
from __future__ import annotations

from dataclasses import dataclass

from autoparallel.dist_tensor import is_dist


class TiedLayoutError(ValueError):
    """Holders of one tied parameter ask for incompatible layouts."""


class UnreplacedParameterError(RuntimeError):
    """A parameter of the model was not replaced by its distributed version."""


@dataclass(frozen=True)
class Slot:
    layer_name: str
    layer: object
    attr: str
    param: object            # the parameter held before distribution

    @property
    def path(self) -> str:
        return f"{self.layer_name}.{self.attr}" if self.layer_name else self.attr

    def current(self):
        return self.layer._parameters.get(self.attr)


def holders(model) -> list:
    """Every (layer, attribute) slot holding a parameter; a tied parameter appears once per holder."""
    out = []
    for name, layer in model.named_sublayers(include_self=True):
        for attr, p in layer._parameters.items():
            if p is not None:
                out.append(Slot(name, layer, attr, p))
    return out


def groups(slots) -> dict:
    """{id(parameter): [slots holding it]} in model order."""
    out = {}
    for s in slots:
        out.setdefault(id(s.param), []).append(s)
    return out


def _layout(p):
    return (str(p.mesh), tuple(str(x) for x in p.placements)) if is_dist(p) else None


def _describe(p) -> str:
    return f"{list(p.placements)} on mesh {p.mesh.dim_names}" if is_dist(p) else "unsharded"


def repoint(model, before: list) -> dict:
    """Make every holder of a replaced parameter hold the one replacement; returns {id(original): new}."""
    replaced = {}
    for key, slots in groups(before).items():
        new = _choose(slots)
        if new is None:
            continue
        replaced[key] = new
        for s in slots:
            s.layer._parameters[s.attr] = new
    from autoparallel.parallel.param_refs import rebind

    rebind(model, replaced)             # the layers' own lists / dicts of parameters follow too
    return replaced


def _choose(slots):
    """The one replacement of a tied group (None if no holder replaced it)."""
    changed = [(s, s.current()) for s in slots if s.current() is not s.param and s.current() is not None]
    if not changed:
        return None
    first_slot, first = changed[0]
    for s, p in changed[1:]:
        if p is first:
            continue
        if _layout(p) != _layout(first):
            raise TiedLayoutError(
                f"tied parameter {first_slot.path} (also held as {s.path}) was given two layouts: "
                f"{_describe(first)} by {first_slot.path} and {_describe(p)} by {s.path}; a tied parameter has "
                f"one layout. Give both holders the same placements (for a tied embedding and head: "
                f"VocabParallelEmbedding on the embedding and ColWiseParallel on a [vocab, hidden] head, both "
                f"Shard(0) on the vocab), or shard only one holder and the other uses that layout")
    return first


def check_replaced(model, before: list) -> None:
    """After distribution: no original parameter reachable from the model, one object per tied group."""
    for _, slots in groups(before).items():
        objs = {id(s.current()): s for s in slots if s.current() is not None}    # a slot emptied by the user
        if len(objs) > 1:
            paths = ", ".join(s.path for s in slots)
            raise TiedLayoutError(f"tied parameter held as {paths} ended up as {len(objs)} different objects; "
                                  f"a tie must stay one parameter")
        for s in slots:
            cur = s.current()
            if cur is s.param and not is_dist(cur):
                raise UnreplacedParameterError(
                    f"parameter {s.path} of {type(model).__name__} is still the original (undistributed) "
                    f"parameter after distribution; every parameter must be replaced by its distributed version")
    # a parameter set after `before` was taken (a slot that did not exist then) must be distributed too
    known = {(id(s.layer), s.attr) for s in before}
    for s in holders(model):
        if (id(s.layer), s.attr) not in known and not is_dist(s.param):
            raise UnreplacedParameterError(f"parameter {s.path} of {type(model).__name__} is not distributed")


__all__ = ["TiedLayoutError", "UnreplacedParameterError", "holders", "groups", "repoint", "check_replaced"]
