"""Step 6, solve exactly: dynamic-programming elimination, then an integer program on what branches."""
from __future__ import annotations

import itertools

import numpy as np

from autoparallel.graph.completion.options import SolverOptions, resolve
from autoparallel.graph.completion.problem import Problem


def exhaustive(problem: Problem, limit: int = 2_000_000):
    """Every combination (for checking the solver on small problems)."""
    if problem.size() > limit:
        raise ValueError(f"exhaustive search over {problem.size()} combinations exceeds the limit {limit}")
    best, arg = float("inf"), None
    for assign in itertools.product(*[range(n) for n in problem.sizes]):
        c = problem.cost(assign)
        if c < best - 1e-15:
            best, arg = c, assign
    return list(arg), best


def _eliminate(problem: Problem):
    """Dynamic programming: remove variables with <= 2 neighbours, folding them into the rest.
    Returns (remaining variables, unary, pairs, records for back-substitution)."""
    unary = [u.copy() for u in problem.unary]
    pairs = {k: t.copy() for k, t in problem.pairs.items()}
    nbrs = {v: set() for v in range(len(unary))}
    for u, w in pairs:
        nbrs[u].add(w)
        nbrs[w].add(u)

    def get(u, w):
        return pairs[(u, w)] if u < w else pairs[(w, u)].T

    def put(u, w, t):
        if u > w:
            u, w, t = w, u, t.T
        pairs[(u, w)] = pairs[(u, w)] + t if (u, w) in pairs else t
        nbrs[u].add(w)
        nbrs[w].add(u)

    def drop(u, w):
        pairs.pop((min(u, w), max(u, w)))
        nbrs[u].discard(w)
        nbrs[w].discard(u)

    alive = set(range(len(unary)))
    records = []
    queue = [v for v in alive if len(nbrs[v]) <= 2]
    while queue:
        v = queue.pop()
        if v not in alive or len(nbrs[v]) > 2:
            continue
        ns = sorted(nbrs[v])
        if not ns:
            records.append((v, (), int(np.argmin(unary[v]))))
        elif len(ns) == 1:
            u = ns[0]
            t = get(u, v) + unary[v][None, :]
            unary[u] = unary[u] + t.min(axis=1)
            records.append((v, (u,), t.argmin(axis=1)))
            drop(u, v)
        else:
            u, w = ns
            a, b = get(u, v), get(v, w)
            best = np.empty((a.shape[0], b.shape[1]))
            arg = np.empty((a.shape[0], b.shape[1]), dtype=np.int64)
            for i in range(a.shape[0]):
                t = (a[i] + unary[v])[:, None] + b
                arg[i] = t.argmin(axis=0)
                best[i] = t[arg[i], np.arange(t.shape[1])]
            records.append((v, (u, w), arg))
            drop(u, v)
            drop(v, w)
            put(u, w, best)
        alive.discard(v)
        queue.extend(n for n in ns if n in alive and len(nbrs[n]) <= 2)
    return alive, unary, pairs, records


def _back_substitute(assign, records):
    for v, ns, arg in reversed(records):
        if not ns:
            assign[v] = int(arg)
        elif len(ns) == 1:
            assign[v] = int(arg[assign[ns[0]]])
        else:
            assign[v] = int(arg[assign[ns[0]], assign[ns[1]]])
    return assign


def _prune(vs, unary, pairs, probes: int = 8):
    """Dead-end elimination (Goldstein): drop states that another state of the same variable beats whatever
    the neighbours do. Keeps an optimum. Returns {v: kept state indices}."""
    keep = {v: np.arange(len(unary[v])) for v in vs}
    nb = {v: [] for v in vs}
    for (u, w), t in pairs.items():
        nb[u].append((w, t))
        nb[w].append((u, t.T))
    for v in vs:
        ks = keep[v]
        if len(ks) <= 1:
            continue
        rows = [t for _, t in nb[v]]
        # a is dominated by b if  unary[a] - unary[b] + sum_n min_c (t[a, c] - t[b, c]) > 0
        dead = np.zeros(len(unary[v]), dtype=bool)
        order = np.argsort(unary[v])
        for b in order[:probes]:
            gain = unary[v] - unary[v][b]
            for t in rows:
                gain = gain + (t - t[b][None, :]).min(axis=1)
            hit = gain > 1e-12
            hit[b] = False
            dead |= hit & ~dead
        kept = np.flatnonzero(~dead)
        keep[v] = kept if len(kept) else np.array([int(np.argmin(unary[v]))])
    return keep


