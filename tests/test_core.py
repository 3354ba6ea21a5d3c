"""Pure tier: placements, meshes, specs, cost formulas and their errors."""
import pytest

import autoparallel as ap
from autoparallel.comm.cost import collective_bytes, collective_seconds, emulated_bytes
from autoparallel.mesh import mesh_from_shape
from autoparallel.placement import chunk_sizes, format_placements, parse_placement, parse_placements
from autoparallel.planner.cluster import parse_cluster


def test_placement_strings_roundtrip():
    for text in ["S(0)", "S(3)", "R", "P(sum)", "P(avg)", "P(max)", "P(min)"]:
        assert str(parse_placement(text)) == text
    assert parse_placement("P") == ap.Partial("sum")
    assert parse_placements("S(0),R") == (ap.Shard(0), ap.Replicate())
    assert parse_placements("[S(1), P(max)]") == (ap.Shard(1), ap.Partial("max"))
    assert format_placements([ap.Shard(0), ap.Replicate()]) == "(S(0), R)"


def test_placements_are_frozen_and_hashable():
    assert len({ap.Shard(0), ap.Shard(0), ap.Replicate(), ap.Replicate(), ap.Partial()}) == 3
    with pytest.raises(Exception):
        ap.Shard(0).dim = 1


@pytest.mark.parametrize("bad", ["S(x)", "Q", "S(0", "P(prod)", ""])
def test_malformed_placement_strings(bad):
    with pytest.raises(ValueError, match="malformed|expected|Partial"):
        parse_placements(bad) if bad else parse_placement(bad)


def test_unknown_reduce_type():
    with pytest.raises(ValueError, match="sum.*avg.*max.*min.*got 'prod'"):
        ap.Partial("prod")


def test_shard_dim_type():
    with pytest.raises(TypeError):
        ap.Shard("0")


def test_chunk_sizes_ceil_division():
    assert chunk_sizes(7, 4) == [2, 2, 2, 1]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]
    assert chunk_sizes(6, 4) == [2, 2, 2, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]
    assert sum(chunk_sizes(1001, 8)) == 1001


def test_mesh_basics():
    mesh = ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])
    assert mesh.shape == [2, 4] and mesh.ndim == 2 and mesh.get_dim_size("model") == 4
    assert mesh.coords_of(6) == (1, 2)
    assert mesh.group_ranks("data", 6) == [2, 6]
    assert mesh.group_ranks("model", 6) == [4, 5, 6, 7]
    assert mesh.all_groups("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.get_submesh_with_dim("data", 1).process_ids == [4, 5, 6, 7]
    assert mesh[0].process_ids == [0, 1, 2, 3]
    assert mesh[:, 1].process_ids == [1, 5] and mesh[:, 1].dim_names == ["data"]
    assert mesh == ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["data", "model"])


@pytest.mark.parametrize("ranks,names,err", [
    ([0, 1, 1], None, "unique"), ([0, -1], None, "non-negative"), ([[0, 1], [2, 3]], ["x"], "dim_names"),
    ([[0, 1], [2]], None, "rectangular"), ([0.5, 1], None, "integer"), ([[0, 1]], ["a", "a"], "unique"),
])
def test_mesh_errors(ranks, names, err):
    with pytest.raises((ValueError, TypeError), match=err):
        ap.ProcessMesh(ranks, names)


def test_rank_not_in_mesh():
    mesh = mesh_from_shape([2, 2])
    with pytest.raises(ValueError, match="rank 9 is not in the mesh"):
        mesh.coords_of(9)


def test_spec_local_shapes_uneven_and_nested():
    mesh = mesh_from_shape([2, 4])
    spec = ap.DistSpec(mesh, (ap.Shard(0), ap.Shard(1)), (7, 5))
    assert [spec.local_shape(r) for r in range(8)] == [(4, 2), (4, 2), (4, 1), (4, 0), (3, 2), (3, 2), (3, 1), (3, 0)]
    nested = ap.DistSpec(mesh, (ap.Shard(0), ap.Shard(0)), (7, 3))
    assert [nested.local_shape(r)[0] for r in range(8)] == [1, 1, 1, 1, 1, 1, 1, 0]
    assert nested.local_range((1, 2), 0) == (6, 7)
    assert spec.max_local_shape() == (4, 2) and spec.local_nbytes() == 4 * 2 * 4


@pytest.mark.parametrize("placements,err", [
    ((ap.Shard(0), ap.Replicate(), ap.Replicate()), "expected 2 placements"), ((ap.Shard(2), ap.Replicate()), "out of range"),
    (("S(0)", 3), "placements must be|malformed|expected"),
])
def test_spec_errors(placements, err):
    with pytest.raises((ValueError, TypeError), match=err):
        ap.DistSpec(mesh_from_shape([2, 2]), placements, (4, 4))


def test_spec_is_hashable_cache_key():
    mesh = mesh_from_shape([2, 2])
    a = ap.DistSpec(mesh, ("S(0)", "R"), (4, 4), "float32")
    b = ap.DistSpec(mesh_from_shape([2, 2]), (ap.Shard(0), ap.Replicate()), [4, 4], "paddle.float32")
    assert a == b and hash(a) == hash(b)


def test_collective_byte_formulas():
    b, n = 1000.0, 4
    assert collective_bytes("all_gather", b, n) == 3000
    assert collective_bytes("reduce_scatter", b, n) == 750
    assert collective_bytes("all_reduce", b, n) == 1500
    assert collective_bytes("all_to_all", b, n) == 750
    assert collective_bytes("send_recv", b, 2) == 1000
    assert collective_bytes("slice", b, n) == 0
    # gloo emulates reduce_scatter with an all_reduce and keeps all_to_all's bytes
    assert emulated_bytes("reduce_scatter", b, n, "gloo") == 1500
    assert emulated_bytes("all_to_all", b, n, "gloo") == 750


def test_collective_seconds_alpha_beta():
    t = collective_seconds("all_reduce", 1e6, 4, latency_s=1e-5, bandwidth_Bps=1e9)
    assert t == pytest.approx(6 * 1e-5 + 1.5e6 / 1e9)


def test_cluster_spec_strings():
    c = parse_cluster("128x8:A100-80GB")
    assert c.world_size == 1024 and c.devices_per_node == 8
    assert c.link_for([0, 7]) is c.intra_node and c.link_for([7, 8]) is c.inter_node
    for bad in ["128x8", "0x8:A100-80GB", "2x8:Z100"]:
        with pytest.raises(ValueError):
            parse_cluster(bad)
