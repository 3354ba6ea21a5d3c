"""One reshard cache: keyed by the cluster (or the epoch of the runtime's planning cluster), never by id()."""
import numpy as np
import pytest

import autoparallel as ap
from autoparallel.core.cluster import parse_cluster
from autoparallel.core.mesh import mesh_from_shape
from reshard import cache, clear_cache, cluster_epoch, plan_reshard

ONE_NODE, TWO_NODES = "1x8:A100-80GB", "2x4:A100-80GB"
# (S(0), P) -> (R, R) on a 2x4 mesh: on one node the all_reduce comes first; when mesh dim 0 crosses nodes the
# planner reduce-scatters over the fast dim first, so the slow dim gathers a quarter of the bytes
ON_ONE_NODE = ["all_reduce", "all_gather"]
ON_TWO_NODES = ["reduce_scatter", "all_gather", "all_gather"]


def test_the_plan_depends_on_the_cluster_it_is_given():
    mesh = mesh_from_shape([2, 4], create_groups=False)
    one = plan_reshard([64, 64], "float32", mesh, "S(0),P", "R,R", parse_cluster(ONE_NODE))
    two = plan_reshard([64, 64], "float32", mesh, "S(0),P", "R,R", parse_cluster(TWO_NODES))
    assert one.collectives == ON_ONE_NODE and two.collectives == ON_TWO_NODES


def test_clear_cache_empties_it_and_plans_come_back_equal():
    mesh = mesh_from_shape([2, 4], create_groups=False)
    first = plan_reshard([64, 64], "float32", mesh, "S(0),P", "R,R", ONE_NODE)
    assert cache.size() > 0
    clear_cache()
    assert cache.size() == 0
    again = plan_reshard([64, 64], "float32", mesh, "S(0),P", "R,R", ONE_NODE)
    assert again == first and again is not first and cache.size() > 0


def _runtime_plans(monkeypatch, clusters):
    """The plan ap.reshard runs for the same (S(0), P) -> (R, R) reshard under each ap.set_cluster value."""
    import paddle

    from autoparallel import redistribute

    ran, execute = [], redistribute.execute
    monkeypatch.setattr(redistribute, "execute", lambda locs, plan, *a: ran.append(plan) or execute(locs, plan, *a))
    mesh = mesh_from_shape([2, 4])
    x = np.arange(64, dtype="float32").reshape(8, 8)
    out = []
    with ap.simulate(8):
        dt = ap.shard_tensor(paddle.to_tensor(x), mesh, [ap.Shard(0), ap.Partial()])
        try:
            for c in clusters:
                ap.set_cluster(c)
                y = ap.reshard(dt, mesh, [ap.Replicate(), ap.Replicate()])
                assert np.array_equal(y.full().numpy(), x)
                out.append(ran[-1].collectives)
        finally:
            ap.set_cluster(None)
    return out


def test_changing_the_cluster_override_changes_the_plan_of_the_same_reshard(monkeypatch):
    before = cluster_epoch()
    assert _runtime_plans(monkeypatch, [ONE_NODE, TWO_NODES, ONE_NODE]) == [ON_ONE_NODE, ON_TWO_NODES, ON_ONE_NODE]
    assert cluster_epoch() >= before + 4                   # every set_cluster renews it, the reset too


def test_negative_control_without_the_epoch_a_stale_plan_is_served(monkeypatch):
    import reshard.cache

    monkeypatch.setattr(reshard.cache, "bump_epoch", lambda: None)
    clear_cache()
    try:
        assert _runtime_plans(monkeypatch, [ONE_NODE, TWO_NODES]) == [ON_ONE_NODE, ON_ONE_NODE]
    finally:
        clear_cache()                        # no stale entry outlives the test


def test_the_dispatch_cache_keys_on_the_epoch_not_the_override_object():
    from autoparallel import dispatch_cache

    with ap.simulate(4):
        world = ap.current_world()
        k0 = dispatch_cache.full_key("rule", "paddle.matmul", world, ("args",))
        ap.set_cluster(TWO_NODES)
        try:
            k1 = dispatch_cache.full_key("rule", "paddle.matmul", world, ("args",))
        finally:
            ap.set_cluster(None)
        k2 = dispatch_cache.full_key("rule", "paddle.matmul", world, ("args",))
    assert len({k0, k1, k2}) == 3 and cluster_epoch() in k2


@pytest.mark.parametrize("bad", ["x", 3])
def test_a_refused_cluster_keeps_the_epoch(bad):
    before = cluster_epoch()
    with pytest.raises((ValueError, TypeError)):
        ap.set_cluster(bad)
    assert cluster_epoch() == before


def test_each_kind_is_bounded_and_a_full_kind_is_dropped_alone(monkeypatch):
    mesh = mesh_from_shape([4], create_groups=False)
    clear_cache()
    monkeypatch.setitem(cache.LIMITS, "plan", 2)
    plans = [plan_reshard((8 * k, 4), "float32", mesh, "S(0)", "R") for k in (1, 2, 3)]
    assert [p.src_spec.shape for p in plans] == [(8, 4), (16, 4), (24, 4)]
    assert len(cache._SECTIONS["plan"]) == 1              # the third plan found the section full: dropped, then kept
    assert len(cache._SECTIONS["args"]) == 3              # other kinds keep their entries
    assert plan_reshard((8, 4), "float32", mesh, "S(0)", "R") is plans[0]     # served by its exact arguments
