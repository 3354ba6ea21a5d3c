"""On 4 real gloo ranks (one shared launch job, dist_scripts/rank_split_errors_worker.py): a batch that disagrees
on some ranks of a 2x2 mesh only raises ``ValueError`` on every rank, and the ranks' collectives still pair. On 8
(dist_scripts/from_local8_worker.py): ``dtensor_from_local`` of a dim split by two of three mesh dims."""
import os

import pytest

from dist_scripts import shared_launch

JOB = shared_launch.job(__name__, "rank_split_errors", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                                    "rank_split_errors_worker.py"), 4, timeout=120)


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB)[1]


def test_agreeing_replicas_are_laid_out(ranks):
    for r in ranks:
        assert r["replicas_agree"] == [[4, 3], 6.0, 2.0], r


def test_replicas_that_differ_on_one_mesh_row_raise_on_every_rank(ranks):
    """Ranks 2 and 3 (the tensor-parallel replicas of part 1) hold different labels: they find it and name their
    group; ranks 0 and 1, whose own group agrees, raise too, naming the ranks and dim that found it. A collective
    after the error pairs on every rank (the whole tensor of ones gathered)."""
    assert len(ranks) == 4
    for rank, r in enumerate(ranks):
        got = r["replicas_differ_on_one_row"]
        assert len(got) == 2, got
        message, after = got
        if rank in (2, 3):
            assert "batch field 1" in message and "differs between the ranks [2, 3] of mesh dim 'model'" in message, \
                message
        else:
            assert "found by rank 2 along mesh dim 'model', rank 3 along mesh dim 'model'" in message, message
            assert f"this rank {rank} saw no difference" in message, message
        assert after == 4.0


def test_a_dict_key_missing_on_one_rank_raises_on_every_rank(ranks):
    for rank, r in enumerate(ranks):
        got = r["key_missing_on_one_rank"]
        assert len(got) == 2, got
        message, after = got
        assert "batch field 'labels' is a tensor on some ranks and missing on others" in message, message
        assert "ranks alike: [[0, 1, 2], [3]]" in message and f"this rank {rank}" in message, message
        assert after == 4.0


JOB8 = shared_launch.job(__name__, "from_local8", os.path.join(os.path.dirname(__file__), "dist_scripts",
                                                               "from_local8_worker.py"), 8, timeout=180)


@pytest.fixture(scope="module")
def ranks8():
    return shared_launch.results(JOB8)[1]


def test_dtensor_from_local_agrees_a_dim_split_by_two_of_three_mesh_dims(ranks8):
    """On a 2x2x2 mesh, 7 rows over "a" x "b" (2, 2, 2, 1) and replicated over "c": [7, 3] on all 8 ranks, the
    rows in chunk order (the sizes were all-reduced over a group of 4 ranks the mesh never made: an error before);
    sizes that are no layout raise on every rank, and a collective afterwards still pairs."""
    assert len(ranks8) == 8
    for r in ranks8:
        assert r["uneven_over_two_of_three_dims"] == [[7, 3], [0, 0, 1, 1, 2, 2, 3]], r
        message, after = r["not_a_layout_raises_everywhere"]
        assert "sizes [2, 2, 1, 2]" in message and "mesh dims ['a', 'b']" in message, message
        assert after == 16.0


def test_per_rank_seeds_agree_on_a_stage_sub_mesh_without_a_flat_group(ranks8):
    """A pipeline stage's 2 x 2 sub-mesh of 8 ranks (no group of its 4 ranks): a replicated parameter and a dropout
    of a replicated activation under per-rank seeds are the sub-mesh's first rank's on all four (the agreement
    runs in the sub-mesh's own dim groups), and each stage keeps its own."""
    got = [r["per_rank_seeds_on_a_stage_sub_mesh"] for r in ranks8]
    for r in got:
        assert len(r) == 3 and r[2] is True, r
    assert [g[:2] for g in got[:4]] == [got[0][:2]] * 4 and [g[:2] for g in got[4:]] == [got[4][:2]] * 4
    assert got[0][:2] != got[4][:2]               # stages 0 and 4 were seeded differently: their own first ranks
