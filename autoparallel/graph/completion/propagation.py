"""Step 2, propagate: forward and reverse rules to a fixpoint from the annotations."""
from __future__ import annotations

from spmd_rules import get_spmd_rule
from spmd_rules.registry import replace_specs

from autoparallel.graph.completion.sources import _fixed_layout, _storable
from autoparallel.placement import Replicate


def _call_with(d, specs):
    args, kwargs = d["call"]
    return replace_specs(args, kwargs, specs)


def propagate(g) -> dict:
    """Layouts inferred from the annotations: {tensor key: placements} (see Source.key), forward and
    reverse rules alternating until nothing new is inferred (a tensor keeps its first inference)."""
    known = {}
    for name, pl in g.graph["fixed_params"].items():
        known[("param", name)] = tuple(pl)
    for i, spec in enumerate(g.graph["inputs"]):
        if g.graph["fixed_inputs"][i]:
            known[("input", i)] = spec.placements
    for (node, slot), (pl, _) in g.graph["out_annotations"].items():
        known[("op", node, slot)] = pl
    order = sorted(g.nodes)
    changed = True
    while changed:
        changed = False
        for k in order:
            changed |= _forward_step(g, k, known)
        for k in reversed(order):
            changed |= _reverse_step(g, k, known)
    return known


def _leaf_specs(g, k, known):
    d = g.nodes[k]
    specs, any_known = [], False
    for i, s in enumerate(d["sources"]):
        seen = d["seen"][i]
        pl = _fixed_layout(g, s) if s.kind == "const" else known.get(s.key)
        if pl is not None and s.kind != "const":
            any_known = True
        specs.append(seen.with_placements(pl) if pl is not None else
                     seen.with_placements([Replicate()] * seen.mesh.ndim))
    return specs, any_known


def _learn(known, key, placements, store: bool) -> bool:
    """Record an inferred layout for an unknown tensor. Replicate everywhere carries no information (it is
    what an unknown tensor reads as), so it is not recorded: a later inference may still fill it in."""
    if key is None or key in known or all(p.is_replicate() for p in placements):
        return False
    known[key] = _storable(placements) if store else tuple(placements)
    return True


def _forward_step(g, k, known) -> bool:
    d = g.nodes[k]
    specs, any_known = _leaf_specs(g, k, known)
    if not any_known or d["greedy"] is None:
        return False
    args, kwargs = _call_with(d, specs)
    try:
        res = get_spmd_rule(d["op"])(*args, **kwargs)
    except (ValueError, TypeError, NotImplementedError, IndexError):
        return False
    changed = False
    for i, s in enumerate(d["sources"]):
        if s.kind in ("param", "input"):
            changed |= _learn(known, s.key, res.inputs[i].placements, store=True)
    for slot, o in enumerate(res.outputs):
        if o is not None:
            changed |= _learn(known, ("op", k, slot), o.placements, store=False)
    return changed


def _reverse_step(g, k, known) -> bool:
    d = g.nodes[k]
    rule = get_spmd_rule(d["op"])
    outs = d["outputs"]
    if not rule.has_reverse or d["greedy"] is None or \
            not any(("op", k, j) in known for j, o in enumerate(outs) if o is not None):
        return False
    wanted = tuple(None if o is None else o.with_placements(known.get(("op", k, j), [Replicate()] * o.mesh.ndim))
                   for j, o in enumerate(outs))
    specs, _ = _leaf_specs(g, k, known)
    args, kwargs = _call_with(d, specs)
    try:
        rev = rule.reverse(wanted, *args, **kwargs)
    except (ValueError, TypeError, NotImplementedError, IndexError):
        return False
    changed = False
    for i, s in enumerate(d["sources"]):
        changed |= _learn(known, s.key, rev.inputs[i].placements, store=s.kind != "op")
    return changed
