"""no_sync accumulation, gradient penalties (create_graph through collectives), an input's gradient and parameter
vectors on 4 real gloo ranks, each against the one-process run on the same rank, and paddle.DataParallel over a
parallelized model refused there (one job of the shared 4-rank launch, tests/dist_scripts/loops2_worker.py); the control cuts the
second-order terms at the collectives."""
import os

import pytest

from dist_scripts import shared_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "loops2_worker.py")
JOB = shared_launch.job(__name__, "loops2_real", WORKER, 4, timeout=240)
FORMS = 13


@pytest.fixture(scope="module")
def ranks():
    _, ranks = shared_launch.results(JOB)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    return ranks


def test_forms_equal_one_process_on_real_ranks(ranks):
    for r in ranks:
        assert len(r["forms"]) == FORMS, sorted(r["forms"])
        for name, got in r["forms"].items():
            assert "error" not in got, f"{name}, rank {r['rank']}:\n{got['error']}"
            assert got["err"] <= 1.0, f"{name}, rank {r['rank']}: {got['err']:.3g} x the tolerance"


def test_cut_second_order_is_seen_on_real_ranks(ranks):
    for r in ranks:
        got = r["negative"]["cut"]
        assert "error" not in got, got.get("error")
        assert got["err"] > 1.0, (r["rank"], got["err"])
