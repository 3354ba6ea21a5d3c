"""Whole-graph completion (autoparallel/graph/completion.py): layouts, exactness of the solver, errors."""
import itertools

import numpy as np
import paddle
import paddle.nn as nn
import pytest

import autoparallel as ap
from autoparallel.graph.completion import (AnnotationConflictError, CostModel, MissingRuleError, Problem,
                                           build_problem, candidates, capture, complete, exhaustive, feasible,
                                           propagate, solve)
from autoparallel.planner.calibrate import cpu_profile
from autoparallel.spec import DistSpec
from dist_scripts.static_models import MLP, ResidualMLP, mse
from rule_removal import rule_removed

R, S, P = ap.Replicate(), ap.Shard, ap.Partial("sum")
CPU = cpu_profile(20e9, 10e9, 8e9, 4)          # a fixed CPU/gloo-like cluster: decisions do not drift


def mesh1(n=2, name="model"):
    return ap.ProcessMesh(list(range(n)), dim_names=[name])


def lazy(cls, *args):
    with paddle.LazyGuard():
        return cls(*args)


# ---- the Megatron layout from one annotation ----------------------------------------------------------
def test_megatron_layout_from_the_first_weight_alone():
    plan = complete(lazy(MLP, 16, 64), DistSpec(mesh1(), [R], (8, 16)), annotations={"fc1.weight": "[S(1)]"})
    fc1, gelu, fc2 = plan.nodes_in("fc1", "linear")[0], plan.nodes_in("MLP", "gelu")[0], plan.nodes_in("fc2")[0]
    assert plan.placements(fc1, 0, output=False) == "[R]"           # column parallel: input replicated
    assert plan.placements(fc1) == "[S(1)]"                         # output sharded on features
    assert plan.placements(gelu) == "[S(1)]"
    assert plan.placements(fc2, 0, output=False) == "[S(1)]"        # row parallel: consumes the shard
    assert plan.placements(fc2, 1, output=False) == "[S(0)]"
    assert plan.placements(fc2) == "[P(sum)]"                       # one pending all_reduce
    layouts = {k: "[" + ", ".join(map(str, v)) + "]" for k, v in plan.param_layouts.items()}
    assert layouts == {"fc1.weight": "[S(1)]", "fc1.bias": "[S(0)]", "fc2.weight": "[S(0)]", "fc2.bias": "[R]"}
    assert plan.collective_counts()["forward"] == {}                # nothing gathered in between
    assert plan.cost <= plan.greedy_cost


def test_megatron_on_the_model_dim_of_a_2x2_mesh():
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
    plan = complete(lazy(MLP, 16, 64), DistSpec(mesh, [S(0), R], (8, 16)), annotations={"fc1.weight": "[R, S(1)]"})
    model_dim = {k: str(v[1]) for k, v in plan.param_layouts.items()}
    assert model_dim == {"fc1.weight": "S(1)", "fc1.bias": "S(0)", "fc2.weight": "S(0)", "fc2.bias": "R"}
    assert plan.placements(plan.nodes_in("fc2")[0]).endswith("P(sum)]")


def test_listing_names_placements_and_the_collectives_each_op_causes():
    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
    plan = complete(lazy(MLP, 16, 64), DistSpec(mesh, [S(0), R], (8, 16)), DistSpec(mesh, [S(0), R], (8, 16)),
                    loss_fn=mse, annotations={"fc1.weight": "[R, S(1)]"})
    text = plan.listing()
    assert "fc1.weight:[R, S(1)]" in text and "(annotated)" in text
    assert "bwd bucketed grad reduction of fc1.weight over mesh dim 0" in text
    counts = plan.collective_counts()
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("fwd ")]
    assert sum(counts["forward"].values()) == len(lines)


# ---- propagation ------------------------------------------------------------------------------------------
def test_reverse_rules_carry_a_later_annotation_back_to_earlier_parameters():
    g = capture(lazy(MLP, 16, 64), DistSpec(mesh1(), [R], (8, 16)), annotations={"fc2": "[S(1)]"})
    known = propagate(g)
    assert known[("param", "fc2.weight")] == (S(1),)                 # reverse of linear from its output
    assert known[("op", 2, 0)] == (S(1),)


def test_forward_rules_carry_an_annotation_to_later_parameters():
    g = capture(lazy(MLP, 16, 64), DistSpec(mesh1(), [R], (8, 16)), annotations={"fc1.weight": "[S(1)]"})
    known = propagate(g)
    assert known[("param", "fc2.weight")] == (S(0),)
    assert known[("op", 1, 0)] == (S(1),)


