"""Reshard planner: exact paths and hand-computed costs (pure, milliseconds)."""
import dataclasses
import math
import subprocess
import sys

import pytest

from autoparallel.mesh import ProcessMesh, mesh_from_shape
from autoparallel.placement import Partial, Replicate, Shard
from autoparallel.planner.cluster import default_cluster
from reshard import COLLECTIVES, ReshardPlan, ReshardStep, plan_reshard

# default cluster links (A100 nodes of 8): NVLink inside a node, InfiniBand HDR across nodes
NV_LAT, NV_BW = 5e-6, 300e9
IB_LAT, IB_BW = 1e-5, 25e9
GLOO = dataclasses.replace(default_cluster(), backend="gloo")


def mesh(*shape):
    return mesh_from_shape(list(shape), create_groups=False)


def nv(steps, nbytes):
    """alpha-beta seconds on NVLink."""
    return steps * NV_LAT + nbytes / NV_BW


def test_one_dim_shard_to_shard_is_one_all_to_all_of_three_sixteenths():
    p = plan_reshard([16, 16], "float32", mesh(4), "S(0)", "S(1)")
    tensor_bytes = 16 * 16 * 4
    assert p.collectives == ["all_to_all"]
    (s,) = p.steps
    assert (s.mesh_dim, s.src, s.dst) == (0, (Shard(0),), (Shard(1),))
    assert s.bytes_per_rank == 3 / 16 * tensor_bytes == 192
    assert s.seconds == pytest.approx(nv(3, 192), rel=1e-12)
    assert s.emulated is None
    assert p.bytes_per_rank == 192 and p.seconds == s.seconds


def test_2x4_slice_first_then_gather_moves_one_eighth():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),R", "R,S(1)")
    assert [(s.collective, s.mesh_dim) for s in p.steps] == [("slice", 1), ("all_gather", 0)]
    assert p.placements_path() == ["(S(0), R)", "(S(0), S(1))", "(R, S(1))"]
    assert p.steps[0].bytes_per_rank == 0 and p.steps[0].seconds == 0
    assert p.bytes_per_rank == 16 * 16 * 4 / 8 == 128
    assert p.seconds == pytest.approx(nv(1, 128), rel=1e-12)


def test_partial_to_replicate_is_one_all_reduce():
    p = plan_reshard([16, 16], "float32", mesh(4), "P(sum)", "R")
    b = 1024
    assert p.collectives == ["all_reduce"]
    assert p.bytes_per_rank == 2 * 3 / 4 * b == 1536
    assert p.seconds == pytest.approx(nv(6, 1536), rel=1e-12)


def test_partial_to_shard_is_one_reduce_scatter():
    p = plan_reshard([16, 16], "float32", mesh(4), "P", "S(0)")
    assert p.collectives == ["reduce_scatter"]
    assert p.bytes_per_rank == 3 / 4 * 1024 == 768
    assert p.seconds == pytest.approx(nv(3, 768), rel=1e-12)


def test_gloo_prices_reduce_scatter_as_its_all_reduce_emulation():
    p = plan_reshard([16, 16], "float32", mesh(4), "P", "S(0)", cluster=GLOO)
    assert p.collectives == ["reduce_scatter"]          # one step: ties with all_reduce + slice, fewer steps
    assert p.steps[0].emulated == "all_reduce + slice"
    assert p.bytes_per_rank == 1536
    assert p.seconds == pytest.approx(nv(6, 1536), rel=1e-12)
    assert p.backend == "gloo"


def test_gloo_all_to_all_keeps_its_bytes_over_pairwise_sends():
    p = plan_reshard([16, 16], "float32", mesh(4), "S(0)", "S(1)", cluster=GLOO)
    (s,) = p.steps
    assert s.collective == "all_to_all" and s.emulated == "pairwise send_recv"
    assert s.bytes_per_rank == 192
    assert s.seconds == pytest.approx(3 * nv(1, 256 / 4), rel=1e-12)


def test_gloo_avg_and_fp16_reductions_are_named_as_emulated():
    p = plan_reshard([16, 16], "float16", mesh(4), "P(avg)", "R", cluster=GLOO)
    assert p.steps[0].emulated == "all_reduce(sum) in float32 + scale"
    assert p.bytes_per_rank == 2 * 3 / 4 * 512                 # priced on the tensor's own bytes
    assert plan_reshard([16, 16], "float16", mesh(4), "P(avg)", "R").steps[0].emulated is None


