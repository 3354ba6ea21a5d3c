"""ap.profile on real gloo ranks (4, one launch; DP2xTP2, TP4 and PP2xDP2 of the tiny GPT): per kind, the profile's
collective counts equal an independent wrapper of paddle.distributed and its bytes the hand-computed ring
sizes of the tensors that wrapper saw; the parts add up to each rank's step; every rank holds all four
breakdowns; rank 0's plot is written; the pipeline's sends and receives are counted and its waiting is bubble."""
import os
import pathlib

import pytest

from dist_scripts import shared_launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_scripts", "profile_worker.py")
JOB = shared_launch.job(__name__, "profile", WORKER, 4, args=lambda out: [out])


def _hand_bytes(name, nbytes, n):
    return {"all_reduce": 2 * (n - 1) / n * nbytes, "all_gather": (n - 1) * nbytes,
            "broadcast": float(nbytes), "send": float(nbytes), "recv": 0.0}[name]


@pytest.fixture(scope="module")
def results():
    plots, ranks = shared_launch.results(JOB)
    return ranks, pathlib.Path(plots)


@pytest.mark.parametrize("config", ["dp2tp2", "tp4", "pp2dp2"])
def test_profile_on_real_ranks(results, config):
    outs, plots = results
    for out in (o[config] for o in outs):
        spy = out["spy"]
        assert spy, "a DP/TP step communicates"
        counted = {k: v["count"] for k, v in out["kinds"].items()}
        assert counted == {n: sum(1 for c in spy if c[0] == n) for n in {c[0] for c in spy}}
        for name, k in out["kinds"].items():
            assert k["bytes"] == pytest.approx(sum(_hand_bytes(*c) for c in spy if c[0] == name))
            assert 0 <= k["wait"] <= k["seconds"]
        assert out["parts_sum"] == pytest.approx(out["step_s"], abs=1e-3)
        assert out["ranks"] == [0, 1, 2, 3]
        assert min(out["waits"].values()) >= 0
        if config != "pp2dp2":
            assert max(out["bubbles"].values()) == 0
        else:
            assert {"send", "recv"} <= set(out["kinds"])
            assert max(out["bubbles"].values()) > 0           # some stage waits for its neighbour
    assert os.path.getsize(os.path.join(plots, f"{config}.png")) > 1000
    assert "all_reduce" in outs[0][config]["table"]