# ---- exactness --------------------------------------------------------------------------------------------
def _random_problem(rng, edges, sizes):
    p = Problem(sizes)
    for v, n in enumerate(sizes):
        p.unary[v] = rng.uniform(0, 1, n)
    for u, w in edges:
        p.add_pair(u, w, rng.uniform(0, 1, (sizes[u], sizes[w])))
    return p


GRAPHS = {
    "chain": [(0, 1), (1, 2), (2, 3), (3, 4)],
    "tree": [(0, 1), (0, 2), (2, 3), (2, 4), (4, 5)],
    "k4": [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)],
    "k4_with_tail": [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (3, 4), (4, 5)],
    "grid3x3": [(r * 3 + c, r * 3 + c + 1) for r in range(3) for c in range(2)] +
               [(r * 3 + c, (r + 1) * 3 + c) for r in range(2) for c in range(3)],
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_dp_and_ilp_equal_exhaustive_search_on_random_problems(name):
    rng = np.random.default_rng(len(name))
    edges = GRAPHS[name]
    n = 1 + max(max(e) for e in edges)
    for trial in range(3):
        p = _random_problem(rng, edges, list(rng.integers(2, 5 if n <= 6 else 4, n)))
        _, best = exhaustive(p)
        for method in ("auto", "ilp"):
            assign, cost, stats = solve(p, method)
            assert cost == pytest.approx(best, rel=1e-9, abs=1e-12), (name, method, stats)
            assert p.cost(assign) == pytest.approx(cost)