def test_2x2x2_reduce_first_then_gather_ties_broken_by_state_order():
    p = plan_reshard([8, 8], "float32", mesh(2, 2, 2), "S(0),S(1),P", "R,R,R")
    # local (S0, S1, P) = 4x4 floats = 64 B: all_reduce 64 B, then gathers of 64 B and 128 B in either order
    assert p.placements_path() == ["(S(0), S(1), P(sum))", "(S(0), S(1), R)", "(R, S(1), R)", "(R, R, R)"]
    assert p.collectives == ["all_reduce", "all_gather", "all_gather"]
    assert [s.bytes_per_rank for s in p.steps] == [64, 64, 128]
    assert p.seconds == pytest.approx(nv(2, 64) + nv(1, 64) + nv(1, 128), rel=1e-12)


def test_2x2x2_slices_respect_nesting_order():
    p = plan_reshard([8, 8], "float32", mesh(2, 2, 2), "R,R,R", "S(0),S(1),S(0)")
    assert p.placements_path() == ["(R, R, R)", "(R, S(1), R)", "(S(0), S(1), R)", "(S(0), S(1), S(0))"]
    assert p.bytes_per_rank == 0 and p.seconds == 0


def test_nested_shards_slice_outer_first():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "R,R", "S(0),S(0)")
    assert p.placements_path() == ["(R, R)", "(S(0), R)", "(S(0), S(0))"]


def test_nested_shards_gather_inner_first():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),S(0)", "R,R")
    # (S0, S0) holds 2 rows = 128 B: gather dim 1 (3 x 128), then dim 0 (1 x 512)
    assert p.placements_path() == ["(S(0), S(0))", "(S(0), R)", "(R, R)"]
    assert p.bytes_per_rank == 384 + 512
    assert plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),S(0)", "S(0),R").bytes_per_rank == 384


def test_nested_outer_to_inner_latency_bound_small_tensor_gathers():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),S(0)", "R,S(0)")
    assert p.placements_path() == ["(S(0), S(0))", "(S(0), R)", "(R, R)", "(R, S(0))"]
    assert p.seconds == pytest.approx(nv(3, 384) + nv(1, 512), rel=1e-12)


def test_nested_outer_to_inner_bandwidth_bound_large_tensor_uses_all_to_all():
    p = plan_reshard([4096, 4096], "float32", mesh(2, 4), "S(0),S(0)", "R,S(0)")
    assert p.placements_path() == ["(S(0), S(0))", "(S(0), S(1))", "(R, S(1))", "(R, S(0))"]
    full = 4096 * 4096 * 4
    assert [s.bytes_per_rank for s in p.steps] == [3 / 4 * full / 8, full / 8, 3 / 4 * full / 4]
    assert p.seconds == pytest.approx(nv(3, 3 / 32 * full) + nv(1, full / 8) + nv(3, 3 / 16 * full), rel=1e-12)


def test_uneven_rows_priced_by_padded_chunk():
    # 7 rows over 4 ranks: chunks 2,2,2,1 -> every rank sends a padded 2-row chunk
    p = plan_reshard([7, 4], "float32", mesh(4), "S(0)", "R")
    assert p.collectives == ["all_gather"] and p.bytes_per_rank == 3 * (2 * 4 * 4)
    p = plan_reshard([7, 16], "float32", mesh(4), "S(0)", "S(1)")
    assert p.collectives == ["all_to_all"] and p.bytes_per_rank == 3 / 4 * (2 * 16 * 4)
    p = plan_reshard([7, 4], "float32", mesh(4), "P", "S(0)")
    assert p.collectives == ["reduce_scatter"] and p.bytes_per_rank == 3 / 4 * (7 * 4 * 4)


