"""The same user programs on 4 real gloo ranks, 2 x 2 meshes (dp x mp, and a permuted one), through paddle's own
auto-parallel and through ``import autoparallel as dist`` (job ``vs_paddle_native4`` of the shared 4-rank launch:
dist_scripts/vs_paddle_native_worker.py with the programs of vs_paddle_native_programs4.py). As on 2 ranks
(test_probe_vs_paddle_native.py): global values and the local shards of placed tensors must agree with paddle's on
every rank; where paddle raises on CPU, aborts, hangs or is wrong, ours is checked against numpy. The differences
are documented in docs/vs_paddle_native.md ("4 ranks")."""
import os

import pytest

from dist_scripts import shared_launch

HERE = os.path.join(os.path.dirname(__file__), "dist_scripts")
SET = "vs_paddle_native_programs4"
JOB4 = shared_launch.job(__name__, "vs_paddle_native4", os.path.join(HERE, "vs_paddle_native_worker.py"), 4,
                         args=[SET], timeout=150)

from vs_paddle_native_programs import A73                                       # noqa: E402
from vs_paddle_native_programs4 import (ORACLES, OURS_DIFFER, PADDLE_RAISES, PADDLE_WRONG,   # noqa: E402
                                        PROGRAMS)
from vs_paddle_native_worker import _close, compare, layout_local, oracle_diffs   # noqa: E402

BY_NAME = {p.__name__: p for p in PROGRAMS}
PADDLE_NOT_RUN = {n for n, p in BY_NAME.items() if getattr(p, "paddle_skip", None)}
CHECKED_OTHERWISE = set(PADDLE_RAISES) | PADDLE_WRONG | set(OURS_DIFFER) | PADDLE_NOT_RUN


@pytest.fixture(scope="module")
def ranks():
    return shared_launch.results(JOB4)[1]


def _ours(ranks, name):
    outs = [r[name]["ap"] for r in ranks]
    for r, o in enumerate(outs):
        assert "error" not in o, f"rank {r}: {o.get('trace', o.get('error'))}"
    return outs


def _check_ours(name, outs):
    """A reshard: the global value is its input, each rank's shard the layout's slice of it; else numpy's values."""
    prog = BY_NAME[name]
    for r, o in enumerate(outs):
        if hasattr(prog, "expect"):
            got = o["out"]
            assert _close(got["value"], prog.expect), (name, r)
            assert _close(got["local"], layout_local(prog.expect, got["placements"], (2, 2), r, prog.mesh_ids)), \
                (name, r)
        else:
            assert oracle_diffs(name, o, r, ORACLES) == [], (name, r)


@pytest.mark.parametrize("name", [n for n in BY_NAME if n not in CHECKED_OTHERWISE])
def test_equal_to_paddle_native(ranks, name):
    for r, res in enumerate(ranks):
        assert compare(res[name]) == [], f"rank {r}: {compare(res[name])}\n{res[name]['ap'].get('trace', '')}"


@pytest.mark.parametrize("name", [n for n in BY_NAME if n.startswith("reshard4_")])
def test_reshard_local_shards_are_the_layouts(ranks, name):
    """Every reshard on the 2 x 2 meshes, paddle's or not: each rank holds the ceil-division slice (two mesh dims
    on one tensor dim split it in mesh-dim order: 7 rows are 2, 2, 2, 1)."""
    _check_ours(name, _ours(ranks, name))


@pytest.mark.parametrize("name", sorted(PADDLE_RAISES))
def test_where_paddle_raises_on_cpu_ours_is_numpys(ranks, name):
    for res in ranks:
        assert PADDLE_RAISES[name] in res[name]["paddle"].get("error", ""), res[name]["paddle"]
    _check_ours(name, _ours(ranks, name))


@pytest.mark.parametrize("name", sorted(PADDLE_WRONG))
def test_where_paddle_is_wrong_ours_is_numpys(ranks, name):
    assert any(compare(res[name]) for res in ranks), f"{name}: paddle now agrees; move it to the equal programs"
    _check_ours(name, _ours(ranks, name))


@pytest.mark.parametrize("name", sorted(PADDLE_NOT_RUN - set(OURS_DIFFER)))
def test_where_paddle_aborts_or_hangs_ours_is_numpys(ranks, name):
    """paddle is not run (7 rows over both mesh dims abort it in gloo; uneven dtensor_from_local hangs)."""
    assert ranks[0][name]["paddle"] == {"skipped": BY_NAME[name].paddle_skip}
    _check_ours(name, _ours(ranks, name))


def test_shard_tensor_over_both_mesh_dims_of_one_tensor_dim(ranks):
    """[S(0), S(0)] of 7 rows: 2, 2, 2, 1 in mesh order, on the mesh and on the permuted one's numbering."""
    want = [A73[0:2], A73[2:4], A73[4:6], A73[6:7]]
    for r, o in enumerate(_ours(ranks, "shard_tensor_2x2_S0S0")):
        assert _close(o["S0S0"]["local"], want[r]), r


def test_dtensor_from_local_agrees_sizes_split_over_two_mesh_dims(ranks):
    """Shards of 2, 2, 2, 1 rows over [S(0), S(0)]: each rank agreed its size over one mesh dim at a time and
    took the sizes [2, 1] of ranks 1 and 3 for no layout: ranks 1 and 3 raised while 0 and 2 waited in the next
    all-reduce (the job hung). Now the sizes are agreed over both mesh dims at once: [7, 3] on every rank."""
    for r, o in enumerate(_ours(ranks, "from_local4_uneven")):
        assert o["s"]["shape"] == [7, 3] and _close(o["s"]["value"], A73), r
        assert _close(o["s"]["local"], A73[2 * r:2 * r + 2]), r
        assert o["x"]["shape"] == [7, 3] and _close(o["x"]["value"], A73), r
    for r, res in enumerate(ranks):
        err = res["from_local4_not_a_layout"]["ap"]["error"]
        assert err.startswith("ValueError: dtensor_from_local: the local shards along dim 0 have sizes [1, 2, 2, 2] "
                              "on the ranks [0, 1, 2, 3] of mesh dims ['dp', 'mp']"), (r, err)


def test_sub_meshes_are_paddles(ranks):
    for res in ranks:
        o = res["sub_meshes"]["ap"]
        assert o["mt_ids"]["value"] == [0, 2, 1, 3] and o["m0_ids"]["value"] == [0, 1]
        assert o["mp0_ids"]["value"] == [0, 2]


def test_placements_are_reported_for_every_program(ranks):
    for res in ranks:
        for name, o in res.items():
            for side in ("paddle", "ap"):
                for k, v in o[side].items():
                    if isinstance(v, dict) and "local" in v:
                        assert v["placements"].startswith("[S(") or v["placements"][:2] in ("[R", "[P"), \
                            (name, side, k, v["placements"])
