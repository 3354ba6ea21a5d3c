"""Reshard search against an independent oracle: a naive transition table and exhaustive short paths."""
import functools
import itertools

import pytest

from autoparallel.comm.cost import collective_seconds, emulated_bytes
from autoparallel.mesh import ProcessMesh, mesh_from_shape
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.planner.cluster import default_cluster
from autoparallel.spec import DistSpec
from reshard import plan_reshard

CLUSTER = default_cluster()
R = Replicate()


def _inner(state, i, d):
    return any(isinstance(p, Shard) and p.dim == d for p in state[i + 1:])


def oracle_collective(state, i, q):
    """The collective taking mesh dim i of ``state`` to ``q``, or None if the change is not one legal step."""
    p = state[i]
    others = {x.reduce_type for k, x in enumerate(state) if k != i and isinstance(x, Partial)}
    if isinstance(q, Partial) and others - {q.reduce_type}:
        return None
    kinds = (type(p).__name__, type(q).__name__)
    if kinds == ("Replicate", "Shard"):
        return None if _inner(state, i, q.dim) else "slice"
    if kinds == ("Shard", "Replicate"):
        return None if _inner(state, i, p.dim) else "all_gather"
    if kinds == ("Shard", "Shard"):
        return None if _inner(state, i, p.dim) or _inner(state, i, q.dim) else "all_to_all"
    if kinds == ("Partial", "Replicate"):
        return "all_reduce"
    if kinds == ("Partial", "Shard"):
        return None if _inner(state, i, q.dim) else "reduce_scatter"
    if kinds == ("Replicate", "Partial"):
        return "local"
    return None


@functools.lru_cache(maxsize=None)
def _oracle_cost(shape, mesh, state, i, collective, cluster=CLUSTER):
    n = mesh.shape[i]
    if collective in ("slice", "local") or n == 1:
        return 0.0, 0.0
    b = DistSpec(mesh, state, shape, "float32").local_nbytes()
    secs = max(collective_seconds(collective, b, n, cluster.link_for(g).latency_s,
                                  cluster.link_for(g).bandwidth_Bps, cluster.backend) for g in mesh.all_groups(i))
    return emulated_bytes(collective, b, n, cluster.backend), secs


def oracle_cost(shape, mesh, state, i, collective):
    """(bytes, seconds) of one step, straight from the shared cost formulas."""
    return _oracle_cost(tuple(shape), mesh, state, i, collective)


def oracle_edges(shape, mesh, state, dst):
    for i in range(mesh.ndim):
        options = [R] + [Shard(d) for d in range(len(shape))] + ([dst[i]] if isinstance(dst[i], Partial) else [])
        for q in options:
            if q == state[i]:
                continue
            c = oracle_collective(state, i, q)
            if c is not None:
                yield state[:i] + (q,) + state[i + 1:], c, i


def exhaustive_min(shape, mesh, src, dst, max_steps=4, measure=1):
    """Minimum total (bytes, seconds)[measure] over every path of at most ``max_steps`` steps."""
    best = {src: 0.0}
    layer = {src: 0.0}
    for _ in range(max_steps):
        nxt = {}
        for u, c in layer.items():
            for v, coll, i in oracle_edges(shape, mesh, u, dst):
                nc = c + oracle_cost(shape, mesh, u, i, coll)[measure]
                nxt[v] = min(nc, nxt.get(v, float("inf")))
        layer = nxt
        for v, c in nxt.items():
            best[v] = min(c, best.get(v, float("inf")))
    return best.get(dst, float("inf"))


def states(mesh, ndim, partials=(Partial("sum"),)):
    per_dim = [R] + [Shard(d) for d in range(ndim)] + list(partials)
    return list(itertools.product(per_dim, repeat=mesh.ndim))


MESHES_2D = [mesh_from_shape([2, 2], create_groups=False), mesh_from_shape([2, 4], create_groups=False),
             ProcessMesh([[0, 8], [1, 9]], create_groups=False),        # mesh dim 1 crosses nodes
             mesh_from_shape([1, 3], create_groups=False)]