def test_uneven_large_tensor_all_to_all_then_gather_beats_padded_gather():
    # 5 rows over 4 pad to 2 rows (8 rows gathered); S(1) pads nothing: moving via S(1) sends fewer bytes
    small = plan_reshard([5, 16], "float32", mesh(4), "S(0)", "R")
    assert small.collectives == ["all_gather"]                       # latency-bound: one collective wins
    big = plan_reshard([5, 1 << 24], "float32", mesh(4), "S(0)", "R")
    assert big.collectives == ["all_to_all", "all_gather"]
    row = (1 << 24) * 4
    assert big.bytes_per_rank == 3 / 4 * (2 * row) + 3 * (5 * row / 4) < 3 * 2 * row


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_single_dim_transition(n):
    shape = [12, 6]                            # 6 over 4 pads to 2 columns: b(S(1)) = 12*2*4
    full = 12 * 6 * 4
    b = {0: full * math.ceil(12 / n) / 12, 1: full * math.ceil(6 / n) / 6}
    m = mesh(n)
    cases = {
        ("R", "S0"): (["slice"], 0),
        ("R", "S1"): (["slice"], 0),
        ("S0", "R"): (["all_gather"], (n - 1) * b[0]),
        ("S1", "R"): (["all_gather"], (n - 1) * b[1]),
        ("S0", "S1"): (["all_to_all"], (n - 1) / n * b[0]),
        ("S1", "S0"): (["all_to_all"], (n - 1) / n * b[1]),
        ("P", "R"): (["all_reduce"], 2 * (n - 1) / n * full),
        ("P", "S0"): (["reduce_scatter"], (n - 1) / n * full),
        ("P", "S1"): (["reduce_scatter"], (n - 1) / n * full),
        ("R", "P"): (["local"], 0),
        ("R", "Pmax"): (["local"], 0),
        ("S0", "P"): (["all_gather", "local"], (n - 1) * b[0]),
        ("P", "Pmax"): (["all_reduce", "local"], 2 * (n - 1) / n * full),
        ("Pmax", "R"): (["all_reduce"], 2 * (n - 1) / n * full),
        ("R", "R"): ([], 0),
        ("S1", "S1"): ([], 0),
    }
    names = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial("sum"), "Pmax": Partial("max")}
    for (a, z), (collectives, nbytes) in cases.items():
        p = plan_reshard(shape, "float32", m, (names[a],), (names[z],))
        assert p.collectives == collectives, (n, a, z, p.collectives)
        assert p.bytes_per_rank == pytest.approx(nbytes, rel=1e-12), (n, a, z)
        assert p.src_spec.placements == (names[a],) and p.dst_spec.placements == (names[z],)
        for s in p.steps:
            assert s.collective in COLLECTIVES and s.mesh_dim == 0


def test_partial_moves_between_mesh_dims_through_local():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "P,R", "R,P")
    assert p.placements_path() == ["(P(sum), R)", "(P(sum), P(sum))", "(R, P(sum))"]
    assert p.collectives == ["local", "all_reduce"] and p.bytes_per_rank == 1024


def test_reduce_types_never_mix_in_one_state():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "P(sum),R", "R,P(max)")
    assert p.placements_path() == ["(P(sum), R)", "(R, R)", "(R, P(max))"]


def test_inter_node_mesh_dim_uses_the_slow_link():
    m = mesh(2, 8)                             # mesh dim 0 groups span two nodes, dim 1 stays in a node
    p = plan_reshard([16, 16], "float32", m, "S(0),R", "R,R")
    assert p.seconds == pytest.approx(IB_LAT + 512 / IB_BW, rel=1e-12)
    p = plan_reshard([16, 16], "float32", m, "R,S(0)", "R,R")
    assert p.seconds == pytest.approx(nv(7, 7 * 128), rel=1e-12)


def test_slowest_group_of_a_mesh_dim_prices_the_step():
    m = ProcessMesh([[0, 1], [7, 8]], create_groups=False)      # groups of dim 1: [0, 1] intra, [7, 8] inter
    p = plan_reshard([16, 16], "float32", m, "R,S(0)", "R,R")
    assert p.seconds == pytest.approx(IB_LAT + 512 / IB_BW, rel=1e-12)


