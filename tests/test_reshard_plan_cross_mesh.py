"""Cross-mesh reshard plans (pipeline stages): reshard, send to the same coordinate, reshard."""
import pytest

from autoparallel.mesh import ProcessMesh, mesh_from_shape
from autoparallel.placement import Replicate, Shard
from reshard import plan_cross_mesh, plan_reshard

NV_LAT, NV_BW = 5e-6, 300e9
IB_LAT, IB_BW = 1e-5, 25e9
STAGE0 = mesh_from_shape([2, 4], create_groups=False)                          # node 0
STAGE1 = ProcessMesh([[8, 9, 10, 11], [12, 13, 14, 15]], create_groups=False)  # node 1


def test_same_shape_meshes_slice_before_sending():
    p = plan_cross_mesh([16, 16], "float32", STAGE0, "S(0),R", STAGE1, "R,S(1)")
    assert p.placements_path() == ["(S(0), R)", "(S(0), S(1))", "(S(0), S(1))", "(R, S(1))"]
    assert [(s.collective, s.mesh_dim) for s in p.steps] == [("slice", 1), ("send_recv", -1), ("all_gather", 0)]
    send = p.steps[1]
    assert send.src_mesh == STAGE0 and send.dst_mesh == STAGE1
    assert send.bytes_per_rank == 128                                   # an 8x4 float32 shard
    assert send.seconds == pytest.approx(IB_LAT + 128 / IB_BW, rel=1e-12)
    assert p.steps[2].seconds == pytest.approx(NV_LAT + 128 / NV_BW, rel=1e-12)
    assert p.bytes_per_rank == 256
    assert p.src_spec.mesh == STAGE0 and p.dst_spec.mesh == STAGE1
    assert all(s.src_mesh is None for s in p.steps if s.collective != "send_recv")
    assert "mesh 2x4 [0..7] -> mesh 2x4 [8..15]" in str(p)


def test_partial_small_tensor_reduce_scatters_once_before_crossing():
    p = plan_cross_mesh([16, 16], "float32", STAGE0, "P,R", STAGE1, "R,R")
    # latency-bound: one reduce_scatter halves the message; slicing more would add a 4-rank gather
    assert p.placements_path() == ["(P(sum), R)", "(S(0), R)", "(S(0), R)", "(R, R)"]
    assert p.collectives == ["reduce_scatter", "send_recv", "all_gather"]
    assert [s.bytes_per_rank for s in p.steps] == [512, 512, 512]
    assert p.seconds == pytest.approx(2 * (NV_LAT + 512 / NV_BW) + IB_LAT + 512 / IB_BW, rel=1e-12)


def test_partial_large_tensor_sends_an_eighth_over_the_slow_link():
    p = plan_cross_mesh([4096, 4096], "float32", STAGE0, "P,R", STAGE1, "R,R")
    assert p.collectives == ["slice", "reduce_scatter", "send_recv", "all_gather", "all_gather"]
    assert p.steps[2].bytes_per_rank == 4096 * 4096 * 4 / 8


def test_replicated_to_replicated():
    small = plan_cross_mesh([16, 16], "float32", STAGE0, "R,R", STAGE1, "R,R")
    assert small.collectives == ["send_recv"] and small.bytes_per_rank == 1024
    big = plan_cross_mesh([4096, 4096], "float32", STAGE0, "R,R", STAGE1, "R,R")
    # bandwidth-bound: send 1/8 over InfiniBand, gather the rest over NVLink
    assert big.collectives == ["slice", "slice", "send_recv", "all_gather", "all_gather"]
    full = 4096 * 4096 * 4
    assert big.steps[2].bytes_per_rank == full / 8
    assert big.seconds == pytest.approx(IB_LAT + full / 8 / IB_BW + 4 * NV_LAT + 7 / 8 * full / NV_BW, rel=1e-12)


def test_same_mesh_delegates_to_plan_reshard():
    # the same plan (equal, not necessarily the same cached object: another test may clear the plan cache)
    assert plan_cross_mesh([16, 16], "float32", STAGE0, "S(0),R", STAGE0, "R,S(1)") == \
        plan_reshard([16, 16], "float32", STAGE0, "S(0),R", "R,S(1)")


def test_different_mesh_shapes_go_through_replicate():
    dst_mesh = ProcessMesh([8, 9], create_groups=False)
    p = plan_cross_mesh([16, 16], "float32", STAGE0, "P,R", dst_mesh, "S(0)")
    assert p.placements_path() == ["(P(sum), R)", "(R, R)", "(R)", "(S(0))"]
    assert p.collectives == ["all_reduce", "send_recv", "slice"]
    send = p.steps[1]
    assert (send.src, send.dst) == ((Replicate(), Replicate()), (Replicate(),))
    assert send.bytes_per_rank == 1024 and send.seconds == pytest.approx(IB_LAT + 1024 / IB_BW, rel=1e-12)
    # more destination ranks than sources: each source sends the tensor twice
    wide = ProcessMesh([[8, 9, 10, 11], [12, 13, 14, 15]], create_groups=False)
    p = plan_cross_mesh([16, 16], "float32", ProcessMesh([0, 1, 2, 3], create_groups=False), "S(1)", wide, "R,S(0)")
    assert p.collectives == ["all_gather", "send_recv", "slice"]
    assert p.steps[1].bytes_per_rank == 2 * 1024
    assert p.dst_spec.placements == (Replicate(), Shard(0))


def test_cross_mesh_input_errors():
    with pytest.raises(TypeError, match="dst_mesh must be a ProcessMesh"):
        plan_cross_mesh([16, 16], "float32", STAGE0, "R,R", [[8, 9]], "R,R")
    with pytest.raises(ValueError, match="dst_placements: expected 2 placements"):
        plan_cross_mesh([16, 16], "float32", STAGE0, "R,R", STAGE1, "R")