@pytest.mark.parametrize("mesh", MESHES_2D, ids=["2x2", "2x4", "2x2-two-nodes", "1x3"])
@pytest.mark.parametrize("shape", [[8, 12], [7, 5]], ids=["even", "uneven"])
def test_dijkstra_matches_exhaustive_search_on_2d_meshes(mesh, shape):
    all_states = states(mesh, len(shape))
    for src, dst in itertools.product(all_states, repeat=2):
        p = plan_reshard(shape, "float32", mesh, src, dst)
        brute = exhaustive_min(shape, mesh, src, dst)
        assert p.seconds <= brute * (1 + 1e-9), (src, dst, p.placements_path())
        if len(p.steps) <= 4:
            assert p.seconds == pytest.approx(brute, rel=1e-9, abs=0), (src, dst, p.placements_path())
        # every step is one legal oracle edge, priced as the oracle prices it
        state = src
        for s in p.steps:
            assert s.src == state
            assert (s.dst, s.collective, s.mesh_dim) in set(oracle_edges(shape, mesh, state, dst))
            nbytes, secs = oracle_cost(shape, mesh, state, s.mesh_dim, s.collective)
            assert s.bytes_per_rank == nbytes and s.seconds == secs
            state = s.dst
        assert state == dst


def test_brute_force_finds_every_path_the_planner_is_compared_with():
    """The oracle is not vacuous: a cross-dim move with a forced order needs several steps."""
    m = mesh_from_shape([2, 4], create_groups=False)
    src, dst = (Shard(0), Shard(0)), (Shard(1), Shard(0))
    assert exhaustive_min([8, 12], m, src, dst, max_steps=1) == float("inf")
    assert exhaustive_min([8, 12], m, src, dst) == pytest.approx(plan_reshard([8, 12], "float32", m, src, dst).seconds)


EVEN_SHAPES = [[24], [24, 48], [48, 24, 72], [96, 72], [3 << 12, 3 << 12]]   # divisible by 2, 3, 4, 8
UNEVEN_LARGE = [[5, 1 << 24], [7 << 20, 3], [1 << 22, 9]]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_single_dim_min_cost_is_min_bytes(n):
    m = mesh_from_shape([n], create_groups=False)
    checked = 0
    for shape in EVEN_SHAPES + UNEVEN_LARGE:
        for src, dst in itertools.product(states(m, len(shape), (Partial("sum"), Partial("max"))), repeat=2):
            p = plan_reshard(shape, "float32", m, src, dst)
            assert p.bytes_per_rank == pytest.approx(exhaustive_min(shape, m, src, dst, 3, measure=0),
                                                     rel=1e-12, abs=0), (shape, src, dst, p.collectives)
            checked += 1
    assert checked > 150


def test_latency_bound_padded_gather_is_the_exception_to_min_bytes():
    """A small uneven tensor: one padded all_gather is faster than all_to_all + all_gather moving fewer bytes."""
    m = mesh_from_shape([4], create_groups=False)
    p = plan_reshard([5, 16], "float32", m, "S(0)", "R")
    assert p.collectives == ["all_gather"] and p.bytes_per_rank == 384
    assert exhaustive_min([5, 16], m, (Shard(0),), (R,), measure=0) == 336


def test_ties_prefer_fewer_steps_then_state_order():
    m = mesh_from_shape([4], create_groups=False)
    # all_reduce == reduce_scatter + all_gather in bytes and latency: the single step wins
    assert plan_reshard([16, 16], "float32", m, "P", "R").collectives == ["all_reduce"]
    m2 = mesh_from_shape([2, 2], create_groups=False)
    # two free slices in either order: "(R, S(1))" sorts before "(S(0), R)"
    assert plan_reshard([8, 8], "float32", m2, "R,R", "S(0),S(1)").placements_path() == \
        ["(R, R)", "(R, S(1))", "(S(0), S(1))"]


def test_dijkstra_matches_exhaustive_search_on_a_2x2x2_mesh_sample():
    m = mesh_from_shape([2, 2, 2], create_groups=False)
    pairs = list(itertools.product(states(m, 2), repeat=2))
    for src, dst in pairs[::37]:
        p = plan_reshard([8, 6], "float32", m, src, dst)
        brute = exhaustive_min([8, 6], m, src, dst, max_steps=4)
        assert p.seconds <= brute * (1 + 1e-9), (src, dst)
        if len(p.steps) <= 4:
            assert p.seconds == pytest.approx(brute, rel=1e-9, abs=0), (src, dst, p.placements_path())