def test_size_one_mesh_dims_follow_the_rules_at_no_cost():
    p = plan_reshard([16, 16], "float32", mesh(1, 4), "S(0),R", "R,S(0)")
    assert p.bytes_per_rank == 0 and p.seconds == 0
    assert [(s.collective, s.mesh_dim) for s in p.steps] == [("all_gather", 0), ("slice", 1)]
    assert "mesh dim 0 has one rank" in p.steps[0].explain
    p = plan_reshard([16, 16], "float32", mesh(1, 4), "S(1),R", "P(sum),R")
    assert [(s.collective, s.mesh_dim, s.seconds) for s in p.steps] == [("all_gather", 0, 0.0), ("local", 0, 0.0)]
    p = plan_reshard([16, 16], "float32", mesh(4, 1), "R,P(sum)", "S(0),R")
    assert p.collectives == ["all_reduce", "slice"] and p.bytes_per_rank == 0


def test_scalar_and_empty_tensors():
    p = plan_reshard([], "float32", mesh(4), "P", "R")
    assert p.collectives == ["all_reduce"] and p.bytes_per_rank == 2 * 3 / 4 * 4
    p = plan_reshard([0, 4], "float32", mesh(4), "S(0)", "R")
    assert p.bytes_per_rank == 0


def test_equal_layouts_give_an_empty_plan():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),R", "S(0),R")
    assert p.steps == () and p.bytes_per_rank == 0 and p.seconds == 0
    assert "nothing to do" in str(p)


def test_plans_are_cached_and_inputs_normalized():
    a = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),R", "R,S(1)")
    b = plan_reshard((16, 16), "fp32", mesh(2, 4), (Shard(0), Replicate()), ["R", "S(1)"], cluster=None)
    assert a is b
    c = plan_reshard((16, 16), "float32", mesh(2, 4), (Shard(0), Replicate()), (Replicate(), Shard(1)),
                     cluster=default_cluster())
    assert c is a
    assert plan_reshard((16, 16), "float32", mesh(2, 4), "S(0),R", "R,S(1)", cluster=GLOO) is not a
    assert plan_reshard((16, 16), "float32", mesh(2, 4), "S(0),R", "R,S(1)") is a       # repeated exact call
    with pytest.raises(TypeError, match="global_shape must hold ints"):          # equal-hashing floats still fail
        plan_reshard((16.0, 16), "float32", mesh(2, 4), "S(0),R", "R,S(1)")


def test_plan_and_steps_are_frozen_and_complete():
    p = plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),R", "R,S(1)")
    assert isinstance(p, ReshardPlan) and all(isinstance(s, ReshardStep) for s in p.steps)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.steps = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.steps[0].collective = "all_reduce"
    s = p.steps[1]
    assert (s.src_placement, s.dst_placement) == (Shard(0), Replicate())
    assert s.src_mesh is None and s.dst_mesh is None and s.explain
    assert p.src_spec.mesh == p.dst_spec.mesh == mesh(2, 4) and p.src_spec.shape == (16, 16)
    d = p.to_dict()
    assert d["path"] == p.placements_path() and [x["collective"] for x in d["steps"]] == ["slice", "all_gather"]


def test_str_explains_the_path_step_by_step():
    text = str(plan_reshard([16, 16], "float32", mesh(2, 4), "S(0),R", "R,S(1)"))
    lines = text.splitlines()
    assert lines[0] == "reshard float32[16, 16] on mesh 2x4 (nccl): (S(0), R) -> (R, S(1))"
    assert lines[1].startswith("  1. mesh dim 1 (size 4): R -> S(1)  slice ")
    assert " 0 B  0 us " in lines[1] and "no communication" in lines[1]
    assert lines[2].startswith("  2. mesh dim 0 (size 2): S(0) -> R  all_gather ")
    assert " 128 B  5 us " in lines[2]
    assert lines[3] == "  total: 2 steps, 128 B per rank, 5 us"
    gloo = str(plan_reshard([16, 16], "float32", mesh(4), "P", "S(0)", cluster=GLOO))
    assert "reduce_scatter [emulated: all_reduce + slice]" in gloo


def test_importing_the_planner_does_not_import_paddle():
    code = ("import sys; from reshard import plan_reshard; from autoparallel.mesh import mesh_from_shape; "
            "plan_reshard([4, 4], 'float32', mesh_from_shape([2], create_groups=False), 'S(0)', 'R'); "
            "print('paddle' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
