"""complete and complete_graph: capture, propagate, enumerate, price and solve, in that order."""
from __future__ import annotations

from autoparallel.graph.completion.candidate_layouts import candidates, feasible
from autoparallel.graph.completion.cost import CostModel
from autoparallel.graph.completion.graph_capture import capture
from autoparallel.graph.completion.options import SolverOptions, resolve
from autoparallel.graph.completion.plan import CompletedPlan
from autoparallel.graph.completion.problem import build_problem
from autoparallel.graph.completion.propagation import propagate
from autoparallel.graph.completion.solver import solve
from autoparallel.graph.completion.sources import _storable
from autoparallel.placement import Replicate


def _greedy(g, cm):
    """Modelled cost of plain eager dispatch: every op's rule on what arrives, sources where they are."""
    cands = {k: [g.nodes[k]["greedy"]] for k in g.nodes}
    fixed = {}
    for key in g.graph["param_uses"]:
        if key[0] == "param":
            fixed[key] = g.graph["param_specs"][key[1]].placements
        else:
            fixed[key] = g.graph["inputs"][key[1]].placements
    problem, _ = build_problem(g, cands, cm, fixed_sources=fixed)
    return problem.cost([0] * len(problem.sizes))


def complete_graph(g, cluster=None, method: str | None = None, options: SolverOptions | None = None) -> CompletedPlan:
    """Complete a graph from ``capture``: propagate, enumerate, price and solve (the package docstring).
    ``options`` (a SolverOptions) or the older ``method=`` keyword choose the solver."""
    options = resolve(method, options)
    missing = [k for k in g.nodes if g.nodes[k].get("greedy") is None]
    if missing:
        raise ValueError(f"graph nodes {missing[:5]} carry no rule call: capture the graph with "
                         f"completion.capture (ap.trace graphs lack the call attributes)")
    cm = CostModel(g.graph["mesh"], cluster)
    known = propagate(g)
    memo = {}
    cands = {k: feasible(g, k, candidates(g, k, known, options.max_drivers, memo)) for k in sorted(g.nodes)}
    problem, variables = build_problem(g, cands, cm)
    assign, cost, stats = solve(problem, options=options)
    results = {}
    layouts = {}
    for v, s in zip(variables, assign):
        if v.kind == "op":
            results[v.key] = v.states[s]
        else:
            layouts[v.key] = tuple(v.states[s])
    for key, uses in g.graph["param_uses"].items():
        if key in layouts:
            continue
        fixed = g.graph["fixed_params"].get(key[1]) if key[0] == "param" else \
            (g.graph["inputs"][key[1]].placements if g.graph["fixed_inputs"][key[1]] else None)
        if fixed is not None:
            layouts[key] = tuple(fixed)
        else:
            node, slot = uses[0]
            layouts[key] = _storable(results[node].inputs[slot].placements)
    mesh = g.graph["mesh"]
    for name, spec in g.graph["param_specs"].items():          # parameters no op uses
        layouts.setdefault(("param", name), tuple(g.graph["fixed_params"].get(name, spec.placements)))
    for i, spec in enumerate(g.graph["inputs"]):
        layouts.setdefault(("input", i), spec.placements if g.graph["fixed_inputs"][i]
                           else tuple(Replicate() for _ in range(mesh.ndim)))
    stats["candidates"] = int(sum(len(c) for c in cands.values()))
    return CompletedPlan(g, results, layouts, cost, _greedy(g, cm), stats, cm)


def complete(model, *input_specs, loss_fn=None, annotations=None, n_model_inputs=None, mesh=None,
             auto_mode: str = "semi", cluster=None, method: str | None = None, hard_inputs=False,
             options: SolverOptions | None = None) -> CompletedPlan:
    """Capture ``model`` (and ``loss_fn``) on ``input_specs`` and choose every layout by total cost.

    ``auto_mode="semi"``: annotations and already distributed parameters are fixed, DistSpec inputs give the
    layout the data arrives in (consumed as is with ``hard_inputs``); ``"full"``: input layouts are free
    (annotations, if any, are still honoured). ``options`` (a SolverOptions) or ``method=`` choose the solver.
    """
    options = resolve(method, options)
    if auto_mode not in ("semi", "full"):
        raise ValueError(f"auto_mode must be 'semi' or 'full', got {auto_mode!r}")
    if not callable(model):
        raise TypeError(f"complete expects the model as a paddle.nn.Layer (or a callable), got "
                        f"{type(model).__name__} {model!r:.60}")
    g = capture(model, *input_specs, loss_fn=loss_fn, n_model_inputs=n_model_inputs, annotations=annotations,
                mesh=mesh, free_inputs=auto_mode == "full", hard_inputs=hard_inputs)
    return complete_graph(g, cluster=cluster, options=options)
