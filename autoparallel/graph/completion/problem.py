"""The discrete layout problem (one state per variable, unary and pairwise costs) built from a graph."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoparallel.graph.completion.cost import CostModel, use_cost
from autoparallel.graph.completion.sources import _fixed_layout, _storable, source_needs_grad
from autoparallel.placement import Replicate, format_placements


class Problem:
    """min over one state per variable of sum(unary[v][x_v]) + sum(pair[(u, w)][x_u, x_w])."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.unary = [np.zeros(n) for n in self.sizes]
        self.pairs = {}

    def add_pair(self, u, w, table):
        table = np.asarray(table, dtype=float)
        if u == w:
            self.unary[u] += np.diag(table)
            return
        if u > w:
            u, w, table = w, u, table.T
        if (u, w) in self.pairs:
            self.pairs[(u, w)] = self.pairs[(u, w)] + table
        else:
            self.pairs[(u, w)] = table.copy()

    def cost(self, assign) -> float:
        total = sum(float(self.unary[v][assign[v]]) for v in range(len(self.sizes)))
        return total + sum(float(t[assign[u], assign[w]]) for (u, w), t in self.pairs.items())

    def size(self) -> int:
        return int(np.prod([float(n) for n in self.sizes]))


@dataclass
class _Var:
    kind: str                   # "op" or "source"
    key: object                 # node id, or a source key
    states: list                # SpmdResults, or stored placements


def _free_sources(g):
    """Sources whose layout completion chooses, with their uses: {key: [(node, slot)]}."""
    out = {}
    for key, uses in g.graph["param_uses"].items():
        kind = key[0]
        if kind == "param" and key[1] in g.graph["fixed_params"]:
            continue
        if kind == "input" and g.graph["fixed_inputs"][key[1]]:
            continue
        out[key] = uses
    return out


def _source_spec(g, key, placements):
    if key[0] == "param":
        return g.graph["param_specs"][key[1]].with_placements(placements)
    return g.graph["inputs"][key[1]].with_placements(placements)


def build_problem(g, cands: dict, cm: CostModel, fixed_sources: dict | None = None):
    """(Problem, variables) for graph ``g`` with candidate SpmdResults ``cands[node]``.

    Free sources used once are stored as their consumer requires (folded into that op); free sources used
    more than once become variables. ``fixed_sources`` {source key: placements} overrides that (used to
    price an eager run, whose parameters stay where they are)."""
    fixed_sources = dict(fixed_sources or {})
    mesh = g.graph["mesh"]
    nodes = sorted(g.nodes)
    free = {k: u for k, u in _free_sources(g).items() if k not in fixed_sources}
    multi = {k: u for k, u in free.items() if len(u) > 1}
    variables = [_Var("op", k, cands[k]) for k in nodes]
    index = {k: i for i, k in enumerate(nodes)}
    for key, uses in multi.items():
        states = {tuple(Replicate() for _ in range(mesh.ndim))}
        for node, slot in uses:
            states |= {_storable(r.inputs[slot].placements) for r in cands[node]}
        index[key] = len(variables)
        variables.append(_Var("source", key, sorted(states, key=format_placements)))
    problem = Problem([len(v.states) for v in variables])
    loss = g.graph.get("loss")
    shared = {}             # repeated ops share their candidate objects (candidates' memo): price them once
    for k in nodes:
        d = g.nodes[k]
        vi = index[k]
        un = problem.unary[vi]
        ids = tuple(id(r) for r in cands[k])
        un += _memo_row(shared, ("compute", ids, d["flops"]), lambda: [cm.compute(d["flops"], r) for r in cands[k]])
        if loss is not None and loss[0] == k:
            for si, res in enumerate(cands[k]):
                un[si] += cm.seconds(res.outputs[loss[1]], [Replicate()] * mesh.ndim)
        for i, s in enumerate(d["sources"]):
            grad = source_needs_grad(g, s)
            if s.kind == "op":
                _add_edge(problem, index[s.node], vi, cands[s.node], cands[k], s.slot, i, cm, grad)
                un += _memo_row(shared, ("use", ids, i, grad), lambda: [
                    use_cost(cm, r.inputs[i], r.inputs[i], r, grad, False) for r in cands[k]])
            elif s.key in multi:
                var = variables[index[s.key]]
                table = np.zeros((len(var.states), len(cands[k])))
                for a, pl in enumerate(var.states):
                    spec = _source_spec(g, s.key, pl)
                    for si, res in enumerate(cands[k]):
                        table[a, si] = use_cost(cm, spec, res.inputs[i], res, grad, s.kind == "param")
                problem.add_pair(index[s.key], vi, table)
            else:
                for si, res in enumerate(cands[k]):
                    req = res.inputs[i]
                    if s.key in free:
                        spec = req.with_placements(_storable(req.placements))
                    elif s.key in fixed_sources:
                        spec = req.with_placements(fixed_sources[s.key])
                    elif s.kind == "const":
                        spec = s.spec
                    else:
                        spec = req.with_placements(_fixed_layout(g, s))
                    un[si] += use_cost(cm, spec, req, res, grad, s.kind == "param")
    return problem, variables


def _memo_row(memo: dict, key, compute):
    """A unary cost row, computed once per key (rows are read, never written)."""
    row = memo.get(key)
    if row is None:
        row = memo[key] = np.asarray(compute(), dtype=float)
    return row


def _add_edge(problem, u, w, cu, cw, slot, i, cm, grad):
    """Pairwise reshard cost: producer state a's output ``slot`` -> consumer state b's input ``i``."""
    outs = [r.outputs[slot] for r in cu]
    reqs = [r.inputs[i].placements for r in cw]
    ou = {}
    oi = np.array([ou.setdefault(o, len(ou)) for o in outs])
    ru = {}
    ri = np.array([ru.setdefault(q, len(ru)) for q in reqs])
    small = cm.reshard_table(tuple(ou), tuple(ru), grad)
    problem.add_pair(u, w, small[oi][:, ri])