class Branches(nn.Layer):
    """Three branches of one input, joined pairwise: its layout problem has a core no elimination removes."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a, b, c = self.a(x), self.b(x), self.c(x)
        return (a + b + (b + c)) * (a * c)


@pytest.mark.parametrize("model", ["branches", "residual"])
def test_completion_equals_exhaustive_search_on_captured_graphs(model):
    net = lazy(Branches, 64) if model == "branches" else lazy(ResidualMLP, 32, 64, 16)
    d = 64 if model == "branches" else 32
    g = capture(net, DistSpec(mesh1(), [S(0)], (32, d)))
    cm = CostModel(g.graph["mesh"], CPU)
    known = propagate(g)
    cands = {k: feasible(g, k, candidates(g, k, known))[:4] for k in sorted(g.nodes)}   # keep it enumerable
    problem, _ = build_problem(g, cands, cm)
    _, best = exhaustive(problem)
    for method in ("auto", "ilp"):
        _, cost, stats = solve(problem, method)
        assert cost == pytest.approx(best, rel=1e-9), (method, stats)
    if model == "branches":
        assert solve(problem, "auto")[2]["core"] > 0                    # the ILP part was exercised
    plan = complete(net, DistSpec(mesh1(), [S(0)], (32, d)), cluster=CPU)
    assert plan.cost <= plan.greedy_cost + 1e-12


# ---- errors ---------------------------------------------------------------------------------------------------
def test_conflicting_annotations_name_both():
    x = DistSpec(mesh1(), [R], (8, 16))
    with pytest.raises(AnnotationConflictError) as e:           # row-parallel weight: its bias cannot be S(0)
        complete(lazy(MLP, 16, 64), x, annotations={"fc1.weight": "[S(0)]", "fc1.bias": "[S(0)]"})
    msg = str(e.value)
    assert "parameter 'fc1.weight' annotated (S(0))" in msg and "parameter 'fc1.bias' annotated (S(0))" in msg
    assert "linear" in msg and "'fc1'" in msg
    with pytest.raises(AnnotationConflictError) as e:           # S(0) weight gives P, not the annotated S(1)
        complete(lazy(MLP, 16, 64), x, annotations={"fc1.weight": "[S(0)]", "fc1": "[S(1)]"})
    assert "parameter 'fc1.weight' annotated (S(0))" in str(e.value)
    assert "the output of layer 'fc1' annotated (S(1))" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(AnnotationConflictError) as e:           # a hard input layout is an annotation too
        complete(lazy(MLP, 16, 64), DistSpec(mesh1(), [S(1)], (8, 16)), annotations={"fc1.weight": "[S(1)]"},
                 hard_inputs=True)
    assert "input 0 annotated (S(1))" in str(e.value) and "parameter 'fc1.weight' annotated (S(1))" in str(e.value)


def test_an_annotated_input_is_where_data_arrives_and_may_be_resharded():
    plan = complete(lazy(MLP, 16, 64), DistSpec(mesh1(), [S(1)], (8, 16)), annotations={"fc1.weight": "[S(1)]"})
    assert plan.input_layouts == [(S(1),)]
    assert plan.placements(0, 0, output=False) == "[R]"
    assert [p.collectives for _, _, p in plan.reshards(0)] == [["all_gather"]]


def test_annotation_of_an_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="names neither a parameter nor a sublayer"):
        complete(lazy(MLP), DistSpec(mesh1(), [R], (8, 16)), annotations={"fc9.weight": "[S(1)]"})
    with pytest.raises(ValueError, match="expected 1 placements"):
        complete(lazy(MLP), DistSpec(mesh1(), [R], (8, 16)), annotations={"fc1.weight": "[S(1), R]"})


class Cumulative(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x).abs() + 1.0
        return paddle.atan2(y, y)                          # atan2's rule is removed by the test


def test_an_op_without_a_rule_inside_the_captured_graph():
    with rule_removed("atan2"), pytest.raises(MissingRuleError) as e:
        complete(Cumulative(), DistSpec(mesh1(), [R], (4, 8)))
    assert isinstance(e.value, NotImplementedError)
    assert "atan2" in str(e.value) and "register_spmd_rule" in str(e.value) and "Cumulative" in str(e.value)


def test_greedy_is_never_cheaper_than_completion_on_the_benchmark_graphs():
    m4 = mesh1(4, "data")
    cases = [(lazy(MLP, 64, 256), [DistSpec(m4, [S(0)], (16, 64)), DistSpec(m4, [S(0)], (16, 64))], {}),
             (lazy(ResidualMLP, 64, 256, 16), [DistSpec(mesh1(4), [R], (16, 64)), DistSpec(mesh1(4), [R], (16, 16))],
              {"fc1.weight": "[S(1)]"})]
    for net, specs, ann in cases:
        plan = complete(net, *specs, loss_fn=mse, annotations=ann, cluster=CPU)
        assert plan.cost <= plan.greedy_cost
        assert set(plan.param_layouts) == {n for n, _ in net.named_parameters()}


def test_exhaustive_refuses_huge_problems():
    p = Problem([10] * 8)
    with pytest.raises(ValueError, match="exceeds the limit"):
        exhaustive(p)
    with pytest.raises(ValueError, match="method must be"):
        solve(p, "greedy")


def test_dp_records_every_variable():
    rng = np.random.default_rng(0)
    p = _random_problem(rng, GRAPHS["tree"], [3] * 6)
    assign, cost, stats = solve(p, "auto")
    assert stats["core"] == 0 and stats["eliminated"] == 6
    best = min(p.cost(a) for a in itertools.product(range(3), repeat=6))
    assert cost == pytest.approx(best)


def test_fast_reshard_prices_equal_the_reshard_planner():
    from reshard import plan_reshard

    from autoparallel.testing.check import placement_choices

    mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
    cm = CostModel(mesh, CPU)
    choices = placement_choices(3)
    for src in itertools.product(choices, repeat=2):
        spec = DistSpec(mesh, src, (8, 6, 4))
        for dst in itertools.product(choices, repeat=2):
            want = plan_reshard(spec.shape, spec.dtype, mesh, spec.placements, dst, cluster=CPU).seconds
            assert cm.seconds(spec, dst) == pytest.approx(want, rel=1e-9, abs=1e-15), (src, dst)


def test_solver_options_replace_the_method_keyword_and_bound_the_search():
    from autoparallel.graph.completion import SolverOptions

    rng = np.random.default_rng(1)
    p = _random_problem(rng, GRAPHS["tree"], [3] * 6)
    assert solve(p, "ilp")[1] == pytest.approx(solve(p, options=SolverOptions(method="ilp"))[1])
    with pytest.raises(ValueError, match="contradicts"):
        solve(p, "ilp", options=SolverOptions(method="auto"))
    with pytest.raises(ValueError, match="exceeds the limit 100"):
        solve(Problem([10] * 3), options=SolverOptions(method="exhaustive", exhaustive_limit=100))
    with pytest.raises(ValueError, match="max_drivers must be a positive int"):
        SolverOptions(max_drivers=0)
    with pytest.raises(TypeError, match="SolverOptions"):
        solve(p, options={"method": "ilp"})
    x = DistSpec(mesh1(), [R], (8, 16))
    wide = complete(lazy(MLP, 16, 64), x, cluster=CPU)
    narrow = complete(lazy(MLP, 16, 64), x, cluster=CPU, options=SolverOptions(max_drivers=1))
    assert narrow.stats["candidates"] < wide.stats["candidates"]          # fewer drivers, fewer layouts
    assert narrow.cost >= wide.cost - 1e-15                               # a smaller search is never cheaper
