"""Steps 3 and 4, candidates: the distinct rule results of an op, filtered by the hard annotations."""
from __future__ import annotations

import itertools

from spmd_rules import get_spmd_rule
from spmd_rules.registry import call_key

from autoparallel.graph.completion.errors import AnnotationConflictError
from autoparallel.graph.completion.propagation import _call_with, _leaf_specs
from autoparallel.graph.completion.sources import _fixed_layout
from autoparallel.placement import Partial, Replicate, Shard, format_placements


_MAX_DRIVERS = 4      # ops with more tensor inputs: only the largest few drive a mesh dim


def _drivers(specs, max_drivers: int = _MAX_DRIVERS):
    big = sorted(range(len(specs)), key=lambda i: -specs[i].numel)[:max_drivers]
    out = [None]
    for i in big:
        out += [(i, Shard(d)) for d in range(specs[i].ndim)]
        if specs[i].dtype.startswith(("float", "bfloat")):
            out.append((i, Partial("sum")))
    out.append("all_partial")
    return out


def _result_key(res):
    return (res.inputs, res.outputs, res.local_op)


def candidates(g, k, known=None, max_drivers: int = _MAX_DRIVERS, memo: dict | None = None) -> list:
    """Distinct SpmdResults of op ``k`` (before hard annotations are applied); ``max_drivers``: see
    SolverOptions. ``memo`` (one dict per completion): ops with the same call, layouts seen, annotations and
    propagated inputs -- the same op in every repeated block -- share one enumeration."""
    d = g.nodes[k]
    if d["greedy"] is None:
        return []
    key = _node_key(g, k, known, max_drivers) if memo is not None else None
    if key is None:
        return _enumerate(g, k, known, max_drivers)
    if key not in memo:
        memo[key] = _enumerate(g, k, known, max_drivers)
    return list(memo[key])


def _node_key(g, k, known, max_drivers):
    """Everything ``_enumerate`` reads about op ``k``, hashable; None when a call argument is not."""
    d = g.nodes[k]
    try:
        call = call_key(*d["call"])
    except TypeError:
        return None
    leaf = None if known is None else tuple(_leaf_specs(g, k, known)[0])
    fixed = tuple(None if f is None else tuple(f) for f in (_fixed_layout(g, s) for s in d["sources"]))
    return (d["op"], call, tuple(d["seen"]), _result_key(d["greedy"]), leaf, fixed, max_drivers, g.graph["mesh"])


def _enumerate(g, k, known, max_drivers) -> list:
    d = g.nodes[k]
    rule = get_spmd_rule(d["op"])
    seen = list(d["seen"])
    mesh = g.graph["mesh"]
    found = {}

    def add(res):
        found.setdefault(_result_key(res), res)

    def call(specs):
        args, kwargs = _call_with(d, specs)
        try:
            add(rule(*args, **kwargs))
        except (ValueError, TypeError, NotImplementedError, IndexError):
            pass

    add(d["greedy"])
    if known is not None:
        specs, _ = _leaf_specs(g, k, known)
        call(specs)
    fixed = [_fixed_layout(g, s) for s in d["sources"]]
    if any(f is not None for f in fixed):
        call([sp.with_placements(f if f is not None else [Replicate()] * mesh.ndim) for sp, f in zip(seen, fixed)])
    if not seen:
        return list(found.values())
    made = {}

    def spec(i, pl):
        key = (i, pl)
        if key not in made:
            made[key] = seen[i].with_placements(pl)
        return made[key]

    drivers = _drivers(seen, max_drivers)
    per_dim = [drivers if mesh.shape[m] > 1 else [None] for m in range(mesh.ndim)]   # size-1 dims: nothing to split
    for combo in itertools.product(*per_dim):
        pls = [[Replicate()] * mesh.ndim for _ in seen]
        for m, drv in enumerate(combo):
            if drv == "all_partial":
                for i, sp in enumerate(seen):
                    if sp.dtype.startswith(("float", "bfloat")):
                        pls[i][m] = Partial("sum")
            elif drv is not None:
                pls[drv[0]][m] = drv[1]
        try:
            specs = [spec(i, tuple(p)) for i, p in enumerate(pls)]
        except ValueError:
            continue
        call(specs)
    return list(found.values())


def _compatible(required, annotated) -> bool:
    """Is an input required as ``required`` consuming an annotated layout as-is (R may enter as P)?"""
    return all(r == a or (a.is_replicate() and r.is_partial()) for r, a in zip(required, annotated))


def _hard_constraints(g, k):
    """[(description, predicate on an SpmdResult)] for op k's annotated inputs and outputs."""
    d = g.nodes[k]
    out = []
    for i, s in enumerate(d["sources"]):
        hard = s.kind == "param" or (s.kind == "input" and g.graph["hard_inputs"][s.node])
        f = _fixed_layout(g, s) if hard else None
        if f is None:
            continue
        what = f"parameter {s.name!r}" if s.kind == "param" else f"input {s.node}"
        out.append((f"{what} annotated {format_placements(f)}",
                    lambda res, i=i, f=f: _compatible(res.inputs[i].placements, f)))
    for slot, o in enumerate(d["outputs"]):
        ann = g.graph["out_annotations"].get((k, slot))
        if ann is not None:
            pl, layer = ann
            out.append((f"the output of layer {layer!r} annotated {format_placements(pl)}",
                        lambda res, slot=slot, pl=pl: tuple(res.outputs[slot].placements) == tuple(pl)))
    return out


def feasible(g, k, cands) -> list:
    """The candidates honouring every annotation at op k; AnnotationConflictError naming them if none."""
    hard = _hard_constraints(g, k)
    ok = [c for c in cands if all(p(c) for _, p in hard)]
    if ok:
        return ok
    d = g.nodes[k]
    where = f"op {k} ({d['op']} in layer {d['layer']!r})"
    for (a, pa), (b, pb) in itertools.combinations(hard, 2):
        if not any(pa(c) and pb(c) for c in cands):
            raise AnnotationConflictError(
                f"conflicting annotations at {where}: {a} and {b}; no layout of {d['op']} accepts both "
                f"(change one of them, or leave one unannotated and let completion insert the reshard)")
    for a, pa in hard:
        if not any(pa(c) for c in cands):
            raise AnnotationConflictError(f"annotation not satisfiable at {where}: {a}; no layout of "
                                          f"{d['op']} consumes or produces it as annotated")
    raise AnnotationConflictError(f"conflicting annotations at {where}: {'; '.join(a for a, _ in hard)}; no "
                                  f"layout of {d['op']} satisfies all of them together")