def _ilp(vs, unary, pairs, options: SolverOptions = SolverOptions()):
    """Exact solution of the remaining core by HiGHS (local polytope + integral states)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    vs = sorted(vs)
    keep = _prune(vs, unary, {k: t for k, t in pairs.items() if k[0] in vs and k[1] in vs},
                  options.dominance_probes)
    xoff, n = {}, 0
    for v in vs:
        xoff[v] = n
        n += len(keep[v])
    yoff = {}
    for (u, w) in pairs:
        yoff[(u, w)] = n
        n += len(keep[u]) * len(keep[w])
    scale = 1e6                                 # seconds -> microseconds: well inside HiGHS's tolerances
    c = np.zeros(n)
    integ = np.zeros(n)
    rows, cols, vals, rhs = [], [], [], []
    r = 0
    for v in vs:
        kv = keep[v]
        c[xoff[v]:xoff[v] + len(kv)] = unary[v][kv] * scale
        integ[xoff[v]:xoff[v] + len(kv)] = 1
        rows += [r] * len(kv)
        cols += list(range(xoff[v], xoff[v] + len(kv)))
        vals += [1.0] * len(kv)
        rhs.append(1.0)
        r += 1
    for (u, w), t in pairs.items():
        ku, kw = keep[u], keep[w]
        sub = t[np.ix_(ku, kw)]
        base = yoff[(u, w)]
        c[base:base + sub.size] = sub.ravel() * scale
        nu, nw = len(ku), len(kw)
        for a in range(nu):                     # sum_c y[a, c] = x_u[a]
            rows += [r] * (nw + 1)
            cols += list(range(base + a * nw, base + a * nw + nw)) + [xoff[u] + a]
            vals += [1.0] * nw + [-1.0]
            rhs.append(0.0)
            r += 1
        for b in range(nw):                     # sum_a y[a, c] = x_w[c]
            rows += [r] * (nu + 1)
            cols += [base + a * nw + b for a in range(nu)] + [xoff[w] + b]
            vals += [1.0] * nu + [-1.0]
            rhs.append(0.0)
            r += 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    res = milp(c, constraints=LinearConstraint(A, rhs, rhs), integrality=integ, bounds=Bounds(0, 1),
               options={"time_limit": options.ilp_time_limit, "mip_rel_gap": options.ilp_rel_gap})
    if res.x is None:
        raise RuntimeError(f"the layout integer program found no solution ({res.message})")
    assign = {}
    for v in vs:
        kv = keep[v]
        assign[v] = int(kv[int(np.argmax(res.x[xoff[v]:xoff[v] + len(kv)]))])
    return assign, {"ilp_vars": n, "ilp_rows": r, "ilp_status": res.message, "ilp_optimal": res.status == 0}


def solve(problem: Problem, method: str | None = None, options: SolverOptions | None = None):
    """(assignment, cost, stats). ``method`` (or ``options.method``): "auto" (DP elimination, then ILP on what
    branches), "ilp" (the whole problem as one integer program) or "exhaustive"."""
    options = resolve(method, options)
    method = options.method
    if method == "exhaustive":
        assign, cost = exhaustive(problem, options.exhaustive_limit)
        return assign, cost, {"method": "exhaustive"}
    stats = {"method": method, "variables": len(problem.sizes), "pairs": len(problem.pairs)}
    if method == "ilp":
        core = set(range(len(problem.sizes)))
        unary, pairs, records = problem.unary, problem.pairs, []
    else:
        core, unary, pairs, records = _eliminate(problem)
    stats["eliminated"] = len(records)
    stats["core"] = len(core)
    assign = [0] * len(problem.sizes)
    if core:
        sub, info = _ilp(core, unary, {k: t for k, t in pairs.items() if k[0] in core and k[1] in core}, options)
        stats.update(info)
        for v, s in sub.items():
            assign[v] = s
    _back_substitute(assign, records)
    return assign, problem.cost(assign), stats
