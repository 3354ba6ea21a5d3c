"""Random draws across real ranks seeded differently (``paddle.seed(100 + rank)``), or not at all: replicas of a
drawn tensor must hold one value, and the shards of a draw must be slices of one global draw (the project's rule:
a single process's draw under the first mesh rank's generator state, ``autoparallel/rng_agree.py``). Parameters
laid out by ``shard_tensor`` / ``parallelize`` (built eagerly or lazily) take the first rank's initial value. One
2-rank and one 4-rank job (tests/dist_scripts/random7_worker.py); in-process: the simulated world makes one draw
for all ranks."""
import os

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from dist_scripts import shared_launch
from random7_worker import OPS

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "random7_worker.py")
JOB2 = shared_launch.job(__name__, "random7_2", WORKER, 2, timeout=200)
JOB4 = shared_launch.job(__name__, "random7_4", WORKER, 4, timeout=200)
SINGLE = [name for name, *_, against in OPS if against == "single"]
RANKS = [name for name, *_, against in OPS if against == "ranks"]


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return shared_launch.results(JOB2 if request.param == 2 else JOB4)[1]


@pytest.mark.parametrize("op", SINGLE)
def test_draw_equals_the_first_ranks_single_process_draw(ranks, op):
    for res in ranks:
        for key in ("ops", "ops2d"):
            if key in res:
                assert res[key][op] is True, f"rank {res['rank']} {key}: {op} differs from one process's draw"


@pytest.mark.parametrize("op", RANKS)
def test_replicas_of_a_composite_draw_agree(ranks, op):
    for key in ("ops", "ops2d"):
        values = [np.asarray(res[key][op]) for res in ranks if key in res]
        for r, v in enumerate(values[1:], 1):
            assert np.array_equal(v, values[0]), f"{key}: {op} on rank {r} differs from rank 0's replica"


def test_each_rank_keeps_its_own_generator_after_an_agreed_draw(ranks):
    assert all(res["after"] is True for res in ranks), [res["after"] for res in ranks]


def test_parameters_are_one_initialisation_under_per_rank_seeds(ranks):
    for res in ranks:
        for key in ("params", "params2d"):
            if key in res:
                want = {"R": True, "S1": True, "R_lazy": True, "S1_lazy": True}
                assert res[key] == want, f"rank {res['rank']} {key}: {res[key]}"


def test_tensor_parallel_training_with_dropout_matches_one_process(ranks):
    for res in ranks:
        got, want = res["training"]["got"], res["training"]["want"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {res['rank']}")


def test_simulated_world_draws_once_for_all_ranks():
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((4, 6)).astype("float32"))
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        paddle.seed(100)
        got = {r: t.numpy() for r, t in F.dropout(ap.shard_tensor(x, mesh, [ap.Replicate()]), 0.5).locals.items()}
    paddle.seed(100)
    want = F.dropout(x, 0.5).numpy()
    assert sorted(got) == [0, 1]
    for v in got.values():
        np.testing.assert_array_equal(v, want)


@pytest.mark.parametrize("form", ["tp", "tp_sp"])
def test_paddleformers_llama_dropout_under_tp_matches_one_process(form):
    for res in shared_launch.results(JOB2)[1]:
        got, want = res["llama"][form], res["llama"]["want"]
        assert want[0] != want[1], "dropout is not drawing: the two training-mode forwards agree"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {res['rank']} {form}")
